"""Other tenants' decode while hostile grammars arrive (issue 46's target: their ITL and request latency
within 10% of undisturbed). The step scheduler in process (AsyncEngine), the default model on the CPU, one
torch thread: a victim session streams unconstrained tokens, request after request, while an attacker sends
generates under one hostile grammar after another, each Constraint made in a process of its own (as
`capsulert serve` builds a request's plan in its HTTP replica, not in the worker process that decodes). The cases, interleaved round by round so that a shared
machine's load hits them alike:

- undisturbed: no attacker;
- a `choice` of 100k strings, a 20,000-deep schema, a schema of shared subtrees (2^40 values written out):
  refused when the Constraint is made (size, depth and written-out checks), before llguidance sees them;
- `(a{1000}){1000}`: reaches the engine; its first mask (~1.5 s here) runs on the mask worker and the
  generate is refused past the per-mask budget (GrammarTooCostlyError);
- a `choice` of 15k strings (near the grammar size limit): compiles, but llguidance's parser refuses its first
  token (more items in a row than its limit): that generate alone fails (InvalidRequestError);
- a 300-key schema: legal, served, its masks computed off the step;
- same load, no grammar: the attacker's requests without a constraint (its prefill and its decode rows share
  the victim's steps: the load any tenant adds), the baseline of the served cases.

The attacker sends one request at a time, at most one per ATTACK_INTERVAL_S (in process, a refusal takes
microseconds, and a loop of them would measure the GIL, not the engine; over HTTP they land on the
replica's process).

    python bench/probes/hostile_grammar_itl.py [--tokens 64] [--requests 2] [--rounds 3]

Prints a table, writes bench/out/hostile_grammar_itl.json.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common import OUT_DIR, log, machine_info, percentile, print_table, write_json  # noqa: E402

ATTACK_INTERVAL_S = 0.1


@functools.lru_cache(maxsize=1)
def hostile_cases() -> dict:
    """name -> the keyword arguments of its Constraint (None: undisturbed)."""
    deep = cur = {}
    for _ in range(20000):
        cur["items"] = {}
        cur = cur["items"]
    shared: dict = {"type": "string"}
    for _ in range(40):
        shared = {"anyOf": [shared, shared]}
    return {
        "undisturbed": None,
        "same load, no grammar": {},
        "choice of 100k": dict(grammar="start: " + " | ".join(json.dumps(f"option {i}") for i in range(100_000))),
        "(a{1000}){1000}": dict(regex="(a{1000}){1000}"),
        "20,000-deep schema": dict(json_schema=deep),
        "shared subtrees (2^40)": dict(json_schema=shared),
        "choice of 15k": dict(grammar="start: " + " | ".join(json.dumps(f"opt {i}") for i in range(15_000))),
        "300-key schema (legal)": dict(json_schema={"type": "object", "properties": {
            f"k{i}": {"type": "string"} for i in range(300)}}),
    }


def make_constraint(name: str):
    """The case's Constraint, made in the edge process (or its typed refusal, raised)."""
    from capsulert.protocol.constraint import Constraint

    return Constraint(**hostile_cases()[name])


async def run(tokens: int, requests: int, rounds: int) -> None:
    import torch

    torch.set_num_threads(1)
    from capsulert.engine.engine import Engine
    from capsulert.errors import CapsuleRTError
    from capsulert.protocol.results import TokenEvent
    from capsulert.protocol.sampling import SamplingParams
    from capsulert.sessions.local import AsyncEngine

    eng = Engine.from_config(dict(model="default", device="cpu", slots=4, max_seq=1024, prefill_chunk=128))
    cases = hostile_cases()
    gaps: dict[str, list[float]] = {k: [] for k in cases}
    latency: dict[str, list[float]] = {k: [] for k in cases}
    outcomes: dict[str, list[tuple[str, float]]] = {k: [] for k in cases}
    victim_errors: dict[str, list[str]] = {k: [] for k in cases}
    edge = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    async with AsyncEngine(eng) as aeng:
        async def victim(name: str) -> None:
            s = await aeng.open(list(range(1, 65)))
            for _ in range(requests):
                t0 = last = time.perf_counter()
                first = True
                try:
                    async for ev in s.stream(tokens, SamplingParams(ignore_eos=True)):
                        now = time.perf_counter()
                        if isinstance(ev, TokenEvent):
                            if not first:
                                gaps[name].append(now - last)
                            first, last = False, now
                except Exception as e:  # noqa: BLE001 - the victim failing is what is measured here
                    victim_errors[name].append(type(e).__name__)
                    continue
                latency[name].append(time.perf_counter() - t0)
                await s.truncate(64)
            await s.close()

        async def attack(name: str, kwargs: dict) -> None:
            while True:
                t0 = time.perf_counter()
                try:
                    c = await asyncio.get_running_loop().run_in_executor(edge, make_constraint, name) \
                        if kwargs else None
                    s = await aeng.open([5, 6, 7])
                    try:
                        await s.generate(8, SamplingParams(constraint=c))
                    finally:
                        await s.close()
                    outcomes[name].append(("served", time.perf_counter() - t0))
                except CapsuleRTError as e:
                    outcomes[name].append((type(e).__name__, time.perf_counter() - t0))
                await asyncio.sleep(max(0.0, t0 + ATTACK_INTERVAL_S - time.perf_counter()))

        await asyncio.get_running_loop().run_in_executor(edge, make_constraint, "300-key schema (legal)")
        await victim("undisturbed")  # warm-up: kernels, the edge process, llguidance's tokenizer below
        gaps["undisturbed"].clear()
        latency["undisturbed"].clear()
        for r in range(rounds):
            for name, kwargs in cases.items():
                task = None if kwargs is None else asyncio.ensure_future(attack(name, kwargs))
                await asyncio.sleep(0.05 if task else 0)
                await victim(name)
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    await asyncio.sleep(2.0)  # a refused mask still running on the worker ends before the next case
            log(f"round {r} done")
    eng.close()
    edge.shutdown()
    base_itl, base_lat = statistics.median(gaps["undisturbed"]), statistics.median(latency["undisturbed"])
    rows = []
    for name in cases:
        kinds: dict[str, list[float]] = {}
        for k, s in outcomes[name]:
            kinds.setdefault(k, []).append(s)
        if not gaps[name] or not latency[name]:
            gaps[name], latency[name] = [float("nan")], [float("nan")]
        rows.append({"case": name, "itl_p50_ms": statistics.median(gaps[name]) * 1e3,
                     "itl_p99_ms": percentile(gaps[name], 99) * 1e3,
                     "itl_x": statistics.median(gaps[name]) / base_itl,
                     "request_p50_s": statistics.median(latency[name]),
                     "request_x": statistics.median(latency[name]) / base_lat,
                     "victim_errors": len(victim_errors[name]),
                     "attacker": ", ".join(f"{k} {len(v)} (p50 {statistics.median(v):.2f} s)" for k, v in kinds.items())
                     or "-"})
    print_table(rows, ["case", ("itl_p50_ms", "ITL p50 ms"), ("itl_p99_ms", "ITL p99 ms"), ("itl_x", "x undisturbed"),
                       ("request_p50_s", "request p50 s"), ("request_x", "x undisturbed"),
                       ("victim_errors", "victim errors"), ("attacker", "attacker's requests")])
    write_json(OUT_DIR / "hostile_grammar_itl.json", {"machine": machine_info("cpu"), "tokens": tokens,
                                                       "requests": requests, "rounds": rounds, "rows": rows})


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    asyncio.run(run(a.tokens, a.requests, a.rounds))
