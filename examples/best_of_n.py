"""Best-of-N through the orchestrator: one shared prompt as a capsule, N sampled continuations decoded
together in one actor call (fork + append + batched decode), ranked by a user score function.

    .venv/bin/python examples/best_of_n.py [--n 8] [--tokens 24] [--model DIR]
"""
import argparse
import asyncio
import time

from capsulert.model_notice import random_weights_notice
from capsulert.orchestrator import Orchestrator, best_of_n
from capsulert.protocol.sampling import SamplingParams

TASK = ("You are a careful engineer. The capsule runtime keeps the complete state of a session at a "
        "committed boundary, so an agent can return to a long shared context in milliseconds. ") * 3


async def main(n: int, tokens: int, model: str = "default") -> None:
    notice = random_weights_notice(model)
    if notice:
        print(f"note: {notice}")
    t0 = time.perf_counter()
    async with await Orchestrator.start(dict(engine=dict(model=model, device="cpu", slots=max(8, n + 1), max_seq=2048),
                                             local_num_cpus=2)) as orch:
        print(f"orchestrator up in {time.perf_counter() - t0:.1f}s")
        t = time.perf_counter()
        s = await orch.open(TASK)
        await s.snapshot("task", pin=True)
        await s.close()
        print(f"prefilled the task ({s.length} tokens) and snapshot it as capsule 'task' in {time.perf_counter() - t:.2f}s")

        def score(c):  # prefer varied, longer words: a stand-in for a verifier or a reward model
            words = (c.text or "").split()
            return len(set(words)) + sum(map(len, words)) / 100

        t = time.perf_counter()
        cands = await best_of_n(orch, "task", " Answer:", n, tokens, SamplingParams(temperature=0.9, top_p=0.95, seed=1), score)
        dt = time.perf_counter() - t
        print(f"best-of-{n}: {n} x {tokens} tokens in {dt:.2f}s ({n * tokens / dt:.0f} tokens/s, one actor call)")
        for rank, c in enumerate(cands[:3]):
            print(f"  #{rank + 1} candidate {c.index} score {c.score:.2f}: {c.text!r}")
        t = time.perf_counter()
        again = await best_of_n(orch, "task", " Answer:", n, tokens, SamplingParams(temperature=0.9, top_p=0.95, seed=1), score)
        print(f"same seeds again in {time.perf_counter() - t:.2f}s: identical = {[c.tokens for c in again] == [c.tokens for c in cands]}")
    print(f"total {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--model", default="default", help="a Qwen3.5 checkpoint directory (default: the embedded "
                    "model, random weights)")
    a = ap.parse_args()
    asyncio.run(main(a.n, a.tokens, a.model))
