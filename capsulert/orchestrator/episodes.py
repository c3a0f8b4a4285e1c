"""EpisodeDriver: RL rollouts against one start capsule C0.

n_envs sessions are forked from C0 once and reused: reset(i) restores C0 into env i's session in place
(no slot is taken or given back, no capsule is made), step(i, observation) appends the observation and
generates the action in one actor call. In run(), the envs' steps are gathered into batches: one actor
call restores (for an episode's first step), appends each env's observation and decodes all the envs
together, one batched decode step per token. Thousands of resets leave slot and capsule counts unchanged.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable

from capsulert.errors import InvalidRequestError
from capsulert.orchestrator.config import int_arg, name_arg, sampling_arg, tokens_arg
from capsulert.orchestrator.schedulers import _maybe_await
from capsulert.worker.sampler import SamplingParams

Sampling = SamplingParams | dict | None | Callable[[int, int], Any]


@dataclass
class Trajectory:
    episode: int
    env: int
    steps: list[tuple[Any, list[int]]] = field(default_factory=list)  # (observation, action tokens)


class EpisodeDriver:
    def __init__(self, orch, capsule: str, n_envs: int, max_new_tokens: int = 8, sampling: Sampling = None):
        self.orch, self.capsule = orch, name_arg(capsule)
        self.n_envs = int_arg(n_envs, "n_envs", 1)
        self.max_new_tokens = int_arg(max_new_tokens, "max_new_tokens", 0)
        self.sampling = sampling
        self.sessions: list = []
        self.resets = 0

    async def start(self) -> "EpisodeDriver":
        if not self.sessions:
            self.sessions = await self.orch.fork(self.capsule, self.n_envs)
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
        """Env i's session back to C0, in place."""
        await self._env(i).restore(self.capsule)
        self.resets += 1

    async def step(self, i: int, observation, max_new_tokens: int | None = None, sampling: Sampling = None) -> list[int]:
        """Append the observation to env i, generate the action tokens (one actor call)."""
        n = self.max_new_tokens if max_new_tokens is None else int_arg(max_new_tokens, "max_new_tokens", 0)
        return await self._env(i).append_generate(observation, n, self._sampling(sampling, 0, 0))

    async def run(self, policy_fn: Callable[[int, int, list[int] | None], Any], episodes: int,
                  max_steps: int = 16) -> list[Trajectory]:
        """Roll out `episodes` episodes over the n_envs envs concurrently.

        policy_fn(episode, step, last_action) -> the next observation (str or token ids), or None to
        end the episode (sync or async); last_action is None at step 0. The actions are the model's
        tokens, sampled with `sampling` (a SamplingParams/dict, or a callable(episode, step)).
        Returns trajectories in episode order."""
        episodes, max_steps = int_arg(episodes, "episodes", 0), int_arg(max_steps, "max_steps", 1)
        await self.start()
        batch = _StepBatcher(self.orch, self.sessions[0].worker, self.max_new_tokens)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for e in range(episodes):
            queue.put_nowait(e)
        out: dict[int, Trajectory] = {}

        async def env_loop(i: int) -> None:
            sess = self.sessions[i]
            while True:
                try:
                    ep = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                traj = out[ep] = Trajectory(ep, i)
                obs = await _maybe_await(policy_fn(ep, 0, None))
                if obs is None:
                    await self.reset(i)
                    continue
                action = await batch.submit(sess, self.capsule, tokens_arg(obs, "observation"), self._sampling(None, ep, 0))
                self.resets += 1
                for t in range(1, max_steps + 1):
                    traj.steps.append((obs, action))
                    if t == max_steps:
                        break
                    obs = await _maybe_await(policy_fn(ep, t, action))
                    if obs is None:
                        break
                    action = await batch.submit(sess, None, tokens_arg(obs, "observation"), self._sampling(None, ep, t))

        await asyncio.gather(*(env_loop(i) for i in range(self.n_envs)))
        return [out[e] for e in range(episodes)]


class _StepBatcher:
    """Gathers the steps the env loops submit while a batch is in flight into the next batch (one
    step_many actor call). The driver owns its sessions, so it bypasses their per-session locks."""

    def __init__(self, orch, worker: int, max_new_tokens: int):
        self.orch, self.worker, self.max_new = orch, worker, max_new_tokens
        self.pending: list = []
        self.draining = False

    async def submit(self, sess, restore: str | None, tokens, sampling: dict | None) -> list[int]:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((sess, restore, tokens, sampling, fut))
        if not self.draining:
            self.draining = True
            asyncio.ensure_future(self._drain())
        return await fut

    async def _drain(self) -> None:
        try:
            await asyncio.sleep(0)  # let every env that is ready enqueue its step
            while self.pending:
                batch, self.pending = self.pending, []
                try:
                    res = await self.orch._call(self.worker, "step_many", [(b[0].sid, b[1], b[2]) for b in batch],
                                                self.max_new, [b[3] for b in batch], namespace=self.orch.ns)
                except BaseException as e:  # noqa: BLE001 - handed to every waiter
                    for b in batch:
                        if not b[4].done():
                            b[4].set_exception(e)
                    continue
                for b, r in zip(batch, res):
                    b[0]._take(r)
                    if not b[4].done():
                        b[4].set_result(r["tokens"])
                await asyncio.sleep(0)
        finally:
            self.draining = False
