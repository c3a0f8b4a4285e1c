"""Working-set benchmark: the paper's embodied loop over N contexts under tier budgets and policies.

N contexts of L tokens each (random token ids, one seed per context). A visit = restore the context's
capsule + append 16 tokens (TTFT: until the next-token logits are ready) + generate 8 tokens, then
the session is closed. When a visit finds its capsule dropped, it falls back to a cold prefill of the
L tokens, re-snapshots the capsule and then appends: a "cold" visit, and its TTFT includes all that.

Budgets are sized from the measured capsule: the gpu tier holds --gpu-caps capsules (4), the host
tier --host-caps more (8), the disk tier --disk-caps more (16); "gpu only" disables host and disk.
So the working set N*L goes from well inside the gpu tier to beyond all tiers (N=32 > 4+8+16).

Traces (the same for every policy and tier setup):
- cyclic: contexts 0..N-1 in order, round and round (LRU's worst case once N exceeds a tier);
- zipf:   N=max(--ns) contexts, drawn with P(rank k) ~ 1/k^1.1 (seeded).
Before a trace the N capsules are put into the store in context order, as a first pass over the
contexts would leave them (prefilled once, in a separate engine, then stored with the same put the
snapshot verb uses); the measured visits start after that.

Per (trace, policy, tiers, N): the fraction of visits served from each tier (the capsule's tier just
before the visit; gpu hits and host/disk misses cross-checked against store.stats() deltas), cold
visits, mean and p99 TTFT, bytes moved between tiers ((promotions + demotions) x capsule bytes, from
the stats deltas), evictions. "cold ms" is the reference: a cold prefill of the same L + 16 tokens.

Writes bench/out/working_set.json and bench/out/working_set.png (mean TTFT vs working set per policy
and tier setup, cyclic trace) and prints a markdown table.

    python bench/working_set.py                 # L=512, N in 2,4,8,16,32 (~3-5 min on 2 CPU cores)
    python bench/working_set.py --quick         # L=256, N in 2,8,16,32, 8 visits each (< 60 s)
    python bench/working_set.py --device cuda

On CPU the "gpu" tier is ordinary memory, so gpu vs host differ only by the promotion copy; disk reads
and writes are real (safetensors, checksummed, fsync'd). --threads (default 1 on CPU): torch intra-op
threads; on a small shared machine more threads spin against other jobs and make every number noise.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common import (OUT_DIR, cuda_sync, log, machine_info, median, percentile, plot_lines,  # noqa: E402
                    print_table, write_json)

from capsulert.engine.engine import Engine  # noqa: E402

POLICIES = ("lru", "pinned_lru", "cost_aware")
TIER_SETUPS = ("gpu+host+disk", "gpu only")
CHUNK = 256
SUFFIX, GEN = 16, 8
ZIPF_S = 1.1

COLUMNS = [
    ("trace", "trace"),
    ("policy", "policy"),
    ("tiers", "tiers"),
    ("n", "N"),
    ("ws_tokens", "N*L tok"),
    ("visits", "visits"),
    ("hit_gpu", "gpu"),
    ("hit_host", "host"),
    ("hit_disk", "disk"),
    ("cold", "cold"),
    ("ttft_mean_ms", "TTFT mean ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("cold_ref_ms", "cold ms"),
    ("cold_over_mean", "cold/mean"),
    ("moved_mb", "moved MB"),
    ("evictions", "drops"),
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="L=256, N in 2,8,16,32, 8 visits per N, 16 zipf visits")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default="default")
    p.add_argument("--length", type=int, default=None, help="L, tokens per context (default 512; quick 256)")
    p.add_argument("--ns", default=None, help="comma-separated N values (default 2,4,8,16,32; quick 2,8,16,32)")
    p.add_argument("--visits", type=int, default=None,
                   help="measured visits per cyclic run: max(N, this) (default 16; quick: exactly 8)")
    p.add_argument("--zipf-visits", type=int, default=None, help="default 64; quick 16")
    p.add_argument("--gpu-caps", type=int, default=4)
    p.add_argument("--host-caps", type=int, default=8)
    p.add_argument("--disk-caps", type=int, default=16)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default 1; 0 = torch default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(OUT_DIR))
    a = p.parse_args(argv)
    a.length = a.length or (256 if a.quick else 512)
    a.ns = tuple(int(x) for x in a.ns.split(",")) if a.ns else ((2, 8, 16, 32) if a.quick else (2, 4, 8, 16, 32))
    a.zipf_visits = a.zipf_visits or (16 if a.quick else 64)
    a.policies = tuple(a.policies.split(","))
    return a


def context_tokens(i: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 100_003 + i)
    return torch.randint(1, 4096, (length,), generator=g).tolist()


def zipf_trace(n: int, visits: int, seed: int) -> list[int]:
    rng = random.Random(seed + 7)
    order = list(range(n))
    rng.shuffle(order)  # order[k] = the context of popularity rank k+1
    weights = [1.0 / (k + 1) ** ZIPF_S for k in range(n)]
    return [order[k] for k in rng.choices(range(n), weights=weights, k=visits)]


def make_engine(args, max_seq: int, **kw) -> Engine:
    return Engine.from_config(model=args.model, device=args.device, slots=2, max_seq=max_seq,
                              prefill_chunk=CHUNK, **kw)


class Library:
    """Every context prefilled once in its own engine; its capsule is what a first visit leaves."""

    def __init__(self, args, max_seq: int, n: int):
        self.eng = make_engine(args, max_seq)
        self.contexts = [context_tokens(i, args.length, args.seed) for i in range(n)]
        self.capsules = []
        for i, ctx in enumerate(self.contexts):
            s = self.eng.open()
            s.append(ctx)
            s.snapshot(f"ctx{i}")
            s.close()
            meta, tensors = self.eng.store.get(f"ctx{i}")
            self.capsules.append((meta, tensors))
        self.nbytes = self.capsules[0][0].nbytes
        assert all(m.nbytes == self.nbytes for m, _ in self.capsules)
        self.fingerprint = self.eng.fingerprint

    def cold_ttft_ms(self, args, suffix: list[int], reps: int = 3) -> float:
        times = []
        for i in range(reps):
            s = self.eng.open()
            cuda_sync(args.device)
            t0 = time.perf_counter()
            s.append(self.contexts[i % len(self.contexts)] + suffix)
            cuda_sync(args.device)
            times.append((time.perf_counter() - t0) * 1e3)
            s.close()
        return median(times)


def run_trace(args, lib: Library, max_seq: int, policy: str, tiers: str, n: int, order: list[int],
              suffixes: list[list[int]]) -> dict:
    nb = lib.nbytes
    full = tiers == "gpu+host+disk"
    budgets = {"gpu": args.gpu_caps * nb, "host": args.host_caps * nb if full else 0,
               "disk": args.disk_caps * nb if full else 0}
    with tempfile.TemporaryDirectory(prefix="ws-disk-") as disk_dir:
        eng = make_engine(args, max_seq, capsule_budgets=budgets, disk_dir=disk_dir if full else None, policy=policy)
        assert eng.fingerprint == lib.fingerprint
        store = eng.store
        for i in range(n):  # the first pass over the contexts, in order
            meta, tensors = lib.capsules[i]
            store.put(meta, tensors, tier="gpu")
        before = store.stats()
        served = {"gpu": 0, "host": 0, "disk": 0, "cold": 0}
        ttft = []
        for v, i in enumerate(order):
            name = f"ctx{i}"
            tier = store.info(name).tier if store.contains(name) else "cold"
            served[tier] += 1
            cuda_sync(args.device)
            t0 = time.perf_counter()
            if tier == "cold":  # dropped: prefill again and keep the new capsule
                s = eng.open()
                s.append(lib.contexts[i])
                s.snapshot(name)
            else:
                s = eng.restore(name)
            s.append(suffixes[v])
            cuda_sync(args.device)
            ttft.append((time.perf_counter() - t0) * 1e3)
            s.generate(GEN)
            s.close()
        after = store.stats()
        eng.close()  # background disk writes finish before the directory goes
    d = {k: after[k] - before[k] for k in ("hits", "misses", "promotions", "demotions", "evictions")}
    assert d["hits"] == served["gpu"] and d["misses"] == served["host"] + served["disk"], (d, served)
    visits = len(order)
    return {
        "policy": policy, "tiers": tiers, "n": n, "ws_tokens": n * args.length,
        "ws_mb": round(n * nb / 2**20, 2), "visits": visits,
        "hit_gpu": served["gpu"] / visits, "hit_host": served["host"] / visits, "hit_disk": served["disk"] / visits,
        "cold": served["cold"] / visits, "served": served,
        "ttft_mean_ms": statistics.fmean(ttft), "ttft_p99_ms": percentile(ttft, 99),
        "ttft_median_ms": median(ttft), "ttft_ms": [round(t, 3) for t in ttft],
        "moved_mb": (d["promotions"] + d["demotions"]) * nb / 2**20, "evictions": d["evictions"],
        "stats_delta": d,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        threads = 1 if args.threads is None else args.threads
        if threads:
            torch.set_num_threads(threads)
    t_start = time.perf_counter()
    max_seq = -(-(args.length + SUFFIX + GEN) // CHUNK) * CHUNK
    n_max = max(args.ns)
    log(f"device={args.device} L={args.length} N={args.ns} policies={args.policies} threads={torch.get_num_threads()}")
    lib = Library(args, max_seq, n_max)
    rng = random.Random(args.seed)
    suffix_pool = [[rng.randrange(1, 4096) for _ in range(SUFFIX)] for _ in range(64)]
    cold_ref = lib.cold_ttft_ms(args, suffix_pool[0])
    nb = lib.nbytes
    log(f"capsule {nb / 2**20:.2f} MB; budgets: gpu {args.gpu_caps}, host {args.host_caps}, disk {args.disk_caps} "
        f"capsules; cold prefill of {args.length}+{SUFFIX} tokens: {cold_ref:.1f} ms")

    traces: list[tuple[str, int, list[int]]] = []
    for n in args.ns:
        visits = 8 if args.quick and args.visits is None else max(n, args.visits or 16)
        traces.append(("cyclic", n, [v % n for v in range(visits)]))
    traces.append(("zipf", n_max, zipf_trace(n_max, args.zipf_visits, args.seed)))

    rows = []
    for trace, n, order in traces:
        suffixes = [suffix_pool[v % len(suffix_pool)] for v in range(len(order))]
        for tiers in TIER_SETUPS:
            for policy in args.policies:
                t0 = time.perf_counter()
                r = run_trace(args, lib, max_seq, policy, tiers, n, order, suffixes)
                r.update(trace=trace, cold_ref_ms=cold_ref, cold_over_mean=cold_ref / r["ttft_mean_ms"])
                rows.append(r)
                log(f"{trace:6s} N={n:3d} {tiers:13s} {policy:10s} gpu {r['hit_gpu']:.2f} host {r['hit_host']:.2f} "
                    f"disk {r['hit_disk']:.2f} cold {r['cold']:.2f}  TTFT mean {r['ttft_mean_ms']:.1f} ms "
                    f"p99 {r['ttft_p99_ms']:.1f} ms  ({time.perf_counter() - t0:.1f} s)")

    print_table(rows, COLUMNS)
    out = Path(args.out)
    cyc = [r for r in rows if r["trace"] == "cyclic"]
    xs = [n * args.length for n in args.ns]
    series = {}
    for tiers in TIER_SETUPS:
        for policy in args.policies:
            by_n = {r["n"]: r["ttft_mean_ms"] for r in cyc if r["policy"] == policy and r["tiers"] == tiers}
            series[f"{policy} ({tiers})"] = [by_n[n] for n in args.ns]
    series["cold prefill"] = [cold_ref] * len(xs)
    caps = args.gpu_caps * args.length
    plot_lines(out / "working_set.png", xs, series, xlabel="working set N*L (tokens)",
               ylabel="TTFT mean (ms)", logy=True, logx=True,
               title=f"cyclic trace, L={args.length}; gpu tier {caps} tok, +host {args.host_caps * args.length}, "
                     f"+disk {args.disk_caps * args.length}")
    params = {k: v for k, v in vars(args).items() if k != "out"}
    params.update(max_seq=max_seq, prefill_chunk=CHUNK, suffix=SUFFIX, generate=GEN, zipf_s=ZIPF_S,
                  capsule_nbytes=nb, torch_threads=torch.get_num_threads())
    write_json(out / "working_set.json", {"machine": machine_info(args.device), "params": params,
                                           "cold_ref_ms": cold_ref, "rows": rows,
                                           "wall_s": round(time.perf_counter() - t_start, 1)})
    log(f"wrote {out / 'working_set.json'} and {out / 'working_set.png'} in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
