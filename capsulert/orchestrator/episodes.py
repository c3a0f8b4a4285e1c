"""EpisodeDriver: RL rollouts against one start capsule C0.

n_envs sessions are forked from C0 once, spread over every worker (C0 is copied to each once), and
reused: reset(i) restores C0 into env i's session in place (no slot is taken or given back, no capsule is
made), step(i, observation) appends the observation and generates the action in one request (a Turn).
Each env submits its own requests (an episode's first step also restores C0); the worker's step
scheduler batches the envs' decodes, one batched step per token, without the driver batching anything. Thousands of resets leave slot and capsule counts unchanged.

The sampling callable gets the real (episode, step); an action is a GenerateResult: the tokens, with
their logprobs under the raw model distribution and the stop reason.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable

from capsulert.errors import InvalidRequestError
from capsulert.protocol.checks import int_arg, name_arg, sampling_arg, tokens_arg
from capsulert.orchestrator.search import maybe_await
from capsulert.protocol.sampling import SamplingParams
from capsulert.protocol.results import GenerateResult

Sampling = SamplingParams | dict | None | Callable[[int, int], Any]


@dataclass
class Trajectory:
    episode: int
    env: int
    steps: list[tuple[Any, GenerateResult]] = field(default_factory=list)  # (observation, action)


class EpisodeDriver:
    def __init__(self, orch, capsule: str, n_envs: int, max_new_tokens: int = 8, sampling: Sampling = None):
        self.orch, self.capsule = orch, name_arg(capsule)
        self.n_envs = int_arg(n_envs, "n_envs", 1)
        self.max_new_tokens = int_arg(max_new_tokens, "max_new_tokens", 0)
        self.sampling = sampling
        self.sessions: list = []
        self.resets = 0
        self._episodes = 0  # episodes begun by reset()
        self._at: list[list[int]] = []  # per env: [episode, step] that step() samples for

    async def start(self) -> "EpisodeDriver":
        if not self.sessions:
            self.sessions = await self.orch.fork_spread(self.capsule, self.n_envs)
            self._at = [[-1, 0] for _ in range(self.n_envs)]
        return self

    async def close(self) -> None:
        sessions, self.sessions = self.sessions, []
        await asyncio.gather(*(s.close() for s in sessions))

    async def __aenter__(self) -> "EpisodeDriver":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _env(self, i: int):
        if not self.sessions:
            raise InvalidRequestError("EpisodeDriver is not started; await driver.start() or use `async with`")
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.n_envs:
            raise InvalidRequestError(f"env index must be an int in [0, {self.n_envs}), got {i!r}")
        return self.sessions[i]

    def _sampling(self, sampling: Sampling, episode: int, step: int) -> dict | None:
        sp = sampling if sampling is not None else self.sampling
        return sampling_arg(sp(episode, step) if callable(sp) else sp)

    async def reset(self, i: int) -> None:
        """Env i's session back to C0, in place; a new episode begins there."""
        await self._env(i).restore(self.capsule)
        self.resets += 1
        self._at[i] = [self._episodes, 0]
        self._episodes += 1

    async def step(self, i: int, observation, max_new_tokens: int | None = None,
                   sampling: Sampling = None) -> GenerateResult:
        """Append the observation to env i and generate the action (one request); a sampling callable gets
        env i's (episode, step)."""
        n = self.max_new_tokens if max_new_tokens is None else int_arg(max_new_tokens, "max_new_tokens", 0)
        sess = self._env(i)
        episode, t = self._at[i]
        self._at[i][1] += 1
        return await sess.turn(observation, n, self._sampling(sampling, episode, t))

    async def run(self, policy_fn: Callable[[int, int, list[int] | None], Any], episodes: int,
                  max_steps: int = 16) -> list[Trajectory]:
        """Roll out `episodes` episodes over the n_envs envs concurrently.

        policy_fn(episode, step, last_action) -> the next observation (str or token ids), or None to
        end the episode (sync or async); last_action is None at step 0. The actions are the model's
        tokens, sampled with `sampling` (a SamplingParams/dict, or a callable(episode, step)).
        Returns trajectories in episode order."""
        episodes, max_steps = int_arg(episodes, "episodes", 0), int_arg(max_steps, "max_steps", 1)
        await self.start()
        queue: asyncio.Queue[int] = asyncio.Queue()
        for e in range(episodes):
            queue.put_nowait(e)
        out: dict[int, Trajectory] = {}
        n = self.max_new_tokens

        async def env_loop(i: int) -> None:
            sess = self.sessions[i]
            while True:
                try:
                    ep = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                traj = out[ep] = Trajectory(ep, i)
                obs = await maybe_await(policy_fn(ep, 0, None))
                if obs is None:
                    await self.reset(i)
                    continue
                # the episode's first step restores C0 in the same request (an in-place reset)
                action = await sess.turn(tokens_arg(obs, "observation"), n, self._sampling(None, ep, 0),
                                         restore=self.capsule)
                self.resets += 1
                for t in range(1, max_steps + 1):
                    traj.steps.append((obs, action))
                    if t == max_steps:
                        break
                    obs = await maybe_await(policy_fn(ep, t, action))
                    if obs is None:
                        break
                    action = await sess.turn(tokens_arg(obs, "observation"), n, self._sampling(None, ep, t))

        await asyncio.gather(*(env_loop(i) for i in range(self.n_envs)))
        return [out[e] for e in range(episodes)]
