"""Serving benchmark: N independent agent sessions at once through the orchestrator (the worker's step
scheduler batches them), against the same sessions one after another, and HF transformers per session.

Each agent restores its own capsule (a context of --context tokens), appends a --turn-token turn and streams
--gen tokens, as a separate asyncio task; all N start together. Reported per N: aggregate decode tokens/s,
p50 / p99 TTFT (task start -> first streamed token) and inter-token latency, the speed-up over running the
same N sessions sequentially, and over HF transformers (generate per session, --hf-sessions of them timed
and scaled to N). Also per N: the decode throughput (tokens streamed while every session is decoding, over
that window) and, from the workers' step loops, the milliseconds per decode step spent decoding and
prefilling, and for the largest N the loop's step records over its concurrent run (where its requests'
starts, prefill forwards and first decode steps fell, and how long each step held the decoding sessions), with
a summary printed. Every session's tokens are checked against its solo run. Prints a table, writes
bench/out/serving.json and bench/out/serving.png (serving_w2.json etc. with --workers / --skew).

`--workers W` spreads the agents' capsules round-robin over W workers (one GPU each on cuda; agents follow
their capsule); `--skew` has every agent restore one hot capsule, and `--replicate-hot GAP` lets the
router copy it to a worker with GAP fewer sessions (OrchestratorConfig.replicate_hot).

`--http` runs the same workload through capsulert's HTTP server (the app and uvicorn, as a `capsulert serve`
replica runs them) with the official openai client (async, in a process of its own), and through the async
API on the same worker (serving_http.py: one worker, so one GPU is enough), and reports the HTTP overhead:
p50 / p99 wall time of one request at a time (streamed and whole), and tokens/s and TTFT per N; the same
requests also from httpx and from a minimal HTTP/1.1 client, each with its overhead split into the server's
own work and the client's and the loopback's. Every HTTP answer is checked against the async API's tokens.
Writes bench/out/serving_http.json.

    .venv/bin/python bench/serving.py --quick            # CPU, default model
    .venv/bin/python bench/serving.py --quick --http     # the same through the HTTP server
    python bench/serving.py --device cuda --model random:capsulert/configs/models/qwen3_5-9b-shape.yaml
    python bench/serving.py --device cuda --model random:capsulert/configs/models/qwen3_5-35b-a3b-shape.yaml

`--model` takes what EngineConfig.model does: 'default', a checkpoint directory (dense or MoE) or random:<shape>.
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
from common import OUT_DIR, TAIL_REPLAY, hf_causal_lm, log, machine_info, percentile, plot_lines, print_table, write_json  # noqa: E402

from capsulert.orchestrator import Orchestrator  # noqa: E402
from capsulert.protocol.sampling import SamplingParams  # noqa: E402
from capsulert.protocol.results import FinalEvent  # noqa: E402

PARAMS = SamplingParams(ignore_eos=True)  # fixed lengths, so every N does the same work per session
ENGINE_DEFAULT = object()  # an option left to the engine's config (argparse converts string defaults)


def _rows_or_none(v: str) -> int | None:
    return None if v.lower() == "none" else int(v)


async def agent(orch, name: str, turn: list[int], gen: int) -> dict:
    t0 = time.perf_counter()
    s = await orch.restore(name)
    await s.append(turn)
    stamps, tokens = [], []
    async for ev in s.stream(gen, PARAMS):
        if isinstance(ev, FinalEvent):
            break
        stamps.append(time.perf_counter())
        tokens.append(ev.token)
    await s.close()
    itl = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
    return {"ttft_ms": (stamps[0] - t0) * 1e3, "itl_ms": itl, "tokens": tokens, "stamps": stamps, "start": t0,
            "wall_ms": (time.perf_counter() - t0) * 1e3}


async def run_n(orch, names, turns, gen: int, concurrent: bool, lone: bool = False) -> dict:
    """The agents of `names` with their turns, all at once (`concurrent`) or one after another. `lone`: one
    after another as samples of one session's figures (its decode rate the median of theirs)."""
    t0 = time.perf_counter()
    if concurrent:
        outs = await asyncio.gather(*(agent(orch, nm, tn, gen) for nm, tn in zip(names, turns)))
    else:
        outs = [await agent(orch, nm, tn, gen) for nm, tn in zip(names, turns)]
    wall = time.perf_counter() - t0
    itl = [x for o in outs for x in o["itl_ms"]]
    rate = percentile([steady_rate([o]) for o in outs], 50) if lone else steady_rate(outs)
    return {"wall_s": wall, "tokens_per_s": len(names) * gen / wall, "decode_tokens_per_s": rate,
            "ttft_p50_ms": percentile([o["ttft_ms"] for o in outs], 50),
            "ttft_p99_ms": percentile([o["ttft_ms"] for o in outs], 99),
            "itl_p50_ms": percentile(itl, 50) if itl else float("nan"),
            "itl_p99_ms": percentile(itl, 99) if itl else float("nan"),
            "tokens": [o["tokens"] for o in outs]}


def steady_rate(outs: list[dict]) -> float:
    """Aggregate decode tokens/s while every session is decoding: the tokens streamed between the last
    session's first token and the first session's last token, over that window (NaN when the windows of
    the sessions do not overlap). The end-to-end rate (tokens_per_s) also counts restores and prefills."""
    lo, hi = max(o["stamps"][0] for o in outs), min(o["stamps"][-1] for o in outs)
    if hi <= lo:
        return float("nan")
    inside = sum(lo < t <= hi for o in outs for t in o["stamps"])
    return inside / (hi - lo)


async def loop_busy(orch) -> dict:
    """The workers' step-loop counters summed: decode steps, decoded tokens and seconds per loop phase."""
    rows = await orch.stats()
    out = {"decode_steps": 0, "decoded_tokens": 0, "prefill_forwards": 0, "start": 0.0, "prefill": 0.0, "decode": 0.0}
    for r in rows:
        for k in ("decode_steps", "decoded_tokens", "prefill_forwards"):
            out[k] += r[k]
        for k, v in r["loop_busy_s"].items():
            out[k] += v
    return out


async def step_records(orch, since: float) -> list[dict]:
    """Every worker's step records since `since` (time.monotonic()), with the worker's index and the step's
    start in ms after `since`, in time order."""
    out = []
    for w, r in enumerate(await orch.stats(steps_since=since)):
        out += [dict(rec, worker=w, at_ms=(rec["at_s"] - since) * 1e3) for rec in r["recent_steps"]]
    return sorted(out, key=lambda rec: rec["at_ms"])


def print_steps(n: int, records: list[dict]) -> None:
    """The largest N's first steps in full (its starts and prefills), and the steps that held decoding
    sessions longest."""
    cols = ["at_ms", "started", "prefill_forwards", "prefill_tokens", "decode_rows", "start_ms", "prefill_ms",
            "decode_ms"]
    log(f"N={n}: {len(records)} steps; the first 12")
    print_table(records[:12], cols)
    decoding = [r for r in records if r["decode_rows"]]
    longest = sorted(decoding, key=lambda r: -(r["start_ms"] + r["prefill_ms"] + r["decode_ms"]))[:8]
    log(f"N={n}: the 8 longest steps that decoded")
    print_table(sorted(longest, key=lambda r: r["at_ms"]), cols)


def loop_figures(before: dict, after: dict, wall_s: float, workers: int) -> dict:
    """Per decode step: the loop's milliseconds in each phase, and the share of the run the loops were busy
    (the rest they waited for requests: time spent outside the worker's step loop)."""
    d = {k: after[k] - before[k] for k in after}
    steps = max(d["decode_steps"], 1)
    busy = d["start"] + d["prefill"] + d["decode"]
    return {"steps": d["decode_steps"], "rows_per_step": d["decoded_tokens"] / steps,
            "prefill_forwards": d["prefill_forwards"], "prefill_forwards_per_step": d["prefill_forwards"] / steps,
            "decode_ms_per_step": d["decode"] * 1e3 / steps, "prefill_ms_per_step": d["prefill"] * 1e3 / steps,
            "start_ms_per_step": d["start"] * 1e3 / steps, "busy_share": busy / (wall_s * workers)}


def hf_seconds_per_session(engine_cfg: dict, contexts, turns, gen: int, sessions: int) -> float:
    """HF transformers generate (greedy, its default dynamic cache) from context + turn, per session."""
    from capsulert.engine.engine import Engine

    eng = Engine.from_config(engine_cfg)
    model = hf_causal_lm(eng)
    times = []
    with torch.inference_mode():
        for ctx, turn in list(zip(contexts, turns))[:sessions]:
            ids = torch.tensor([ctx + turn], device=eng.device)
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=gen, min_new_tokens=gen, do_sample=False)
            if eng.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return sum(times) / len(times)


async def main(args) -> int:
    """One run per --contexts value (one --context otherwise); with several, the ratio of their throughputs."""
    contexts = args.contexts or [args.context]
    by_context = {}
    for ctx in contexts:
        args.context = ctx
        by_context[ctx] = await run(args)
    if len(contexts) > 1:
        base = contexts[0]
        ratios = [dict(n=r["n"], **{f"tokens_per_s@{c}": by_context[c][i]["tokens_per_s"] for c in contexts},
                       **{f"ratio {c}/{base}": by_context[c][i]["tokens_per_s"] / r["tokens_per_s"] for c in contexts[1:]})
                  for i, r in enumerate(by_context[base])]
        print("\nend-to-end tokens/s by context length (a turn ending off the grid should cost what one on it does)\n")
        print_table(ratios, list(ratios[0]))
        write_json(OUT_DIR / "serving_contexts.json", {"machine": machine_info(args.device), "args": vars(args),
                                                        "rows": ratios})
    return 0


def engine_config(args) -> dict:
    """The workers' EngineConfig fields from the command line (the engine's defaults where not given)."""
    chunk = args.prefill_chunk
    max_seq = -(-(args.context + args.turn + args.gen + 1) // chunk) * chunk
    engine_cfg = dict(model=args.model, device=args.device, slots=max(args.ns) + 2, max_seq=max_seq,
                      prefill_chunk=chunk, tail_replay=TAIL_REPLAY[args.tail_replay],
                      scheduler={"batch_prefill": not args.no_batch_prefill,
                                 "step_prefill_tokens": args.step_prefill_tokens,
                                 "step_prefill_tokens_decoding": args.step_prefill_decoding,
                                 **({} if args.step_rederive_rows is ENGINE_DEFAULT
                                    else {"step_rederive_rows": args.step_rederive_rows})})
    if args.mixed_pieces is not None:
        engine_cfg["mixed_rederive_pieces"] = tuple(args.mixed_pieces)
    if args.batched_piece_rows is not None:
        engine_cfg["batched_piece_rows"] = args.batched_piece_rows
    return engine_cfg


async def run(args) -> list[dict]:
    torch.set_num_threads(args.threads)
    n_max = max(args.ns)
    engine_cfg = engine_config(args)
    ocfg = dict(engine=engine_cfg, num_workers=args.workers, call_timeout_s=3600, torch_threads=args.threads)
    if args.replicate_hot is not None:
        ocfg["replicate_hot"] = args.replicate_hot
    orch = await Orchestrator.start(ocfg)
    try:
        vocab = 4000
        g = torch.Generator().manual_seed(0)
        contexts = [torch.randint(10, vocab, (args.context,), generator=g).tolist() for _ in range(n_max)]
        turns = [torch.randint(10, vocab, (args.turn,), generator=g).tolist() for _ in range(n_max)]
        if args.skew:  # every agent restores one hot capsule (the first context); its turns still differ
            contexts = [contexts[0]] * n_max
        log(f"making {1 if args.skew else n_max} capsule(s) of {args.context} tokens over {args.workers} worker(s)")
        for i, ctx in enumerate(contexts[:1] if args.skew else contexts):
            s = await orch.open(ctx, worker=i % args.workers)  # capsule affinity: agent i lives where its capsule is
            await s.snapshot(f"agent{i}")
            await s.close()
        hot = ["agent0"] * n_max
        solo = [None] * n_max
        rows = []
        for n in args.ns:
            names = hot[:n] if args.skew else [f"agent{i}" for i in range(n)]
            # where the capsules lie before the crowd restores them: a copy from host memory is bound by the
            # link (~25-55 GB/s), one on the device by HBM, so a restore step's time reads differently
            held = [c for c in await orch.capsules() if c["name"] in set(names)]
            tiers = {t: sum(c["tier"] == t for c in held) for t in sorted({c["tier"] for c in held})}
            log(f"N={n}: concurrent; capsules by tier {tiers}, {sum(c['size_bytes'] for c in held) / 1e9:.2f} GB")
            before, t_run = await loop_busy(orch), time.monotonic()
            if n == 1 and args.n1_samples > 1:
                # one session's figures from several lone runs, one after another: a single first token is no
                # median, and one slow request (a host hiccup) once moved every ratio against N = 1
                k = min(args.n1_samples, n_max)
                lone = hot[:k] if args.skew else [f"agent{i}" for i in range(k)]
                log(f"N=1: {k} lone runs, one after another")
                conc = await run_n(orch, lone, turns[:k], args.gen, False, lone=True)
                for i, b in enumerate(conc["tokens"]):  # each a solo run: the crowd's sessions are checked against it
                    solo[i] = solo[i] or b
            else:
                conc = await run_n(orch, names, turns[:n], args.gen, True)
            loop = loop_figures(before, await loop_busy(orch), conc["wall_s"], args.workers)
            if n == n_max:
                trace = await step_records(orch, t_run)
            placed = sorted(len(v) for v in orch.placement().values())
            if n <= args.max_sequential:
                log(f"N={n}: sequential")
                seq = await run_n(orch, names, turns[:n], args.gen, False)
                for i, b in enumerate(seq["tokens"]):
                    solo[i] = solo[i] or b
            else:  # the sequential rate does not change with N: reuse the largest measured
                seq = {"tokens_per_s": rows[-1]["seq_tokens_per_s"], "tokens": []}
            for i, a in enumerate(conc["tokens"]):
                if solo[i] is None and not args.check_all:
                    continue  # checked: the sessions also run one after another
                if solo[i] is None:  # not run alone yet: run it alone now
                    solo[i] = (await run_n(orch, [names[i]], [turns[i]], args.gen, False))["tokens"][0]
                assert a == solo[i], f"session {i}: batched tokens differ from its solo run"
            rows.append({"n": n, "tokens_per_s": conc["tokens_per_s"], "decode_tokens_per_s": conc["decode_tokens_per_s"],
                         "seq_tokens_per_s": seq["tokens_per_s"], "loop": loop, "copies_per_capsule": placed,
                         "capsule_tiers": tiers,
                         "speedup_vs_sequential": conc["tokens_per_s"] / seq["tokens_per_s"],
                         "ttft_p50_ms": conc["ttft_p50_ms"], "ttft_p99_ms": conc["ttft_p99_ms"],
                         "itl_p50_ms": conc["itl_p50_ms"], "itl_p99_ms": conc["itl_p99_ms"],
                         "checked_exact": sum(x is not None for x in solo[:n])})
        rows[-1]["step_records"] = trace
    finally:
        await orch.close()
    base, dbase = rows[0]["tokens_per_s"], rows[0]["decode_tokens_per_s"]
    for r in rows:
        r["throughput_vs_n1"] = r["tokens_per_s"] / base
        r["decode_vs_n1"] = r["decode_tokens_per_s"] / dbase
        # a crowd against one session: its first tokens and the spread of its streams' token gaps
        r["ttft_p50_vs_n1"] = r["ttft_p50_ms"] / rows[0]["ttft_p50_ms"]
        r["ttft_p99_vs_n1"] = r["ttft_p99_ms"] / rows[0]["ttft_p50_ms"]
        r["itl_p99_over_p50"] = r["itl_p99_ms"] / r["itl_p50_ms"]
        r.update({f"loop_{k}": v for k, v in r["loop"].items()})
    if not args.no_hf:
        log("HF transformers per session")
        hf_s = hf_seconds_per_session(engine_cfg, contexts, turns, args.gen, args.hf_sessions)
        for r in rows:
            r["hf_tokens_per_s"] = args.gen / hf_s
            r["speedup_vs_hf"] = r["tokens_per_s"] / r["hf_tokens_per_s"]
    cols = ["n", "tokens_per_s", "throughput_vs_n1", "decode_tokens_per_s", "decode_vs_n1", "seq_tokens_per_s",
            "speedup_vs_sequential", "ttft_p50_ms", "ttft_p99_ms", "ttft_p50_vs_n1", "ttft_p99_vs_n1", "itl_p50_ms",
            "itl_p99_ms", "itl_p99_over_p50", "loop_prefill_forwards", "loop_decode_ms_per_step",
            "loop_prefill_ms_per_step", "loop_busy_share"] + ([] if args.no_hf else ["hf_tokens_per_s", "speedup_vs_hf"])
    print_table(rows, cols)
    print_steps(rows[-1]["n"], rows[-1]["step_records"])
    tag = f"_w{args.workers}" + ("_skew" if args.skew else "") + ("_rep" if args.replicate_hot else "")
    out = Path(args.out or OUT_DIR)
    write_json(out / f"serving{'' if tag == '_w1' else tag}.json",
               {"machine": machine_info(args.device), "args": vars(args), "rows": rows})
    curves = {"concurrent (scheduler)": [r["tokens_per_s"] for r in rows],
              "sequential": [r["seq_tokens_per_s"] for r in rows]}
    if not args.no_hf:
        curves["HF transformers, per session"] = [r["hf_tokens_per_s"] for r in rows]
    plot_lines(out / f"serving{'' if tag == '_w1' else tag}.png", [r["n"] for r in rows], curves, "concurrent sessions N",
               "aggregate decode tokens/s", logx=True, logy=True, title=f"serving, {args.device}")
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--context", type=int, default=3000)
    ap.add_argument("--contexts", type=int, nargs="+", default=None,
                    help="run once per context length and print the ratio of their throughputs (e.g. 2048 3000)")
    ap.add_argument("--turn", type=int, default=32)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prefill-chunk", type=int, default=1024)
    ap.add_argument("--tail-replay", choices=("auto", "on", "off"), default="auto",
                    help="EngineConfig.tail_replay (auto: the engine's default, on): on, a capsule keeps its tail "
                    "rows and a crowd's turns replay them instead of re-running them")
    ap.add_argument("--step-rederive-rows", type=_rows_or_none, default=ENGINE_DEFAULT, metavar="ROWS|none",
                    help="the grid re-derivation rows a decode step runs (SchedulerConfig.step_rederive_rows: 64 a "
                         "session); the crowd past it waits a step. Bounds ITL p99 for a crowd in lockstep; none: "
                         "unbounded; default: the engine's (256)")
    ap.add_argument("--mixed-pieces", type=int, nargs="*", default=None, metavar="N",
                    help="EngineConfig.mixed_rederive_pieces: the re-derivation counts a decode step's mixed forward "
                         "is captured for (none given: every re-derivation is a forward of its own); default: the "
                         "engine's")
    ap.add_argument("--batched-piece-rows", type=int, default=None, metavar="ROWS",
                    help="EngineConfig.batched_piece_rows: the largest batched-append shape (sessions x tokens) "
                         "captured as a CUDA graph; 0: every batched append an eager forward (the path before "
                         "those graphs); default: the engine's (2048)")
    ap.add_argument("--step-prefill-tokens", type=int, default=None, metavar="TOKENS",
                    help="the workers' step prefill budget (SchedulerConfig.step_prefill_tokens): the prompt tokens "
                         "one step prefills across its sessions; default: the scheduler's")
    ap.add_argument("--step-prefill-decoding", type=int, default=None, metavar="TOKENS",
                    help="the workers' step prefill budget while sessions decode (SchedulerConfig."
                         "step_prefill_tokens_decoding): bounds ITL; default: the whole step budget")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hf-sessions", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1, help="GPU workers (one GPU each on cuda); capsules are "
                    "made round-robin over them and agents follow their capsule")
    ap.add_argument("--skew", action="store_true", help="every agent restores the same (hot) capsule")
    ap.add_argument("--replicate-hot", type=int, default=None, metavar="GAP",
                    help="OrchestratorConfig.replicate_hot: copy a capsule to a worker with GAP fewer sessions")
    ap.add_argument("--max-sequential", type=int, default=16, help="largest N also run one after another")
    ap.add_argument("--n1-samples", type=int, default=5, metavar="K",
                    help="N = 1's TTFT, ITL and rates from K lone runs one after another (agents 0..K-1), the "
                         "denominator of every ratio; 1: a single run")
    ap.add_argument("--check-all", action="store_true",
                    help="check every session against its solo run (default: those run one after another)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-batch-prefill", action="store_true",
                    help="one forward per session's prefill piece (the way before batched appends: the baseline)")
    ap.add_argument("--quick", action="store_true", help="CPU-sized: N 1 4 16, 512-token contexts, 32 tokens")
    ap.add_argument("--http", action="store_true",
                    help="compare the async API with the HTTP server (openai client) on the same workload")
    ap.add_argument("--requests", type=int, default=40, help="--http: requests timed one at a time, per path")
    ap.add_argument("--out", help="directory of the JSON and PNG results (default: bench/out)")
    args = ap.parse_args(argv)
    if args.quick:
        args.ns, args.context, args.gen, args.prefill_chunk, args.check_all = [1, 4, 16], 512, 32, 256, True
    return args


if __name__ == "__main__":
    _args = parse_args()
    if _args.http:
        from serving_http import run  # noqa: E402

        sys.exit(run(_args))
    sys.exit(asyncio.run(main(_args)))
