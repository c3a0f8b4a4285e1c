"""Tree-of-thought as a beam search over capsules: every node is a capsule (snapshot after each
thought), children are forked from it and decoded together, and the capsules of nodes that fall out of
the beam are deleted as it moves on.

    .venv/bin/python examples/tree_of_thought.py [--width 2] [--depth 3] [--model DIR]
"""
import argparse
import asyncio
import time

from capsulert.model_notice import random_weights_notice
from capsulert.orchestrator import Orchestrator, Thought, tree_search
from capsulert.protocol.sampling import SamplingParams

PROBLEM = ("Plan how to fix a failing test in a large repository. The capsule runtime keeps the complete "
           "state of a session, so each step of the plan can branch and come back. ") * 2
STEPS = [" First, read", " Next, check", " Then, try"]


async def main(width: int, depth: int, model: str = "default") -> None:
    notice = random_weights_notice(model)
    if notice:
        print(f"note: {notice}")
    t0 = time.perf_counter()
    async with await Orchestrator.start(dict(engine=dict(model=model, device="cpu", slots=16, max_seq=2048), local_num_cpus=2)) as orch:
        s = await orch.open(PROBLEM)
        await s.snapshot("problem")
        await s.close()
        base = len((await orch.capsules()))
        expanded = 0

        def expand(node):  # three thought openings per node, sampled with seeds that depend on the node
            nonlocal expanded
            expanded += 1
            return [Thought(o, SamplingParams(temperature=0.8, seed=node.depth * 10 + i)) for i, o in enumerate(STEPS)]

        async def score(node):  # a stand-in for a value model: reward varied tokens
            return len(set(node.tokens)) + (sum(node.tokens) % 97) / 100

        t = time.perf_counter()
        beam = await tree_search(orch, "problem", expand, score, width=width, depth=depth, max_new_tokens=12)
        dt = time.perf_counter() - t
        print(f"tree search width={width} depth={depth}: {expanded} nodes expanded, "
              f"{expanded * len(STEPS)} thoughts in {dt:.2f}s")
        for rank, node in enumerate(beam):
            texts = [await orch.detokenize(t) for t in node.thoughts]
            print(f"  #{rank + 1} score {node.score:.2f}: " + " | ".join(f"{n.suffix}{x}" for n, x in zip(node.path, texts)))
        print(f"capsules before {base}, after {len(await orch.capsules())} (node capsules were released)")
    print(f"total {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=2)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--model", default="default", help="a Qwen3.5 checkpoint directory (default: the embedded "
                    "model, random weights)")
    a = ap.parse_args()
    asyncio.run(main(a.width, a.depth, a.model))
