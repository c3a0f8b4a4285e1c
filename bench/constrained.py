"""Constrained decode cost: one decode step of a batch of 8 sessions, every one constrained by a JSON
schema (token masks filled by llguidance, applied to the sampled logits block), half constrained, and none,
on the same prompts. Per-step wall time (median over the steps of several runs), and the constrained /
unconstrained ratio (target: <= 1.2x on CPU). Prints a table, writes bench/out/constrained.json and
bench/out/constrained.png.

    .venv/bin/python bench/constrained.py                    # CPU, default model
    python bench/constrained.py --device cuda --model DIR    # a real checkpoint on the GPU
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from common import OUT_DIR, cuda_sync, log, machine_info, plot_lines, print_table, write_json  # noqa: E402

from capsulert.protocol.constraint import Constraint  # noqa: E402
from capsulert.engine.decoding import DecodeStream, advance  # noqa: E402
from capsulert.engine.engine import Engine  # noqa: E402
from capsulert.protocol.sampling import SamplingParams  # noqa: E402

BATCH = 8
# a schema whose strings let a random-weights model write for a long time: every step stays constrained
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "body"],
          "properties": {"title": {"type": "string"}, "body": {"type": "string"}}}
PROMPTS = [f"Record {i}: the capsule runtime keeps a session's state at a boundary. " for i in range(BATCH)]


def steps_ms(engine: Engine, constrained: int, tokens: int, sampling: dict) -> tuple[list[float], int]:
    """Per-step wall times (ms) of one generate of `tokens` tokens for BATCH sessions, the first
    `constrained` of them with the schema; and how many sessions were still constrained at the end."""
    schema = Constraint(json_schema=SCHEMA)
    sessions = [engine.open(prompt=p, namespace=None) for p in PROMPTS]
    streams = [DecodeStream(engine, s, tokens, SamplingParams(**sampling, ignore_eos=True,
                                                             constraint=schema if i < constrained else None))
               for i, s in enumerate(sessions)]
    out = []
    try:
        while any(not st.done for st in streams):
            for st in streams:  # every constrained session in every step: its mask (computed off the step) ready
                if st.grammar is not None and not st.done:
                    st.grammar.pending.result()
            t0 = time.perf_counter()
            advance(engine, streams)
            cuda_sync(engine.device)
            out.append((time.perf_counter() - t0) * 1e3)
        live = sum(1 for st in streams[:constrained] if st.result.stop_reason == "length")
    finally:
        for s in sessions:
            s.close()
    return out[1:], live  # the first step computes every stream's first logits: not a decode step


def mask_ms(engine: Engine, repeats: int = 200) -> tuple[float, float]:
    """Median ms of the mask work of one step of BATCH constrained sessions: in the step (copy every ready
    row, unpack, mask the logits block: what constraining adds to a step, apart from the load of the
    machine), and off it (the BATCH masks computed on the mask worker, handed over included)."""
    from capsulert.engine.grammar import allowed_tokens

    states = [engine.grammars.state(Constraint(json_schema=SCHEMA)) for _ in range(BATCH)]
    prefix = engine.tokenize('{"title":"A capsule keeps')
    for st in states:
        for t in prefix:
            st.pending.result()
            st.accept(t)
            st.request_next()
        st.pending.result()
    off = []
    for _ in range(repeats // 10):
        t0 = time.perf_counter()
        for st in states:  # the same mask again: the worker's cost of it
            st.request_next()
        for st in states:
            st.pending.result()
        off.append((time.perf_counter() - t0) * 1e3)
    logits = torch.randn(BATCH, engine.model_cfg.vocab_size, device=engine.device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        bitmask = engine.grammars.bitmask(BATCH)
        for r, st in enumerate(states):
            st.fill(bitmask, r)
        logits.masked_fill(~allowed_tokens(bitmask, logits.shape[1], logits.device), float("-inf"))
        cuda_sync(engine.device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), statistics.median(off)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.from_config(model=args.model, device=args.device, slots=BATCH, max_seq=1024, prefill_chunk=128)
    rows, cases = [], [("none", 0), ("half", BATCH // 2), ("all", BATCH)]
    for sampling_name, sampling in (("greedy", {}), ("sampled", {"temperature": 0.8, "top_p": 0.95, "seed": 1})):
        times = {name: [] for name, _ in cases}
        live = {name: k for name, k in cases}
        ratios = {name: [] for name, _ in cases}
        steps_ms(engine, BATCH, 4, sampling)  # warm-up (llguidance's tokenizer, kernels)
        for run in range(args.runs):  # the cases interleaved: a shared machine's load hits them alike
            run_median = {}
            for name, k in cases:
                t, still = steps_ms(engine, k, args.tokens, sampling)
                times[name] += t
                live[name] = min(live[name], still)
                run_median[name] = statistics.median(t)
            for name in ratios:
                ratios[name].append(run_median[name] / run_median["none"])
            log(f"{sampling_name} run {run}: " + ", ".join(f"{n} {m:.1f} ms" for n, m in run_median.items()))
        for name, k in cases:
            rows.append({"sampling": sampling_name, "constrained": f"{k}/{BATCH}",
                         "step_ms_p50": statistics.median(times[name]),
                         "step_ms_p90": sorted(times[name])[int(0.9 * (len(times[name]) - 1))],
                         "ratio_vs_none": statistics.median(ratios[name]),
                         "constrained_live_at_end": live[name], "steps": len(times[name])})
    mask, off_step = mask_ms(engine)
    log(f"mask work of one step of {BATCH} constrained sessions: {mask:.3f} ms in the step, {off_step:.3f} ms "
        "computing the masks off it")
    print_table(rows, ["sampling", "constrained", ("step_ms_p50", "step ms p50"), ("step_ms_p90", "p90"),
                       ("ratio_vs_none", "x none"), ("constrained_live_at_end", "live"), "steps"])
    name = "constrained" if args.device == "cpu" else f"constrained_{args.device}"
    write_json(OUT_DIR / f"{name}.json", {"machine": machine_info(args.device), "args": vars(args), "rows": rows,
                                               "mask_ms_per_step_of_8": mask, "mask_compute_ms_of_8": off_step})
    x = [0, BATCH // 2, BATCH]
    plot_lines(OUT_DIR / f"{name}.png", x,
               {s: [r["step_ms_p50"] for r in rows if r["sampling"] == s] for s in ("greedy", "sampled")},
               f"constrained sessions of {BATCH}", "decode step ms (p50)",
               title="Constrained decode: batch of 8, JSON schema masks")
    engine.close()


if __name__ == "__main__":
    main()
