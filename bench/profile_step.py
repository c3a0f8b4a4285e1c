"""Profile of one decode step and of the capsule moves on the GPU (Qwen3.5-9B shape, random bf16 weights).

Runs the decode step eagerly under torch.profiler (the same kernels a captured graph replays, so counts and
GPU times are those of a replay) and groups the kernels by kind; times graph replays at batch 1 and 64;
profiles restore and snapshot of a capsule (host and device time). Prints tables, writes
bench/out/profile_step.json.

    python bench/profile_step.py [--context 4096] [--capsule 16384]
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_DIR, TAIL_REPLAY, log, machine_info, print_table, write_json  # noqa: E402

from capsulert.engine.default_model import REPO_ROOT  # noqa: E402
from capsulert.engine.engine import Engine  # noqa: E402

SHAPE = REPO_ROOT / "capsulert" / "configs" / "models" / "qwen3_5-9b-shape.yaml"
KINDS = [  # first match wins
    ("gemm", r"gemm|gemv|nvjet|cutlass|sm90_xmma|splitK|matmul"),
    ("triton", r"^triton_|_kernel$|^_"),
    ("reduce", r"reduce"),
    ("copy/cat/index", r"copy|cat|index|gather|scatter|fill"),
    ("elementwise", r"elementwise|vectorized"),
]


def kind_of(name: str) -> str:
    return next((k for k, pat in KINDS if re.search(pat, name)), "other")


def kernel_table(prof, steps: int) -> tuple[list[dict], list[dict]]:
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per_name[evt.name][0] += 1
            per_name[evt.name][1] += evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, (n, us) in per_name.items():
        by_kind[kind_of(name)][0] += n
        by_kind[kind_of(name)][1] += us
    kinds = [dict(kind=k, kernels_per_step=n / steps, ms_per_step=us / steps / 1e3) for k, (n, us) in
             sorted(by_kind.items(), key=lambda kv: -kv[1][1])]
    top = [dict(kernel=name[:70], kind=kind_of(name), per_step=n / steps, ms_per_step=us / steps / 1e3)
           for name, (n, us) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:25]]
    return kinds, top


def profile_append(eng: Engine, suffix: list[int], steps: int, name: str = "ctx") -> dict:
    """Restore of capsule "ctx" and an append of `suffix` to it: wall and host time of each half, and the
    kernels of the append (a graph replay: the same kernels, seen by the profiler)."""
    def halves():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = eng.restore(name)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        r.append(suffix)
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        r.close()
        return dict(restore_host_ms=(t1 - t0) * 1e3, restore_wall_ms=(t2 - t0) * 1e3,
                    append_host_ms=(t3 - t2) * 1e3, append_wall_ms=(t4 - t2) * 1e3)
    for _ in range(2):
        halves()
    runs = [halves() for _ in range(steps)]
    out = {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in runs[0]}
    r = eng.restore(name)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        r.append(suffix)
        torch.cuda.synchronize()
    r.close()
    kinds, top = kernel_table(prof, 1)
    out.update(kernels=sum(k["kernels_per_step"] for k in kinds), kernel_ms=sum(k["ms_per_step"] for k in kinds),
               kinds=kinds, top=top)
    log(f"append {len(suffix)} to {name}: restore {out['restore_wall_ms']:.2f} ms (host {out['restore_host_ms']:.2f}), "
        f"append {out['append_wall_ms']:.2f} ms (host {out['append_host_ms']:.2f}); {out['kernels']:.0f} kernels, "
        f"{out['kernel_ms']:.2f} ms")
    print_table(kinds, ["kind", "kernels_per_step", "ms_per_step"])
    print_table(top, ["kernel", "kind", "per_step", "ms_per_step"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--capsule", type=int, default=16384)
    ap.add_argument("--prefill-chunk", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tail-replay", choices=("auto", "on", "off"), default="auto",
                    help="EngineConfig.tail_replay (auto: the engine's default, on)")
    ap.add_argument("--model", default=f"random:{SHAPE}", help="random:<shape YAML> (default: the 9B shape) or a "
                    "checkpoint directory")
    ap.add_argument("--append", type=int, default=32, help="tokens of the profiled restore + append")
    ap.add_argument("--append-at", type=int, nargs="+", default=None,
                    help="profile only restore + append of capsules ending at these lengths (no decode, no moves)")
    args = ap.parse_args()
    c = args.prefill_chunk
    longest = max(args.append_at) if args.append_at else max(args.context, args.capsule)
    max_seq = (longest + 2 * c) // c * c
    t0 = time.perf_counter()
    eng = Engine.from_config(model=args.model, device="cuda", dtype="bfloat16",
                             tail_replay=TAIL_REPLAY[args.tail_replay], slots=66, max_seq=max_seq,
                             prefill_chunk=c)
    start_s = time.perf_counter() - t0
    log(f"engine up in {start_s:.1f} s, capture {eng.graphs.capture_s:.1f} s (warm-up {eng.graphs.warmup_s:.1f} s), kernels {eng.model.kernels.name}")
    for key, sec in sorted(eng.graphs.warmup_by_key.items(), key=lambda kv: -kv[1])[:6]:
        log(f"  warm-up {key.phase} b={key.batch} t={key.tokens}: {sec:.1f} s")
    vocab = eng.model_cfg.vocab_size
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, vocab, (longest + 64,), generator=g).tolist()
    if args.append_at:
        result = dict(machine=machine_info("cuda"), engine_start_s=start_s, tail_replay=eng.runner.tail_replay, append_at={})
        for P in args.append_at:
            s = eng.open()
            s.append(base[:P])
            eng.snapshot(s, f"p{P}")
            s.close()
            result["append_at"][P] = profile_append(eng, base[P:P + args.append], args.steps, f"p{P}")
        write_json(OUT_DIR / "profile_append.json", result)
        return 0
    s = eng.open()
    s.append(base[:args.context])
    eng.snapshot(s, "ctx")
    s.close()
    result = dict(machine=machine_info("cuda"), engine_start_s=start_s, capture_s=eng.graphs.capture_s,
                  warmup_s={f"{k.phase}-b{k.batch}-t{k.tokens}": v for k, v in eng.graphs.warmup_by_key.items()},
                  layers=eng.model_cfg.num_hidden_layers, decode={})
    for B in (1, 64):
        sess = eng.fork("ctx", B)
        slots = torch.tensor([x.slot for x in sess], device="cuda")
        # distinct tokens: rows that differ as a real batch's do (an MoE step routes each to its own experts)
        toks = torch.tensor(base[:B], dtype=torch.long, device="cuda").view(B, 1)

        def eager_step():
            eng.model.forward(eng.state, slots, toks, max_seq, decode=True)
            eng.model.logits(eng.state, slots)
        for _ in range(2):
            eager_step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                eager_step()
            torch.cuda.synchronize()
        kinds, top = kernel_table(prof, args.steps)
        ids = [x.slot for x in sess]
        for _ in range(3):
            eng.graphs.decode(ids, base[:B])
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            eng.graphs.decode(ids, base[:B])
        torch.cuda.synchronize()
        replay_ms = (time.perf_counter() - t) / 20 * 1e3
        total = sum(k["kernels_per_step"] for k in kinds)
        gpu_ms = sum(k["ms_per_step"] for k in kinds)
        log(f"decode b={B}: {total:.0f} kernels/step ({total / result['layers']:.1f} per layer), "
            f"kernel time {gpu_ms:.2f} ms, graph replay {replay_ms:.2f} ms")
        print(f"\ndecode b={B}: kernels by kind")
        print_table(kinds, ["kind", "kernels_per_step", "ms_per_step"])
        print(f"decode b={B}: top kernels")
        print_table(top, ["kernel", "kind", "per_step", "ms_per_step"])
        result["decode"][f"b{B}"] = dict(kernels_per_step=total, kernel_ms=gpu_ms, replay_ms=replay_ms, kinds=kinds, top=top)
        for x in sess:
            x.close()

    result["append"] = profile_append(eng, base[args.context:args.context + args.append], args.steps)

    # capsule moves: restore and snapshot of a long capsule, host vs device time
    s = eng.open()
    s.append(base[:args.capsule])
    moves = {}
    for name, fn in [("snapshot", lambda: eng.snapshot(s, "big")), ("restore", lambda: eng.restore("big").close())]:
        times = []
        for i in range(4):
            if name == "snapshot" and eng.store.contains("big"):
                eng.store.delete("big")
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            host = time.perf_counter() - t
            torch.cuda.synchronize()
            times.append(((time.perf_counter() - t) * 1e3, host * 1e3))
        wall, host = sorted(times)[len(times) // 2]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            if name == "snapshot":
                eng.store.delete("big")
            fn()
            torch.cuda.synchronize()
        kinds, top = kernel_table(prof, 1)
        moves[name] = dict(wall_ms=wall, host_ms=host, kernels=sum(k["kernels_per_step"] for k in kinds),
                           kernel_ms=sum(k["ms_per_step"] for k in kinds), top=top[:8])
        log(f"{name} {args.capsule}: wall {wall:.2f} ms, host {host:.2f} ms, {moves[name]['kernels']:.0f} kernels "
            f"{moves[name]['kernel_ms']:.2f} ms")
    s.close()
    result["moves"] = moves
    write_json(OUT_DIR / "profile_step.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
