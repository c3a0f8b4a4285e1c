"""What the orchestrator (Ray actor + async API) costs over calling the Engine in-process.

1. per-verb overhead, p50 / p99: restore + append + first token (one chained actor call), append,
   generate 1 token, in-place restore, and a control-group round trip;
2. best-of-N wall time vs N (fork + append + batched decode), through the orchestrator vs in-process;
3. episode resets per second (EpisodeDriver.reset vs Session.restore).

Both sides use the same engine config and the same number of torch threads (--threads, default 1).
Prints a table, writes bench/out/orchestrator.json and bench/out/orchestrator.png.

    .venv/bin/python bench/orchestrator.py [--quick] [--device cpu]
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from common import OUT_DIR, log, machine_info, percentile, print_table, write_json  # noqa: E402

from capsulert.orchestrator import EpisodeDriver, Orchestrator, best_of_n  # noqa: E402
from capsulert.engine.engine import Engine  # noqa: E402
from capsulert.protocol.sampling import SamplingParams  # noqa: E402
from capsulert.protocol.requests import LastCall, Ping  # noqa: E402

PREFIX = ("You are a coding agent working in a large repository. The capsule runtime keeps the complete state "
          "of a session at a committed boundary, so the agent returns to it in milliseconds. ") * 6
SUFFIX = " User: what next?"


def stats(ms: list[float]) -> dict:
    return {"p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "n": len(ms)}


async def timed(fn, reps: int, warmup: int = 1) -> list[float]:
    out = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        await fn()
        if i >= warmup:
            out.append((time.perf_counter() - t0) * 1e3)
    return out


async def sync_timed(fn, reps: int, warmup: int = 1) -> list[float]:
    async def a():
        fn()
    return await timed(a, reps, warmup)


async def main(args) -> None:
    torch.set_num_threads(args.threads)
    reps = 40 if args.quick else 120
    ns = [1, 4, 8] if args.quick else [1, 2, 4, 8, 16]
    tokens = 8 if args.quick else 16
    ecfg = dict(device=args.device, slots=max(ns) + 4, max_seq=2048, prefill_chunk=256)
    t0 = time.perf_counter()
    eng = Engine.from_config(ecfg)
    orch = await Orchestrator.start(dict(engine=ecfg, torch_threads=args.threads, local_num_cpus=2))
    log(f"engine + orchestrator up in {time.perf_counter() - t0:.1f}s")
    try:
        s = eng.open()
        s.append(PREFIX)
        s.snapshot("c0")
        rs = await orch.open(PREFIX)
        await rs.snapshot("c0")
        log(f"prefix of {len(s.tokens)} tokens snapshot on both sides")

        # 1. per-verb overhead
        rows, results = [], {"verbs": {}, "best_of_n": [], "resets": {}}

        def rag_local():
            r = eng.restore("c0")
            r.append(SUFFIX)
            r.generate(1)
            r.close()

        async def restored_append():  # untimed restores, timed appends
            s.restore("c0")
            await rs.restore("c0")
            t = time.perf_counter()
            s.append([11, 12, 13, 14])
            a = time.perf_counter()
            await rs.append([11, 12, 13, 14])
            b = time.perf_counter()
            return (a - t) * 1e3, (b - a) * 1e3, await inside()

        async def pair(local, remote):
            t = time.perf_counter()
            local()
            a = time.perf_counter()
            await remote()
            b = time.perf_counter()
            return (a - t) * 1e3, (b - a) * 1e3, await inside()

        async def inside():
            return await orch.call(0, LastCall())

        verbs = {
            "restore+append+first token": lambda: pair(rag_local, lambda: orch.restore_append_generate("c0", SUFFIX, 1)),
            "append (4 tokens)": restored_append,
            "generate 1 token": lambda: pair(lambda: s.generate(1), lambda: rs.generate(1)),
            "restore in place": lambda: pair(lambda: s.restore("c0"), lambda: rs.restore("c0")),
            "control round trip": lambda: pair(lambda: None, lambda: orch.call(0, Ping())),
        }
        for name, measure in verbs.items():  # the two sides interleaved, so machine noise hits both alike
            lt, rt, tt = [], [], []
            for i in range(reps + 3):
                a, b, c = await measure()
                if i >= 3:
                    lt.append(a)
                    rt.append(b)
                    tt.append(b - c if name != "control round trip" else b)
            ls, rs_ = stats(lt), stats(rt)
            ts = stats(tt)
            results["verbs"][name] = {"in_process": ls, "orchestrator": rs_, "transport": ts}
            rows.append({"verb": name, "in-proc p50": ls["p50_ms"], "orch p50": rs_["p50_ms"],
                         "overhead p50": rs_["p50_ms"] - ls["p50_ms"], "transport p50": ts["p50_ms"],
                         "in-proc p99": ls["p99_ms"], "orch p99": rs_["p99_ms"], "transport p99": ts["p99_ms"]})
            log(f"{name}: in-process p50 {ls['p50_ms']:.2f} ms, orchestrator p50 {rs_['p50_ms']:.2f} ms")
        print("\nPer-verb latency (ms)")
        print("(overhead = orchestrator wall - in-process wall; transport = orchestrator wall - time spent inside")
        print(" the actor's engine call, i.e. Ray + asyncio + serialisation, excluding any compute slowdown)")
        print_table(rows, ["verb", "in-proc p50", "orch p50", "overhead p50", "transport p50", "in-proc p99",
                           "orch p99", "transport p99"])

        # 2. best-of-N wall time vs N
        brows = []
        bon_reps = 2 if args.quick else 3
        for n in ns:
            sps = [SamplingParams(temperature=0.9, seed=i) for i in range(n)]

            def local_bon():
                br = eng.fork("c0", n)
                for b in br:
                    b.append(SUFFIX)
                out = eng.generate(br, tokens, sps)
                for b in br:
                    b.close()
                return out

            lt = await sync_timed(local_bon, bon_reps, warmup=1)
            rt = await timed(lambda: best_of_n(orch, "c0", SUFFIX, n, tokens, sps), bon_reps, warmup=1)
            lm, rm = percentile(lt, 50), percentile(rt, 50)
            results["best_of_n"].append({"n": n, "tokens": tokens, "in_process_ms": lm, "orchestrator_ms": rm})
            brows.append({"N": n, "in-proc ms": lm, "orch ms": rm, "ratio": rm / lm})
            log(f"best-of-{n}: in-process {lm:.0f} ms, orchestrator {rm:.0f} ms")
        print(f"\nBest-of-N wall time ({tokens} new tokens each, p50 of {bon_reps})")
        print_table(brows, ["N", "in-proc ms", "orch ms", "ratio"])

        # 3. episode resets per second
        nres = 300 if args.quick else 2000
        t = time.perf_counter()
        for _ in range(nres):
            s.restore("c0")
        local_rate = nres / (time.perf_counter() - t)
        async with EpisodeDriver(orch, "c0", n_envs=4) as drv:
            t = time.perf_counter()
            for i in range(nres):
                await drv.reset(i % 4)
            seq_rate = nres / (time.perf_counter() - t)
            t = time.perf_counter()
            await drv.run(lambda ep, step, a: None, nres)  # 4 envs resetting concurrently
            conc_rate = nres / (time.perf_counter() - t)
        results["resets"] = {"count": nres, "in_process_per_s": local_rate, "orchestrator_sequential_per_s": seq_rate,
                             "orchestrator_4_envs_per_s": conc_rate}
        print(f"\nEpisode resets per second ({nres} resets)")
        print_table([{"path": "in-process Session.restore", "resets/s": local_rate},
                     {"path": "EpisodeDriver.reset, sequential", "resets/s": seq_rate},
                     {"path": "EpisodeDriver.run, 4 envs", "resets/s": conc_rate}], ["path", "resets/s"])
    finally:
        await orch.close()

    results["config"] = {**ecfg, "threads": args.threads, "quick": args.quick, "reps": reps, "prefix_tokens": len(s.tokens)}
    results["machine"] = machine_info(args.device)
    out = write_json(OUT_DIR / "orchestrator.json", results)
    png = plot(results, OUT_DIR / "orchestrator.png")
    print(f"\nwrote {out} and {png}")


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=110)
    names = list(results["verbs"])
    x = range(len(names))
    for off, side in ((-0.2, "in_process"), (0.2, "orchestrator")):
        a.bar([i + off for i in x], [results["verbs"][n][side]["p50_ms"] for n in names], width=0.4, label=f"{side} p50")
        a.scatter([i + off for i in x], [results["verbs"][n][side]["p99_ms"] for n in names], marker="_", s=200,
                  color="k", label="p99" if side == "orchestrator" else None)
    a.set_xticks(list(x))
    a.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
    a.set_ylabel("ms")
    a.set_title("per-verb latency")
    a.legend()
    bn = results["best_of_n"]
    b.plot([r["n"] for r in bn], [r["in_process_ms"] for r in bn], marker="o", label="in-process")
    b.plot([r["n"] for r in bn], [r["orchestrator_ms"] for r in bn], marker="o", label="orchestrator")
    b.set_xlabel("N")
    b.set_ylabel("wall ms")
    b.set_title(f"best-of-N ({bn[0]['tokens']} tokens each)")
    b.grid(alpha=0.3)
    b.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions; under ~40 s on CPU")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    asyncio.run(main(ap.parse_args()))
