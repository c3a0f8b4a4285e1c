"""Namespace: the caller's handle on the orchestrator, bound to one namespace (a tenant, an application).

`orch.namespace("acme")` returns one; the Orchestrator itself is the handle of namespace "default".
A handle exposes every session and capsule verb (open, restore, fork, restore_append_generate,
generate, capsules, promote, demote, delete, migrate; the schedulers best_of_n, tree_search and
EpisodeDriver accept a handle wherever they accept the orchestrator). Capsules live in the handle's
namespace: sessions opened through it snapshot into it, and it cannot list, restore, fork, promote,
demote or delete another namespace's capsules: names are looked up in its own namespace only (a name
of another namespace is UnknownCapsuleError), every worker call carries the namespace, and a name is
never a path (validate_name refuses '/', '..' and the like; disk file names are a hash of namespace and
name, so guessing a file name gets you an unknown capsule name, nothing more).

A handle has no lifecycle verbs (close, stats, health, namespace): those are the operator's, on the
Orchestrator.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from capsulert.errors import InvalidRequestError
from capsulert.orchestrator.orchestrator_config import int_arg, name_arg, sampling_arg, samplings_arg, tokens_arg
from capsulert.orchestrator.router import CapsuleRouter, _Space
from capsulert.orchestrator.remote_session import RemoteSession

if TYPE_CHECKING:
    from capsulert.orchestrator.orchestrator import Orchestrator


class Namespace(CapsuleRouter):
    def __init__(self, orch: "Orchestrator", ns: str):
        self._orch, self.ns = orch, ns
        self._space = orch._spaces.setdefault(ns, _Space())

    def __repr__(self) -> str:
        return f"Namespace({self.ns!r})"

    # plumbing used by the schedulers and sessions (delegated to the orchestrator)
    async def _call(self, w: int, method: str, *args, timeout: float | None = None, **kwargs):
        return await self._orch._call(w, method, *args, timeout=timeout, **kwargs)

    def _session(self, w: int, res: dict) -> RemoteSession:
        s = RemoteSession(self, w, res["sid"], res["len"])
        self._orch._register(s)
        return s

    # ------------------------------------------------------------------ verbs
    async def open(self, prompt=None, *, worker: int | None = None) -> RemoteSession:
        """A new session (on the least loaded worker), prefilled with `prompt` when given. Its snapshots
        go into this namespace."""
        prompt = None if prompt is None else tokens_arg(prompt, "prompt")
        n = len(self._orch.workers)
        w = self._least_loaded(range(n)) if worker is None else self._worker_arg(worker)
        return self._session(w, await self._orch._call(w, "open", prompt))

    async def restore(self, name: str) -> RemoteSession:
        """A new session holding capsule `name`, on a worker that has it."""
        name = name_arg(name)
        w = self._least_loaded(self._holders(name))
        return self._session(w, await self._orch._call(w, "restore", name, namespace=self.ns))

    async def fork(self, name: str, n: int) -> list[RemoteSession]:
        """n independent sessions from capsule `name` (on one worker, so they can decode batched)."""
        name, n = name_arg(name), int_arg(n, "n", 1)
        w = self._least_loaded(self._holders(name))
        return [self._session(w, r) for r in await self._orch._call(w, "fork", name, n, namespace=self.ns)]

    async def fork_spread(self, name: str, n: int) -> list[RemoteSession]:
        """n sessions from capsule `name`, spread evenly over every live worker (the capsule is copied to a
        worker that lacks it, once): RL envs, independent agents that need not decode together."""
        name, n = name_arg(name), int_arg(n, "n", 1)
        self._holders(name)
        alive = [w.index for w in self._orch.workers if w.lost is None]
        share = {w: n // len(alive) + (i < n % len(alive)) for i, w in enumerate(alive)}
        share = {w: k for w, k in share.items() if k}
        await asyncio.gather(*(self._ensure_on(name, w) for w in share))
        groups = await asyncio.gather(*(self._orch._call(w, "fork", name, k, namespace=self.ns)
                                        for w, k in share.items()))
        return [self._session(w, r) for w, rows in zip(share, groups) for r in rows]

    async def restore_append_generate(self, name: str, suffix, max_new_tokens: int, sampling=None, *,
                                      keep: bool = False, timeout: float | None = None):
        """restore + append + generate in one actor call. Returns the tokens, or (session, tokens) with keep=True."""
        name, n = name_arg(name), int_arg(max_new_tokens, "max_new_tokens", 0)
        suffix = None if suffix is None else tokens_arg(suffix, "suffix")
        sp = sampling_arg(sampling)
        w = self._least_loaded(self._holders(name))
        res = await self._orch._call(w, "restore_append_generate", name, suffix, n, sp, close=not keep,
                                     timeout=timeout, namespace=self.ns)
        if not keep:
            return res["tokens"]
        s = self._session(w, res)
        s.stop_reason = res["stop_reason"]
        return s, res["tokens"]

    async def generate(self, sessions: list[RemoteSession], max_new_tokens: int, sampling=None) -> list:
        """Generate for several sessions at once: each is its own request, and each worker's step scheduler
        decodes its share together (workers run concurrently). One GenerateResult per session."""
        n = int_arg(max_new_tokens, "max_new_tokens", 0)
        sessions = list(sessions)
        sps = samplings_arg(sampling, len(sessions))
        if len({id(s) for s in sessions}) != len(sessions):
            raise InvalidRequestError("a session appears twice in one generate call")
        for s in sessions:
            s._check()
            if s._orch is not self._orch:
                raise InvalidRequestError(f"{s!r} belongs to another orchestrator")
        return list(await asyncio.gather(*(s.generate(n, sp) for s, sp in zip(sessions, sps))))

    async def _branch(self, name: str, suffixes: list, max_new_tokens: int, samplings: list,
                      snapshot_names: list[str] | None = None) -> list[dict]:
        """fork len(suffixes) + append + batched generate (+ snapshot each) + close: one actor call."""
        names = [name_arg(nm) for nm in snapshot_names or []]
        w = self._least_loaded(self._holders(name))
        if not names:
            return await self._orch._call(w, "fork_append_generate", name, suffixes, max_new_tokens, samplings,
                                          None, True, True, namespace=self.ns)
        async with self._space.locks.hold(*names):
            for nm in names:
                self._check_new_name(nm)
            res = await self._orch._call(w, "fork_append_generate", name, suffixes, max_new_tokens, samplings,
                                         names, True, True, namespace=self.ns)
            for nm in names:
                self._add_holder(nm, w)
        return res

    async def tokenize(self, text: str) -> list[int]:
        return await self._orch._call(0, "tokenize", tokens_arg(text, "text"))

    async def detokenize(self, tokens: list[int]) -> str:
        return await self._orch._call(0, "detokenize", list(tokens))
