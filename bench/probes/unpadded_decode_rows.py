"""Probe: is the unpadded decode path (HybridModel with decode_rows=None: every GEMM on the graph bucket's rows,
not on 64) batch-invariant under the engine's CUDA numerics (cuBLASLt, 1-byte workspace)? Rows decoded in
batches of 1, 3 and 8 against the same rows in a batch of 64, 8 greedy steps each, logits compared bitwise;
and the graph step time of both paths at b = 1 / 8 / 64. MoE (35B-A3B shape) and dense (9B shape), random
weights. Writes rows.json to $OUT (or the current directory).

    python bench/probes/unpadded_decode_rows.py"""
import json, os, sys, time
import torch
from capsulert.engine.engine import Engine
from capsulert.engine.model import HybridModel
from capsulert.engine.graphs import GraphPlans

out = {}
for label, model in [("moe", "random:capsulert/configs/models/qwen3_5-35b-a3b-shape.yaml"),
                     ("dense", "random:capsulert/configs/models/qwen3_5-9b-shape.yaml")]:
    eng = Engine.from_config(model=model, device="cuda", dtype="bfloat16", slots=66, max_seq=4096, prefill_chunk=1024)
    m = HybridModel(eng.model_cfg, eng.model_weights, eng.model.kernels)
    fast = GraphPlans(m, eng.state, eng.runner.scratch_slot, eng.config.max_seq, 1024, eng.graphs.decode_batches, eng.grid)
    fast.capture(prefill=False)
    g = torch.Generator().manual_seed(3)
    base = torch.randint(0, eng.model_cfg.vocab_size, (2048 + 200,), generator=g).tolist()
    s = eng.open(); s.append(base[:2048]); eng.snapshot(s, "ctx"); s.close()

    def run(rows, B):
        sess = eng.fork("ctx", len(rows))
        for x, r in zip(sess, rows):
            x.append([base[2048 + r]])
        slots = [x.slot for x in sess]
        toks = [base[2100 + r] for r in rows]
        logits = []
        for step in range(8):
            lg = fast.decode(slots, toks)[:len(rows)].clone()
            logits.append(lg)
            toks = lg.argmax(-1).tolist()
        for x in sess:
            x.close()
        return torch.stack(logits, 1)  # [rows, steps, vocab]
    res = {}
    full = run(list(range(64)), 64)
    for B in (1, 3, 8):
        ok = True
        for start in (0, 5, 56):
            rows = list(range(start, start + B))
            part = run(rows, B)
            ok &= torch.equal(part, full[start:start + B])
        res[f"b{B}_equals_b64"] = bool(ok)
    # timing: unpadded vs padded graph step
    for B in (1, 8, 64):
        sess = eng.fork("ctx", B); slots = [x.slot for x in sess]; toks = base[:B]
        for plans, name in ((fast, "unpadded"), (eng.graphs, "padded")):
            for _ in range(3): plans.decode(slots, toks)
            torch.cuda.synchronize(); t = time.perf_counter()
            for _ in range(20): plans.decode(slots, toks)
            torch.cuda.synchronize(); res[f"{name}_b{B}_ms"] = round((time.perf_counter() - t) / 20 * 1e3, 3)
        for x in sess: x.close()
    print(label, res, flush=True)
    out[label] = res
    del eng, fast, m, s
    import gc; gc.collect()
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "rows.json"), "w"), indent=1)
