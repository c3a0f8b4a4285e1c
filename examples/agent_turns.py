"""A coding-agent loop: the system prompt + repository context is prefilled once and pinned as a capsule;
each turn is restore + append(turn) + generate in one actor call, instead of re-prefilling everything.

    .venv/bin/python examples/agent_turns.py [--turns 5] [--model DIR]
"""
import argparse
import asyncio
import time

from capsulert.model_notice import random_weights_notice
from capsulert.orchestrator import Orchestrator

SYSTEM = "You are a coding agent. Follow the repository conventions, keep changes small, and run the tests. "
REPO = ("File capsulert/engine/engine.py: the Engine owns the model, the state set and the slots; it runs "
        "prefill on a global chunk grid and decodes several slots at once. ") * 12
TURNS = [" User: why does the test fail?", " User: add a timeout to the call.", " User: rename the helper.",
         " User: explain the chunk grid.", " User: write a docstring."]


async def main(turns: int, model: str = "default") -> None:
    notice = random_weights_notice(model)
    if notice:
        print(f"note: {notice}")
    t0 = time.perf_counter()
    async with await Orchestrator.start(dict(engine=dict(model=model, device="cpu", slots=4, max_seq=4096), local_num_cpus=2)) as orch:
        t = time.perf_counter()
        s = await orch.open(SYSTEM + REPO)
        await s.snapshot("system+repo", pin=True)
        await s.close()
        print(f"prefilled and pinned the system+repo prefix ({s.length} tokens) in {time.perf_counter() - t:.2f}s")
        for i in range(turns):
            q = TURNS[i % len(TURNS)]
            t = time.perf_counter()
            first = await orch.restore_append_generate("system+repo", q, 1)
            ttft = time.perf_counter() - t
            t = time.perf_counter()
            reply = await orch.restore_append_generate("system+repo", q, 16)
            full = time.perf_counter() - t
            t = time.perf_counter()
            cold = await orch.open(SYSTEM + REPO + q)
            cold_first = await cold.generate(1)
            cold_ttft = time.perf_counter() - t
            await cold.close()
            assert cold_first == first == reply[:1]
            print(f"turn {i + 1}: TTFT {ttft * 1e3:.0f} ms from the capsule vs {cold_ttft * 1e3:.0f} ms cold "
                  f"({cold_ttft / ttft:.1f}x); 16 tokens in {full:.2f}s: {await orch.detokenize(reply)!r}")
    print(f"total {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--model", default="default", help="a Qwen3.5 checkpoint directory (default: the embedded "
                    "model, random weights)")
    a = ap.parse_args()
    asyncio.run(main(a.turns, a.model))
