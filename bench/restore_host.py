"""Host time of restoring and snapshotting a capsule: what the caller waits for before its next call.

For each capsule length P (random token ids; 2048 sits on the 64-token grid, 3000 off it) one capsule is
snapshotted, then timed per call (medians over --iters calls after --warmup):

- restore:        engine.restore(name) into a new slot (the TTFT path); the session is closed untimed
- restore (in place): session.restore(name) of an open session (rollback / reset; no slot bookkeeping)
- snapshot:       a snapshot that copies every block (the previous one is deleted untimed, so the store
                  holds none of its blocks)
- snapshot (shared): a snapshot while capsule P holds its blocks (only its own tensors are copied)

"host ms" is the call alone (on CUDA the copies are queued, not waited for); "wall ms" adds a synchronize.
On the CPU they are the same. Every restore is checked bitwise against the snapshotted slot once.

    python bench/restore_host.py                                  # CPU, the embedded default model
    python bench/restore_host.py --device cuda                    # the Qwen3.5-9B shape, random bf16 weights
    python bench/restore_host.py --device cuda --model random:capsulert/configs/models/qwen3_5-35b-a3b-shape.yaml

Prints a table and writes bench/out/restore_host_<device>[_<tag>].json.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common import OUT_DIR, cuda_sync, log, machine_info, median, print_table, write_json  # noqa: E402

from capsulert.engine.default_model import REPO_ROOT  # noqa: E402
from capsulert.engine.engine import Engine  # noqa: E402

SHAPE_9B = REPO_ROOT / "capsulert" / "configs" / "models" / "qwen3_5-9b-shape.yaml"
COLUMNS = [("P", "P"), ("capsule_mb", "capsule MB"), ("restore_host_ms", "restore host ms"),
           ("restore_wall_ms", "restore wall ms"), ("inplace_host_ms", "in-place host ms"),
           ("snapshot_host_ms", "snapshot host ms"), ("snapshot_wall_ms", "snapshot wall ms"),
           ("shared_snapshot_host_ms", "shared snapshot host ms")]
BUFFERS = ("kv_k", "kv_v", "ssm", "conv", "ssm_grid", "conv_grid", "last_hidden")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", default=None,
                   help='"default" (the embedded model; the CPU default), random:<shape YAML> (the CUDA default: '
                        "the 9B shape) or a checkpoint directory")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 3000])
    p.add_argument("--iters", type=int, default=50, help="timed calls per measurement (median)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--prefill-chunk", type=int, default=1024, help="the longest prefill piece (multiple of 64)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's default)")
    p.add_argument("--tag", default="", help="suffix of the output file (before / after runs side by side)")
    p.add_argument("--out", type=Path, default=OUT_DIR)
    args = p.parse_args(argv)
    if args.model is None:
        args.model = f"random:{SHAPE_9B}" if args.device == "cuda" else "default"
    return args


def build_engine(args: argparse.Namespace) -> Engine:
    c = args.prefill_chunk
    max_seq = (max(args.lengths) + c) // c * c
    cfg = dict(device=args.device, slots=8, max_seq=max_seq, prefill_chunk=c)
    if args.model != "default":
        cfg["model"] = args.model
    if args.device == "cuda":
        cfg["dtype"] = "bfloat16"
    return Engine.from_config(cfg)


def timed(fn: Callable[[], object], after: Callable[[object], None], args: argparse.Namespace,
          device: str) -> tuple[float, float]:
    """Median host and wall ms of fn over args.iters calls; `after(result)` runs untimed after each."""
    host, wall = [], []
    for i in range(args.warmup + args.iters):
        cuda_sync(device)
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        cuda_sync(device)
        t2 = time.perf_counter()
        after(out)
        if i >= args.warmup:
            host.append((t1 - t0) * 1e3)
            wall.append((t2 - t0) * 1e3)
    return median(host), median(wall)


def slot_bytes(eng: Engine, slot: int, P: int) -> dict[str, torch.Tensor]:
    st = eng.state
    out = {k: st.slot_view(k, slot).clone() for k in BUFFERS}
    for k in ("kv_k", "kv_v"):
        out[k] = out[k][:, :P]
    return out


def check_bitwise(eng: Engine, name: str, want: dict[str, torch.Tensor], P: int) -> None:
    s = eng.restore(name)
    try:
        got = slot_bytes(eng, s.slot, P)
        bad = [k for k in want if not torch.equal(got[k], want[k])]
        if bad:
            raise AssertionError(f"restore of {name} is not bitwise the snapshotted slot: {bad}")
    finally:
        s.close()


def measure(eng: Engine, P: int, base: list[int], args: argparse.Namespace) -> dict:
    dev, name = args.device, f"p{P}"
    src = eng.open()
    src.append(base[:P])
    want = slot_bytes(eng, src.slot, P)
    ref = eng.snapshot(src, name)
    check_bitwise(eng, name, want, P)
    row = dict(P=P, capsule_mb=ref.nbytes / 1e6)
    row["restore_host_ms"], row["restore_wall_ms"] = timed(lambda: eng.restore(name), lambda s: s.close(), args, dev)
    target = eng.open()
    row["inplace_host_ms"], _ = timed(lambda: target.restore(name), lambda _: None, args, dev)
    target.close()
    row["shared_snapshot_host_ms"], _ = timed(lambda: eng.snapshot(src, f"{name}-shared"),
                                              lambda r: eng.store.delete(r.name), args, dev)
    eng.store.delete(name)  # from here on the store holds none of the session's blocks
    row["snapshot_host_ms"], row["snapshot_wall_ms"] = timed(lambda: eng.snapshot(src, f"{name}-fresh"),
                                                             lambda r: eng.store.delete(r.name), args, dev)
    src.close()
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    eng = build_engine(args)
    log(f"engine up: {args.model} on {args.device}, kv {tuple(eng.state.kv_k.shape)} {eng.state.kv_k.dtype}")
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, eng.model_cfg.vocab_size, (max(args.lengths),), generator=g).tolist()
    rows = []
    for P in args.lengths:
        log(f"P={P}")
        rows.append(measure(eng, P, base, args))
    print_table(rows, COLUMNS)
    stem = f"restore_host_{args.device}" + (f"_{args.tag}" if args.tag else "")
    path = write_json(args.out / f"{stem}.json", dict(machine=machine_info(args.device), model=args.model,
                                                      iters=args.iters, rows=rows))
    log(f"wrote {path}")
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
