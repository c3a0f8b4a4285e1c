"""RL rollouts with episode resets against a start capsule C0: reset = restore C0 in place, step =
append the observation + generate the action (reset + first step are one actor call).

    .venv/bin/python examples/rl_rollout.py [--envs 4] [--episodes 100] [--resets 2000] [--model DIR]
"""
import argparse
import asyncio
import time

from capsulert.model_notice import random_weights_notice
from capsulert.orchestrator import EpisodeDriver, Orchestrator
from capsulert.protocol.sampling import SamplingParams

C0 = "You control a robot in a grid world. Each observation says where the goal is; answer with a move. " * 3


def env(episode: int, step: int, action):
    """A toy environment: 2 observations per episode; the reward is computed from the actions below."""
    return None if step == 2 else f" Goal at {(episode * 7 + step) % 5},{episode % 3}. Move:"


async def main(envs: int, episodes: int, resets: int, model: str = "default") -> None:
    notice = random_weights_notice(model)
    if notice:
        print(f"note: {notice}")
    t0 = time.perf_counter()
    async with await Orchestrator.start(dict(engine=dict(model=model, device="cpu", slots=envs + 2, max_seq=2048), local_num_cpus=2)) as orch:
        s = await orch.open(C0)
        await s.snapshot("c0", pin=True)
        await s.close()
        before = (await orch.stats())[0]
        async with EpisodeDriver(orch, "c0", n_envs=envs, max_new_tokens=4,
                                 sampling=lambda ep, step: SamplingParams(temperature=1.0, seed=ep * 10 + step)) as drv:
            t = time.perf_counter()
            trajs = await drv.run(env, episodes)
            dt = time.perf_counter() - t
            steps = sum(len(tr.steps) for tr in trajs)
            rewards = [sum(a[0] % 4 == 0 for _, a in tr.steps) for tr in trajs]
            print(f"{episodes} episodes / {steps} steps over {envs} envs in {dt:.2f}s "
                  f"({steps / dt:.0f} steps/s); mean reward {sum(rewards) / len(rewards):.2f}")
            t = time.perf_counter()
            for i in range(resets):
                await drv.reset(i % envs)
            dt = time.perf_counter() - t
            print(f"{resets} resets in {dt:.2f}s: {resets / dt:.0f} resets/s ({dt / resets * 1e3:.2f} ms each)")
        after = (await orch.stats())[0]
        print(f"slots free before/after: {before['free_slots']}/{after['free_slots']}, "
              f"capsules before/after: {before['capsules']}/{after['capsules']}")
    print(f"total {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--envs", type=int, default=4)
    ap.add_argument("--episodes", type=int, default=100)
    ap.add_argument("--resets", type=int, default=2000)
    ap.add_argument("--model", default="default", help="a Qwen3.5 checkpoint directory (default: the embedded "
                    "model, random weights)")
    a = ap.parse_args()
    asyncio.run(main(a.envs, a.episodes, a.resets, a.model))
