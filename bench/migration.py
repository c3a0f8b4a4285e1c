"""Capsule migration between two workers, by each path: device (a pair link: NCCL between GPUs, Gloo between
CPU workers), object_store (safetensors bytes through the Ray object store) and disk (a verified capsule file
in a temp directory).

For each context length: a capsule of that many tokens is made on worker 0, then moved 0 -> 1 -> 0 ...
--repeats round trips per path after a warm-up one (each move: migrate, then the source's copy is deleted;
"first ms" is the cold first move, which for the device path sets up the pair link). Every move is timed from
the driver (orch.migrate, end to end: for the device path the manifest and the answer, the pack and the seal
on the source device, the transfer, the check on the target and its store), and every moved capsule is checked
to restore bitwise: the same greedy tokens as the original. Reports latency p50 / max and GB/s (capsule bytes
/ p50) per path, and the raw link: a plain send/recv of a buffer of the capsule's size between the same two
workers over the same pair link (LinkProbe, timed on the receiving worker), with the device path's fraction of
it, and the device move's time per phase on each worker against the wall time of its one call (SendCapsule
to the source; the target receives on the link itself) and of orch.migrate: the sender's manifest (read, lay
out, encode, start sending), pack (pack and seal; on CUDA only queued), answer (until the receiver's yes, the
pack done), send and stored (until the receiver's final reply); the receiver's manifest (the message
decoded), check (its refusals, the buffer, answer and receive started), meta (the metadata built while the
bytes move), recv, digest and store (on CUDA queued on the engine's stream).

Prints a table, writes bench/out/migration.json and bench/out/migration.png.

    .venv/bin/python bench/migration.py --quick                              # CPU, 2048 tokens, under a minute
    .venv/bin/python bench/migration.py --device cuda --model /models/Qwen3.5-9B --context 4096,16384
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import OUT_DIR, log, machine_info, percentile, plot_lines, print_table, write_json  # noqa: E402

import torch  # noqa: E402

from capsulert.errors import InvalidTokenError  # noqa: E402
from capsulert.orchestrator import Orchestrator  # noqa: E402
from capsulert.engine.default_model import CORPUS_PATH  # noqa: E402
from capsulert.protocol.requests import Delete, LinkProbe, SendCapsule, Tokenize, Turn  # noqa: E402

PATHS = ("device", "object_store", "disk")
SUFFIX = [101, 202, 303, 404]  # token ids: every model has them, tokenizer or not
CHECK_TOKENS = 8
COLUMNS = [("context", "context tok"), ("path", "path"), ("capsule_mb", "capsule MB"), ("moves", "moves"),
           ("first_ms", "first ms"), ("p50_ms", "p50 ms"), ("max_ms", "max ms"), ("gbps", "GB/s"),
           ("of_link", "of link"), ("bitwise", "bitwise")]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", default="default", help='"default" (embedded model) or an HF checkpoint directory')
    p.add_argument("--context", type=lambda s: [int(x) for x in s.split(",") if x],
                   help="comma-separated capsule lengths in tokens (default 16384 on cuda, 2048 on cpu)")
    p.add_argument("--repeats", type=int, default=None, help="round trips 0->1->0 per path (default 5; --quick 2)")
    p.add_argument("--quick", action="store_true", help="2 round trips per path")
    p.add_argument("--paths", type=lambda s: tuple(x for x in s.split(",") if x), default=PATHS,
                   help="comma-separated paths to time (device first when given; default: all)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (CPU)")
    p.add_argument("--out", type=Path, default=OUT_DIR, help="output directory (migration.json, migration.png)")
    args = p.parse_args(argv)
    args.context = args.context or [16384 if args.device == "cuda" else 2048]
    args.repeats = args.repeats or (2 if args.quick else 5)
    if "device" not in args.paths or set(args.paths) - set(PATHS):
        p.error(f"--paths: a subset of {','.join(PATHS)} that includes device (the link is timed against it)")
    return args


async def context_tokens(orch, n: int) -> list[int]:
    """n token ids of real text (the corpus, repeated as needed); seeded random ids for a model without a
    tokenizer (random:<architecture> weights)."""
    try:
        ids = await orch.call(0, Tokenize(CORPUS_PATH.read_text()))
    except InvalidTokenError:
        return torch.randint(10, 4000, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    return (ids * (n // len(ids) + 1))[:n]


async def greedy(orch, w: int, name: str) -> list[int]:
    return list(await orch.call(w, Turn(None, name, SUFFIX, CHECK_TOKENS, close=True)))


async def drop_copy(orch, name: str, w: int) -> None:
    """Delete worker w's copy only (the router's delete would delete every copy), and tell the view."""
    await orch.call(w, Delete(name))
    orch.space.discard(name, w)


async def moves(orch, name: str, path: str, repeats: int, ref: list[int], tmp: str) -> tuple[list[float], bool]:
    """1 + `repeats` round trips 0 -> 1 -> 0 by `path`: the time of each move (ms; the first round trip is
    the warm-up, the device path's first move sets up the pair link) and whether every moved copy restored
    bitwise."""
    times, exact, src = [], True, 0
    for _ in range(2 * (1 + repeats)):
        dst = 1 - src
        t0 = time.perf_counter()
        used = await orch.migrate(name, dst, via=path, directory=tmp)
        times.append((time.perf_counter() - t0) * 1e3)
        assert used == path, f"asked for {path}, migrate used {used}"
        exact &= await greedy(orch, dst, name) == ref
        await drop_copy(orch, name, src)
        src = dst
    return times, exact


async def link_seconds(orch, nbytes: int, repeats: int) -> list[float]:
    """The raw pair link: one plain send of an nbytes buffer 0 -> 1 per repeat (after one warm-up), timed on
    the receiver, over the link the device path uses (set up by then)."""
    key = orch.pool.links[(0, 1)][1]
    async with orch.pool.transferring(0, 1):
        _, got = await asyncio.gather(orch.call(0, LinkProbe(key, nbytes, True, repeats + 1)),
                                      orch.call(1, LinkProbe(key, nbytes, False, repeats + 1)))
    return got[1:]


async def device_phases(orch, name: str, repeats: int) -> dict:
    """Where a device move's time goes: SendCapsule called on worker 0 directly (over the link set up by
    then; worker 1 receives on the link itself), each side's wall time per phase from its reply (ms, median
    of `repeats`; a mark does not wait for the device: queued GPU work shows in the phase that waits for it),
    and the call's wall time from here. What orch.migrate adds on top is the router."""
    key = orch.pool.links[(0, 1)][1]
    halves, walls = {"send": [], "receive": []}, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        async with orch.pool.transferring(0, 1):
            reply = await orch.call(0, SendCapsule(name, key, "default", 60.0))
        walls.append((time.perf_counter() - t0) * 1e3)
        for half in halves:
            halves[half].append(reply["phases_ms"][half])
        await orch.call(1, Delete(name))
    out = {f"{half}_{phase}": percentile([p[phase] for p in rows], 50)
           for half, rows in halves.items() for phase in rows[0]}
    out["call"] = percentile(walls, 50)
    return out


async def main(args) -> dict:
    max_seq = -(-(max(args.context) + 256) // 1024) * 1024
    ecfg = dict(model=args.model, device=args.device, slots=4, max_seq=max_seq,
                prefill_chunk=1024 if args.device == "cuda" else 256)
    t0 = time.perf_counter()
    orch = await Orchestrator.start(dict(engine=ecfg, num_workers=2, torch_threads=args.threads,
                                         call_timeout_s=600, local_num_cpus=2 if args.device == "cpu" else None))
    log(f"2 workers up in {time.perf_counter() - t0:.1f}s ({args.model} model, {args.device})")
    rows, results = [], []
    try:
        with tempfile.TemporaryDirectory(prefix="capsulert-migration-") as tmp:
            for n in args.context:
                name = f"ctx-{n}"
                s = await orch.open(await context_tokens(orch, n), worker=0)
                nbytes = (await s.snapshot(name)).nbytes  # the whole capsule (a listing counts unshared bytes)
                await s.close()
                ref = await greedy(orch, 0, name)
                log(f"capsule of {n} tokens: {nbytes / 1e6:.1f} MB")
                per = {}
                for path in args.paths:
                    all_ms, exact = await moves(orch, name, path, args.repeats, ref, tmp)
                    ms = all_ms[2:]  # after the warm-up round trip
                    per[path] = {"ms": ms, "first_ms": all_ms[0], "p50_ms": percentile(ms, 50), "max_ms": max(ms),
                                 "bitwise": exact, "gbps": nbytes / percentile(ms, 50) / 1e6}
                    log(f"{path}: p50 {per[path]['p50_ms']:.1f} ms, {per[path]['gbps']:.2f} GB/s, bitwise {exact}")
                sec = await link_seconds(orch, nbytes, 2 * args.repeats)
                link_ms = [x * 1e3 for x in sec]
                per["link"] = {"ms": link_ms, "p50_ms": percentile(link_ms, 50), "max_ms": max(link_ms),
                               "gbps": nbytes / percentile(link_ms, 50) / 1e6}
                per["device"]["of_link"] = per["link"]["p50_ms"] / per["device"]["p50_ms"]
                phases = per["device"]["phases_ms"] = await device_phases(orch, name, 2 * args.repeats)
                log("device move, per phase (ms, p50): " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
                for path, r in per.items():
                    rows.append({"context": n, "path": path if path != "link" else "raw link (send/recv)",
                                 "capsule_mb": nbytes / 1e6, "moves": len(r["ms"]), **{k: v for k, v in r.items()
                                                                                     if k != "ms"}})
                results.append({"context": n, "nbytes": nbytes, "paths": per})
                await orch.delete(name)
    finally:
        await orch.close()
    backend = "NCCL" if args.device == "cuda" else "Gloo"
    print(f"\nCapsule migration between 2 workers ({args.model} model, {args.device}; device path = {backend}; "
          f"{args.repeats} round trips per path; GB/s = capsule bytes / p50; of link = raw link p50 / device p50)")
    print_table(rows, COLUMNS)
    out = {"machine": machine_info(args.device), "config": {**ecfg, "repeats": args.repeats, "backend": backend},
           "results": results}
    write_json(args.out / "migration.json", out)
    xs = [r["context"] for r in results]
    plot_lines(args.out / "migration.png", xs, {p: [r["paths"][p]["p50_ms"] for r in results]
                                                for p in (*args.paths, "link")},
               "capsule context (tokens)", "p50 latency per move (ms)", logy=True,
               title=f"Capsule migration, {args.model} model, {args.device}")
    log(f"wrote {args.out / 'migration.json'} and migration.png")
    if not all(r["paths"][p]["bitwise"] for r in results for p in args.paths):
        raise SystemExit("a migrated capsule did not restore bitwise")
    return out


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
