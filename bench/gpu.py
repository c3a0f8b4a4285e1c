"""GPU benchmark (H200): TTFT cold vs capsule vs HF transformers (+fla), snapshot/restore bandwidth,
decode ms/token at batch 1, 8, 32, 64 (batch-invariant, and its overhead over the batch-dependent path) against
the HBM floor of each batch, the cost of re-deriving grid checkpoints during decode, and best-of-8 fan-out, on
the Qwen3.5-9B shape (or --model) with deterministic random bf16 weights generated on the GPU. Prints a table,
writes bench/out/gpu.json and gpu_ttft.png.

    python bench/gpu.py [--lengths 2048 4096 8192 16384] [--no-hf] [--quick]
    python bench/gpu.py --model random:capsulert/configs/models/qwen3_5-35b-a3b-shape.yaml   # the MoE
    python bench/gpu.py --device cpu --quick      # the default model on the CPU (no HF, no graphs): a smoke run
    python bench/gpu.py --speculate [its options] # speculative decode against plain decode: bench/speculate.py

Snapshot is timed as a caller pays it: `snapshot_ms` until the call returns (the session may be written at once:
the copy is queued on the stream before anything the caller does next), `snapshot_done_ms` until the capsule's
bytes are complete (the copy has run); each call on a fresh capsule of the same session (the previous one deleted
first, so every call copies all of its blocks), after one warm-up call (`snapshot_first_ms`: that first call).
`restore_n64_ms`: a fork of 64 sessions from the capsule (the batched path: one read, two grouped copies), until
its copies are done; `restore_ms`: one restore, likewise. A crowd restores many capsules, not one capsule many
times: `restore_distinct_ms` is `restore_many` of DISTINCT capsules (snapshots of the session under as many names:
each read, checked and planned on its own, its bytes copied in full) until the copies are done, and
`restore_distinct_host_ms` until the call returns, the host's part (the copies are queued, not waited for).

Decode floors: the bytes a step must read at HBM_TBPS. Dense: every weight but the embedding table (a step
gathers B rows of it; the LM head is read whole). MoE: the same, but of the routed experts only those a batch of
B tokens is expected to touch with uniform routing, E * (1 - (1 - k/E)^B) of E (B = 1: its k experts, the ~3B
active parameters of the 35B-A3B; B = 64: ~87% of them). The floor with state adds the session state the step
moves: recurrent and conv state read and written, keys and values read at the decode context. Capsule floor:
the weights the 32-token append reads (those of a decode batch of 32 rows) plus the capsule's bytes read and
written by the restore.
"""
from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_DIR, TAIL_REPLAY, hf_causal_lm, log, machine_info, median, plot_lines, print_table, write_json  # noqa: E402

from capsulert.engine.default_model import REPO_ROOT  # noqa: E402
from capsulert.config.engine import EngineConfig  # noqa: E402
from capsulert.engine.engine import GRID, MOE_PREFILL_CHUNK, Engine  # noqa: E402
from capsulert.engine.graphs import GraphPlans  # noqa: E402
from capsulert.engine.moe_weights import DOWN, GATE_UP  # noqa: E402
from capsulert.serve.model_files import model_config  # noqa: E402
from capsulert.protocol.sampling import SamplingParams  # noqa: E402

SHAPE = REPO_ROOT / "capsulert" / "configs" / "models" / "qwen3_5-9b-shape.yaml"
SUFFIX = 32
DECODE_BATCHES = (1, 8, 32, 64)
DISTINCT = 16  # capsules restored together in the crowd row: each holds its own state (~50 MB on the 9B)
HBM_TBPS = 4.3  # H200 HBM3e: GB read per ms


DEVICE = "cuda"  # --device


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def default_prefill_chunk(model: str) -> int:
    """1024, or the engine's MOE_PREFILL_CHUNK for an MoE model."""
    return MOE_PREFILL_CHUNK if model_config(EngineConfig(model=model)).is_moe else 1024


def timed(fn, iters=3, warmup=1, after=None):
    """fn's median ms until its work is done (synchronized) and its last result; `after(result)` runs untimed
    after each call (e.g. closing the sessions a restore made)."""
    _, done, out = _timed_calls(fn, iters, warmup, after)
    return median(done), out


def timed_host(fn, iters=3, warmup=1, after=None):
    """fn's median ms until it returns and until its work is done (synchronized), like `timed`."""
    host, done, _ = _timed_calls(fn, iters, warmup, after)
    return median(host), median(done)


def _timed_calls(fn, iters, warmup, after):
    """Each timed call's ms until it returned and until its work was done, and the last result."""
    out, host, done = None, [], []
    for i in range(warmup + iters):
        sync()
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        sync()
        if i >= warmup:
            host.append((t1 - t0) * 1e3)
            done.append((time.perf_counter() - t0) * 1e3)
        if after is not None:
            after(out)
    return host, done, out


def time_snapshots(eng, session, name: str, iters: int) -> dict:
    """Snapshots of `session` as the module doc says: ms until return, ms until complete, and the first call's
    ms until complete; the last capsule is kept as `name`."""
    returned, done, first = [], [], 0.0
    for i in range(iters + 1):
        label = name if i == iters else f"{name}.{i}"
        sync()
        t0 = time.perf_counter()
        eng.snapshot(session, label)
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        if i == 0:
            first = (t2 - t0) * 1e3
        else:
            returned.append((t1 - t0) * 1e3)
            done.append((t2 - t0) * 1e3)
        if i < iters:
            eng.store.delete(label)
    return dict(snapshot_ms=median(returned), snapshot_done_ms=median(done), snapshot_first_ms=first)


def decode_floor_gb(engine, batch: int) -> float:
    """GB of weights a decode step of `batch` tokens reads at least (module doc)."""
    cfg = engine.model_cfg
    routed = dense = 0
    for name, t in engine.model_weights.items():
        n = t.numel() * t.element_size()
        if name == "model.embed_tokens.weight" and not cfg.tie_word_embeddings:
            continue  # a step gathers B rows of it; an untied LM head is a weight of its own
        if name.endswith((GATE_UP, DOWN)):
            routed += n
        else:
            dense += n
    touched = 1.0 if not cfg.is_moe else 1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** batch
    return (dense + touched * routed) / 1e9


def decode_state_gb(engine, batch: int, context: int) -> float:
    """GB of session state a decode step of `batch` sessions at `context` tokens must move besides the weights:
    each linear-attention layer's recurrent and conv state read and written, each attention layer's keys and
    values read."""
    st = engine.state
    per_slot = lambda t: t[:, 0].numel() * t.element_size()  # noqa: E731 (all layers, one slot)
    kv_row = st.kv_k[:, 0, 0].numel() * st.kv_k.element_size()  # all attention layers, one position
    return batch * (2 * (per_slot(st.ssm) + per_slot(st.conv)) + 2 * kv_row * context) / 1e9


# capsule ends on and off the 64-token grid and the old 1024 one (restore + 32-token append at each)
OFF_GRID = (2048, 2049, 2560, 3000, 3071, 4096, 4500)


def main() -> int:
    if "--speculate" in sys.argv[1:]:  # the speculative-decode benchmark, with its own options (bench/speculate.py)
        sys.argv.remove("--speculate")
        import speculate

        speculate.main()
        return 0
    ap = argparse.ArgumentParser(epilog="--speculate [options]: the speculative-decode benchmark (bench/speculate.py)")
    ap.add_argument("--tail-replay", choices=("auto", "on", "off"), default="auto",
                    help="EngineConfig.tail_replay (auto: the engine's default, on)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--model", default=None, help="random:<shape YAML> (default on CUDA: the 9B shape), a checkpoint "
                    "directory, or \"default\" (the embedded model, the default on the CPU)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help=f"the longest prefill piece (multiple of 64; default 1024, {MOE_PREFILL_CHUNK} for an MoE "
                         "model, as the engine recommends)")
    ap.add_argument("--off-grid", action="store_true",
                    help=f"capsule TTFT where turns end anywhere: lengths {OFF_GRID} (ratios to the first)")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    cuda = DEVICE == "cuda"
    if args.model is None:
        args.model = f"random:{SHAPE}" if cuda else "default"
    if not cuda:
        args.no_hf = True  # HF's reference runs on the GPU here
    if args.quick:
        args.lengths, args.iters = [2048, 4096], 2
    if args.off_grid:
        args.lengths = list(OFF_GRID)
    torch.manual_seed(0)
    c = args.prefill_chunk or default_prefill_chunk(args.model)
    max_seq = (max(args.lengths) + 2 * SUFFIX + 64 + c - 1) // c * c
    t0 = time.perf_counter()
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def engine(max_seq: int) -> Engine:
        return Engine.from_config(model=args.model, device=DEVICE, dtype="bfloat16" if cuda else "float32",
                                  tail_replay=TAIL_REPLAY[args.tail_replay], slots=max(DECODE_BATCHES) + 2,
                                  max_seq=max_seq, prefill_chunk=c)
    eng = engine(max_seq)
    start_s = time.perf_counter() - t0
    weights_gb = sum(t.numel() * t.element_size() for t in eng.model_weights.values()) / 1e9
    state_gb = eng.state.nbytes / 1e9
    mem_gb = torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0
    n_graphs, capture_s = (len(eng.graphs.graphs), eng.graphs.capture_s) if eng.graphs is not None else (0, 0.0)
    log(f"engine up in {start_s:.1f} s: kernels={eng.model.kernels.name}, graphs={n_graphs} "
        f"captured in {capture_s:.1f} s; weights {weights_gb:.1f} GB, state set {state_gb:.1f} GB, "
        f"peak {mem_gb:.1f} GB (beyond weights+state: {mem_gb - weights_gb - state_gb:.1f} GB)")
    g = torch.Generator().manual_seed(1)
    vocab = eng.model_cfg.vocab_size
    base = torch.randint(0, vocab, (max(args.lengths) + max(SUFFIX, 2 * max(DECODE_BATCHES)),), generator=g).tolist()
    hf = None if args.no_hf else hf_causal_lm(eng)

    rows, curves = [], {k: [] for k in ("ours cold", "ours capsule", "HF cold", "HF prefix-kept")}
    for P in args.lengths:
        prefix, suffix = base[:P], base[P:P + SUFFIX]
        log(f"P={P}: ours cold")

        def cold():
            s = eng.open()
            lg = s.append(prefix + suffix)
            s.close()
            return lg
        cold_ms, cold_logits = timed(cold, args.iters)
        s = eng.open()
        s.append(prefix)
        name = f"p{P}"
        snaps = time_snapshots(eng, s, name, args.iters)
        ref = eng.store.info(name)
        n_distinct = min(DISTINCT, eng.config.slots)
        distinct = [f"{name}.d{i}" for i in range(n_distinct)]
        for d in distinct:
            s.snapshot(d)
        s.close()
        distinct_host_ms, distinct_ms = timed_host(lambda: eng.restore_many(distinct), args.iters,
                                                   after=lambda rs: [r.close() for r in rs])
        for d in distinct:
            eng.store.delete(d)
        restore_ms, _ = timed(lambda: eng.restore(name), args.iters, after=lambda r: r.close())
        n_fork = min(64, eng.config.slots)
        fork_ms, _ = timed(lambda: eng.fork(name, n_fork), args.iters, after=lambda br: [b.close() for b in br])

        def capsule():
            r = eng.restore(name)
            lg = r.append(suffix)
            r.close()
            return lg
        cap_ms, cap_logits = timed(capsule, args.iters)
        assert torch.equal(cap_logits, cold_logits), "capsule logits differ from cold logits"
        nbytes = ref.meta.nbytes
        mb = nbytes / 1e6
        # the weights the append must read (an MoE suffix of 32 random-routed tokens touches ~64% of the experts)
        # plus the capsule's bytes copied in at restore: its floor
        floor_ms = decode_floor_gb(eng, SUFFIX) / HBM_TBPS + 2 * nbytes / 1e9 / HBM_TBPS
        row = dict(prefix=P, cold_ms=cold_ms, capsule_ms=cap_ms, speedup=cold_ms / cap_ms, **snaps,
                   restore_ms=restore_ms, snapshot_over_restore=snaps["snapshot_ms"] / restore_ms,
                   snapshot_done_over_restore=snaps["snapshot_done_ms"] / restore_ms, restore_n64_ms=fork_ms,
                   restore_n64_per_session_ms=fork_ms / n_fork,
                   restore_distinct_per_session_ms=distinct_ms / n_distinct,
                   restore_distinct_host_per_session_ms=distinct_host_ms / n_distinct, capsule_mb=mb,
                   restore_gbps=2 * nbytes / restore_ms / 1e6, capsule_floor_ms=floor_ms,
                   capsule_over_floor=cap_ms / floor_ms)
        if hf is not None:
            ids = torch.tensor([prefix + suffix], device="cuda")
            log(f"P={P}: HF cold / prefix-kept")
            with torch.inference_mode():
                hf_cold_ms, out = timed(lambda: hf(ids, use_cache=True).logits[0, -1], args.iters)
                pre = hf(ids[:, :P], use_cache=True).past_key_values
                sids = ids[:, P:]

                def kept():
                    cache = copy.deepcopy(pre)
                    return hf(sids, past_key_values=cache, use_cache=True).logits[0, -1]
                hf_kept_ms, _ = timed(kept, args.iters)
                del pre
            row.update(hf_cold_ms=hf_cold_ms, hf_kept_ms=hf_kept_ms, hf_cold_over_ours=hf_cold_ms / cold_ms,
                       hf_kept_over_capsule=hf_kept_ms / cap_ms,
                       top1_agree=int(out.argmax()) == int(cold_logits.argmax()))
            curves["HF cold"].append(hf_cold_ms)
            curves["HF prefix-kept"].append(hf_kept_ms)
        curves["ours cold"].append(cold_ms)
        curves["ours capsule"].append(cap_ms)
        row["capsule_vs_first"] = cap_ms / (rows[0]["capsule_ms"] if rows else cap_ms)
        rows.append(row)
        eng.store.delete(name)
        if cuda:
            torch.cuda.empty_cache()

    # the capsule rows now, on their own: what follows captures a second set of decode graphs (an 80 GB card
    # may not hold them beside a 16k state set), and these must not be lost with it
    print_table(rows, list(rows[0]))
    write_json(OUT_DIR / "gpu_capsules.json", {"machine": machine_info(args.device), "args": vars(args), "rows": rows})

    # decode at a 4k context: batch-invariant engine (generate: sampling + grid re-derivation included) and
    # the graph replay alone, against the plain batch-dependent path (same weights, state and kernels)
    ctx = min(4096, max(args.lengths))
    # what the rest runs: the context, the forks' first tokens and the timed calls' tokens; the best-of-8
    decode_seq = (max(ctx + 1024, min(8192, max(args.lengths)) + 2 * GRID) + c - 1) // c * c
    if decode_seq < max_seq:
        # an engine sized for that: on an 80 GB card the 9B's state set for 16k tokens (tail buffers included)
        # leaves no room for a 64-row decode step's sampling
        log(f"decode at {ctx} tokens and the best-of-8: an engine of max_seq={decode_seq}")
        eng.close()
        gone = weakref.ref(eng)
        eng = s = _ = None  # the last restore's and fork's sessions (timed's results) hold the engine too
        gc.collect()
        if gone() is not None:
            raise RuntimeError("the long-context engine is still referenced: its state set would stay allocated")
        if cuda:
            torch.cuda.empty_cache()
        eng = engine(decode_seq)
    s = eng.open()
    s.append(base[:ctx])
    s.snapshot("ctx")
    s.close()
    decode = {}
    fast = None
    if eng.graphs is not None:  # the batch-dependent comparison replays graphs: CUDA only
        # the engine's model on the plain path: its weights and kernels shared (a second packed copy of the 9B
        # does not fit beside a 16k state set with tail buffers on an 80 GB card), no row padding, no MTP rows
        fast_model = copy.copy(eng.model)
        fast_model.decode_rows, fast_model.rowwise, fast_model.mtp = None, False, None
        fast = GraphPlans(fast_model, eng.state, eng.runner.scratch_slot, eng.config.max_seq, c,
                          eng.graphs.decode_batches, eng.grid)
        fast.capture(prefill=False)
    batches = DECODE_BATCHES if cuda else DECODE_BATCHES[:2]  # the CPU run is a smoke run: decode is slow there
    for B in batches:
        sess = eng.fork("ctx", B)
        # each session its own next token, so the batch's rows differ as a real batch's do: forks of one
        # context would otherwise generate the same tokens, and an MoE step would read only their k experts
        for i, x in enumerate(sess):
            x.append([base[ctx + i]])
        # a whole grid period per call: each session re-derives one grid chunk per GRID tokens it decodes (the
        # canonical grid state), so a call of GRID tokens holds exactly one re-derivation of each, as a long
        # generate does on average (a shorter call holds one or none, by where it starts)
        n = GRID if cuda else 8  # a warm-up call first: the process's first generate pays one-time costs
        ms, _ = timed(lambda: eng.generate(sess, n), 3, 1)
        decode[f"ours_b{B}_ms_per_token"] = ms / n
        if fast is None:
            for x in sess:
                x.close()
            continue
        slots, toks = [x.slot for x in sess], base[ctx + B:ctx + 2 * B]
        # replay alone; both paths advance the same slots, which is fine for timing (values are not used)
        inv_ms, _ = timed(lambda: [eng.graphs.decode(slots, toks) for _ in range(16)], 3, 1)
        fast_ms, _ = timed(lambda: [fast.decode(slots, toks) for _ in range(16)], 3, 1)  # noqa: F821 (`del fast` comes after every call)
        decode[f"step_b{B}_invariant_ms"] = inv_ms / 16
        # the B sessions' re-derivation alone (one batched prefill of GRID tokens each), and what is left of a
        # generated token's time once the step and that share are taken off: the host's work
        grid_rows = [base[ctx:ctx + GRID]] * B
        rederive_ms, _ = timed(lambda: eng.graphs.prefill_rows(slots, grid_rows), 3, 1)
        decode[f"rederive_b{B}_ms"] = rederive_ms
        decode[f"host_b{B}_ms_per_token"] = ms / n - inv_ms / 16 - rederive_ms / GRID
        decode[f"generate_b{B}_over_step"] = ms / n / (inv_ms / 16)
        decode[f"generate_b{B}_over_step_and_rederive"] = ms / n / (inv_ms / 16 + rederive_ms / GRID)
        decode[f"step_b{B}_batch_dependent_ms"] = fast_ms / 16
        decode[f"step_b{B}_invariance_overhead"] = inv_ms / fast_ms - 1
        decode[f"floor_b{B}_ms"] = decode_floor_gb(eng, B) / HBM_TBPS
        decode[f"step_b{B}_over_floor"] = decode[f"step_b{B}_invariant_ms"] / decode[f"floor_b{B}_ms"]
        # the floor with the session state a step moves (not in the weight floor the targets are set against)
        decode[f"floor_with_state_b{B}_ms"] = decode[f"floor_b{B}_ms"] + decode_state_gb(eng, B, ctx) / HBM_TBPS
        decode[f"step_b{B}_over_floor_with_state"] = decode[f"step_b{B}_invariant_ms"] / decode[f"floor_with_state_b{B}_ms"]
        for x in sess:
            x.close()
    del fast
    # canonical grid state: decode re-derives each grid chunk it crosses, one prefill of GRID tokens per GRID
    # tokens decoded (batched across the sessions that cross in one step); its cost at b = 1
    s = eng.restore("ctx")
    grid_ms, _ = timed(lambda: s.append(base[ctx:ctx + GRID]) if len(s) == ctx else None, 1, 0)
    s.close()
    decode["rederive_grid_ms"] = grid_ms
    decode["rederive_share_of_decode_b1"] = grid_ms / (grid_ms + GRID * decode["ours_b1_ms_per_token"])
    if hf is not None:
        ids = torch.tensor([base[:ctx]], device="cuda")
        with torch.inference_mode():
            out = hf(ids, use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)

            def hf_steps():
                nonlocal cache, tok
                for _ in range(16):
                    o = hf(tok, past_key_values=cache, use_cache=True)
                    cache, tok = o.past_key_values, o.logits[:, -1:].argmax(-1)
            ms, _ = timed(hf_steps, 1, 0)
        decode["hf_b1_ms_per_token"] = ms / 16
    decode["weight_floor_ms"] = weights_gb / HBM_TBPS
    log(f"decode: {decode}")

    # best-of-8 from an 8k capsule, 64 new tokens each
    P8 = min(8192, max(args.lengths))
    s = eng.open()
    s.append(base[:P8])
    s.snapshot("bo8")
    s.close()
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i) for i in range(8)]

    def batched():
        br = eng.fork("bo8", 8)
        out = eng.generate(br, 64, params)
        for b in br:
            b.close()
        return out

    def one_by_one():
        out = []
        for p in params:
            r = eng.restore("bo8")
            out.append(r.generate(64, p))
            r.close()
        return out
    fan = {"ours_batched_ms": timed(batched, 1, 1)[0], "ours_one_by_one_ms": timed(one_by_one, 1, 0)[0]}
    if hf is not None:
        ids = torch.tensor([base[:P8]], device="cuda")
        with torch.inference_mode():
            fan["hf_ms"] = timed(lambda: hf.generate(ids, do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=64,
                                                     min_new_tokens=64, num_return_sequences=8), 1, 0)[0]
    log(f"fan-out: {fan}")

    cols = ["prefix", "cold_ms", "capsule_ms", "speedup", "snapshot_ms", "snapshot_done_ms", "snapshot_first_ms",
            "restore_ms", "snapshot_over_restore", "snapshot_done_over_restore", "restore_n64_ms",
            "restore_n64_per_session_ms", "restore_distinct_per_session_ms", "restore_distinct_host_per_session_ms",
            "capsule_mb", "restore_gbps", "capsule_vs_first", "capsule_floor_ms",
            "capsule_over_floor"]
    if hf is not None:
        cols += ["hf_cold_ms", "hf_kept_ms", "hf_cold_over_ours", "hf_kept_over_capsule", "top1_agree"]
    print_table(rows, cols)
    print_table([{k: v for k, v in {"batch": B, "step_ms": decode.get(f"step_b{B}_invariant_ms"), "floor_ms": decode.get(f"floor_b{B}_ms"),
                  "over_floor": decode.get(f"step_b{B}_over_floor"),
                  "floor_with_state_ms": decode.get(f"floor_with_state_b{B}_ms"),
                  "over_floor_with_state": decode.get(f"step_b{B}_over_floor_with_state"),
                  "generate_ms_per_token": decode[f"ours_b{B}_ms_per_token"],
                  "rederive_ms": decode.get(f"rederive_b{B}_ms"), "host_ms_per_token": decode.get(f"host_b{B}_ms_per_token"),
                  "generate_over_step": decode.get(f"generate_b{B}_over_step"),
                  "generate_over_step_and_rederive": decode.get(f"generate_b{B}_over_step_and_rederive")}.items()
                   if v is not None}
                 for B in batches],
                ["batch", "step_ms", "floor_ms", "over_floor", "floor_with_state_ms", "over_floor_with_state",
                 "generate_ms_per_token", "rederive_ms", "host_ms_per_token", "generate_over_step",
                 "generate_over_step_and_rederive"])
    print("decode:", decode)
    print("fan-out best-of-8 from 8k, 64 tokens:", fan)
    result = dict(machine=machine_info(DEVICE), model=args.model, prefill_chunk=c, tail_replay=eng.runner.tail_replay,
                  engine_start_s=start_s, kernels=eng.model.kernels.name, graphs=n_graphs, capture_s=capture_s,
                  weights_gb=weights_gb,
                  state_gb=state_gb, peak_gb=mem_gb, ttft=rows, decode=decode, fanout=fan)
    write_json(OUT_DIR / "gpu.json", result)
    plot_lines(OUT_DIR / "gpu_ttft.png", args.lengths, {k: v for k, v in curves.items() if v}, "prefix tokens",
               "TTFT ms (32-token suffix)", logy=True, logx=True, title=f"{Path(args.model).stem}, "
               f"{torch.cuda.get_device_name() if cuda else 'CPU'}, {'bf16' if cuda else 'fp32'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
