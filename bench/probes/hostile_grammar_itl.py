"""Another tenant's inter-token latency while hostile grammars arrive (the step scheduler, in process, the
default model on the CPU): one session streams unconstrained tokens; meanwhile other sessions ask for
generates under `(a{1000}){1000}` (refused past the first-mask budget), a `choice` of 1,900 strings and a deep-but-legal
schema, one after another.

    python bench/probes/hostile_grammar_itl.py [--tokens 200]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time


async def run(tokens: int) -> None:
    import torch

    torch.set_num_threads(1)
    from capsulert.engine.engine import Engine
    from capsulert.errors import CapsuleRTError
    from capsulert.protocol.constraint import Constraint
    from capsulert.protocol.results import TokenEvent
    from capsulert.protocol.sampling import SamplingParams
    from capsulert.sessions.local import AsyncEngine

    eng = Engine.from_config(dict(model="default", device="cpu", slots=4, max_seq=1024, prefill_chunk=128))
    async with AsyncEngine(eng) as aeng:
        async def itl() -> list[float]:
            s = await aeng.open(list(range(1, 65)))
            gaps, last = [], None
            async for ev in s.stream(tokens, SamplingParams(ignore_eos=True)):
                now = time.perf_counter()
                if isinstance(ev, TokenEvent):
                    if last is not None:
                        gaps.append(now - last)
                    last = now
            await s.close()
            return gaps

        quiet = await itl()
        hostile = [Constraint(regex="(a{1000}){1000}"),
                   Constraint(grammar="start: " + " | ".join(json.dumps(f"option {i}") for i in range(1900))),
                   Constraint(json_schema={"type": "object", "properties": {f"k{i}": {"type": "string"}
                                                                           for i in range(300)}})]
        outcomes = []

        async def attack():
            i = 0
            while True:
                c = hostile[i % len(hostile)]
                i += 1
                s = await aeng.open([5, 6, 7])
                t0 = time.perf_counter()
                try:
                    await s.generate(8, SamplingParams(constraint=c))
                    outcomes.append(("served", time.perf_counter() - t0))
                except CapsuleRTError as e:
                    outcomes.append((type(e).__name__, time.perf_counter() - t0))
                await s.close()
        task = asyncio.ensure_future(attack())
        loud = await itl()
        task.cancel()
        for name, gaps in (("undisturbed", quiet), ("under hostile grammars", loud)):
            print(f"ITL {name}: median {statistics.median(gaps) * 1e3:.1f} ms, p99 "
                  f"{sorted(gaps)[int(len(gaps) * 0.99)] * 1e3:.1f} ms, max {max(gaps) * 1e3:.1f} ms")
        kinds = {}
        for k, s in outcomes:
            kinds.setdefault(k, []).append(s)
        print("hostile generates: " + ", ".join(f"{k}: {len(v)} (median {statistics.median(v):.2f} s)"
                                                for k, v in kinds.items()))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=200)
    asyncio.run(run(ap.parse_args().tokens))
