"""Probe: where does a decode row's bits first change with the row count on the unpadded path (every dense op on
the batch's rows, not on 64)? One eager decode step of the same sessions as rows of a 64-row batch, of a 4-row
batch (3 sessions + the scratch slot, as a graph bucket of 4 runs them), of a 3-row batch and of 1 row; every
F.linear and kernel call's output rows recorded and compared with the 64-row step's, call by call. Then the
graph path: 8 greedy steps at b = 3 (bucket 4) against b = 64. MoE (35B-A3B shape) by default.

    python bench/probes/decode_rows_trace.py [--model random:...yaml]"""
import argparse
import dataclasses
import json
import os

import torch
import torch.nn.functional as F

from capsulert.engine.engine import Engine
from capsulert.engine.graphs import GraphPlans
from capsulert.engine.model import HybridModel

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="random:capsulert/configs/models/qwen3_5-35b-a3b-shape.yaml")
args = ap.parse_args()

eng = Engine.from_config(model=args.model, device="cuda", dtype="bfloat16", slots=66, max_seq=4096,
                         prefill_chunk=1024)
calls: list[tuple[str, object]] = []
rows_now = [0]


def record(name, out):
    for t in (out if isinstance(out, tuple) else (out,)):
        keep = t[:3].clone() if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == rows_now[0] else None
        calls.append((f"{name}{tuple(t.shape) if isinstance(t, torch.Tensor) else ''}", keep))
    return out


linear = F.linear
torch.nn.functional.linear = lambda x, w, b=None: record("linear", linear(x, w, b))
ks = eng.model.kernels
wrapped = {f.name: (lambda fn, n: (lambda *a, **k: record(n, fn(*a, **k))))(getattr(ks, f.name), f.name)
           for f in dataclasses.fields(ks) if callable(getattr(ks, f.name))}
m = HybridModel(eng.model_cfg, eng.model_weights, dataclasses.replace(ks, **wrapped))
g = torch.Generator().manual_seed(3)
base = torch.randint(0, eng.model_cfg.vocab_size, (2300,), generator=g).tolist()
s = eng.open(); s.append(base[:2048]); eng.snapshot(s, "ctx"); s.close()


def step(n, scratch):
    sess = eng.fork("ctx", n)
    for i, x in enumerate(sess):
        x.append([base[2048 + i]])
    slots = [x.slot for x in sess] + ([eng.runner.scratch_slot] if scratch else [])
    eng.state.pos[eng.runner.scratch_slot:eng.runner.scratch_slot + 1].fill_(2049)
    toks = [base[2100 + i] for i in range(n)] + ([0] if scratch else [])
    calls.clear()
    rows_now[0] = len(slots)
    st = torch.tensor(slots, device="cuda")
    m.forward(eng.state, st, torch.tensor(toks, device="cuda")[:, None], eng.config.max_seq, None, decode=True)
    rows_now[0] = len(slots)
    record("logits", m.logits(eng.state, st))
    for x in sess:
        x.close()
    return list(calls)


def first_diff(a, b, n):
    for i, ((na, ta), (nb, tb)) in enumerate(zip(a, b)):
        if ta is not None and tb is not None and not torch.equal(ta[:n], tb[:n]):
            return {"call": i, "of": len(a), "op": na, "vs": nb,
                    "max_abs": float((ta[:n].float() - tb[:n].float()).abs().max())}
    return None


res = {}
full = step(64, False)
for label, n, scratch in (("b3+scratch", 3, True), ("b3", 3, False), ("b1", 1, False), ("b8", 8, False)):
    res[label] = first_diff(step(n, scratch), full, n)
    print(label, res[label], flush=True)
torch.nn.functional.linear = linear

# the graph path, as the engine's unpadded plans would run it
fast = GraphPlans(HybridModel(eng.model_cfg, eng.model_weights, ks), eng.state, eng.runner.scratch_slot,
                  eng.config.max_seq, 1024, eng.graphs.decode_batches, eng.grid)
fast.capture(prefill=False, progress=False)


def greedy(n):
    sess = eng.fork("ctx", n)
    for i, x in enumerate(sess):
        x.append([base[2048 + i]])
    slots, toks, out = [x.slot for x in sess], [base[2100 + i] for i in range(n)], []
    for _ in range(8):
        lg = fast.decode(slots, toks)[:n].clone()
        out.append(lg)
        toks = lg.argmax(-1).tolist()
    for x in sess:
        x.close()
    return torch.stack(out, 1)


g64 = greedy(64)
for n in (1, 3, 5, 8):
    part = greedy(n)
    steps = [bool(torch.equal(part[:, t], g64[:n, t])) for t in range(8)]
    res[f"graph_b{n}_steps_equal"] = steps
    print(f"graph b{n}", steps, flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "decode_rows_trace.json"), "w"), indent=1)
