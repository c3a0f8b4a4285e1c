"""Namespace: the caller's handle on the orchestrator, bound to one namespace (a tenant, an application).

`orch.namespace("acme")` returns one; the Orchestrator passes its own session and capsule verbs to its
handle of namespace "default" (`orch.open(...)` is `orch.namespace("default").open(...)`).
A handle exposes every session and capsule verb (open, restore, fork, restore_append_generate,
restore_append_stream, generate, capsules, promote, demote, delete, migrate; the schedulers best_of_n, tree_search and
EpisodeDriver accept a handle wherever they accept the orchestrator). Capsules live in the handle's
namespace: sessions opened through it snapshot into it, and it cannot list, restore, fork, promote,
demote or delete another namespace's capsules: names are looked up in its own namespace only (a name
of another namespace is UnknownCapsuleError), every request carries the namespace, and a name is
never a path (validate_name refuses '/', '..' and the like; disk file names are a hash of namespace and
name, so guessing a file name gets you an unknown capsule name, nothing more).

Every verb is one typed request (protocol/requests.py) to one worker; the sessions it hands out are the one
session class (sessions/session.py) with a RemoteSender. A handle holds its capsule router (router.py) and
passes the capsule verbs on to it. A handle has no lifecycle verbs (close, stats, health, namespace): those
are the operator's, on the Orchestrator.
"""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import AsyncIterator

from capsulert.errors import InvalidRequestError, SessionClosedError, UnknownCapsuleError
from capsulert.orchestrator.capsule_map import CapsuleMap
from capsulert.orchestrator.router import CapsuleRouter
from capsulert.orchestrator.worker_pool import WorkerPool
from capsulert.protocol.checks import int_arg, samplings_arg, tokens_arg
from capsulert.protocol.requests import Detokenize, Fork, Interrupt, Open, Restore, Tokenize, Turn
from capsulert.protocol.results import FinalEvent, GenerateResult, SessionInfo, TokenEvent
from capsulert.orchestrator.remote_sender import RemoteSender
from capsulert.sessions.session import AsyncSession
from capsulert.sessions.sender import next_call_id


class Namespace:
    def __init__(self, pool: WorkerPool, capsule_map: CapsuleMap, ns: str):
        self.pool, self.ns = pool, ns
        self.router = CapsuleRouter(pool, capsule_map.space(ns), ns)  # its capsule verbs and their view

    def __repr__(self) -> str:
        return f"Namespace({self.ns!r})"

    def _session(self, w: int, info: SessionInfo | GenerateResult) -> AsyncSession:
        return AsyncSession(RemoteSender(self.pool, self.router, w), info.session, info.length, info.restored_from)

    def admitted(self, sessions: int, *, together: int = 1):
        """An async context manager holding `sessions` session slots of the orchestrator for its body: a
        request that will open that many sessions at once reserves them here first (in the admission queue:
        first come first served, round robin across namespaces, bounded), so requests never hold part of
        what they need while waiting for the rest. Refused at once: more than the workers have in all, or
        `together` (sessions one worker must hold at once: a fork's n) more than one worker has
        (ExceedsCapacityError); a full queue (QueueFullError with retry_after_s). See admission.py."""
        sessions, together = int_arg(sessions, "sessions", 1), int_arg(together, "together", 1)
        return self.pool.gate.reserve(sessions, self.ns, together=together)

    # ------------------------------------------------------------------ verbs
    async def open(self, prompt=None, *, worker: int | None = None) -> AsyncSession:
        """A new session (on the least loaded worker), prefilled with `prompt` when given. Its snapshots
        go into this namespace, and with the worker's prefix cache on, its prompt is served from (and its
        grid checkpoints kept for) this namespace's cached prefixes."""
        request = Open(prompt, self.ns)
        w = self.pool.least_loaded(range(len(self.pool))) if worker is None else self.pool.worker_arg(worker)
        return self._session(w, await self.pool.call(w, request))

    async def restore(self, name: str) -> AsyncSession:
        """A new session holding capsule `name`, on a worker that has it."""
        request = Restore(name, self.ns)
        return self._session(*await self.router.on_holder(name, lambda w: self.pool.call(w, request)))

    async def fork(self, name: str, n: int) -> list[AsyncSession]:
        """n independent sessions from capsule `name` (on one worker, so they can decode batched)."""
        request = Fork(name, n, self.ns)
        w, infos = await self.router.on_holder(name, lambda w: self.pool.call(w, request))
        return [self._session(w, i) for i in infos]

    async def fork_spread(self, name: str, n: int) -> list[AsyncSession]:
        """n sessions from capsule `name`, spread evenly over every live worker (the capsule is copied to a
        worker that lacks it, once): RL envs, independent agents that need not decode together."""
        Fork(name, n, self.ns)  # checks the arguments before anything moves
        self.router.holders(name)
        alive = self.pool.alive()
        share = {w: n // len(alive) + (i < n % len(alive)) for i, w in enumerate(alive)}
        share = {w: k for w, k in share.items() if k}
        await asyncio.gather(*(self.router.ensure_on(name, w) for w in share))
        groups = await asyncio.gather(*(self.pool.call(w, Fork(name, k, self.ns)) for w, k in share.items()))
        return [self._session(w, i) for w, infos in zip(share, groups) for i in infos]

    async def restore_append_generate(self, name: str, suffix, max_new_tokens: int, sampling=None, *,
                                      timeout: float | None = None) -> GenerateResult:
        """Restore capsule `name` into a NEW session (on a worker holding it), append `suffix` (None:
        nothing) and generate: one Turn request, the same verb as AsyncSession.restore_append_generate
        (which rolls an existing session back in place instead), with the same GenerateResult. The new
        session is closed afterwards (restore_branch keeps it)."""
        w, res = await self._turn(name, suffix, max_new_tokens, sampling, keep=False, timeout=timeout)
        return res

    async def restore_branch(self, name: str, suffix, max_new_tokens: int, sampling=None, *,
                             timeout: float | None = None) -> tuple[AsyncSession, GenerateResult]:
        """restore_append_generate() that keeps the new session open: (the session, its GenerateResult), in
        one request (a tree search's node: restore the parent, append, generate, snapshot the child)."""
        w, res = await self._turn(name, suffix, max_new_tokens, sampling, keep=True, timeout=timeout)
        s = self._session(w, res)
        s.stop_reason = res.stop_reason
        return s, res

    async def append_generate(self, prompt, max_new_tokens: int, sampling=None, *,
                              timeout: float | None = None) -> GenerateResult:
        """A new session (on the least loaded worker), `prompt` appended, a generate, the session closed:
        one Turn request, so one round trip to the worker (an HTTP completion from no capsule)."""
        w, res = await self._turn(None, prompt, max_new_tokens, sampling, keep=False, timeout=timeout)
        return res

    def append_stream(self, prompt, max_new_tokens: int, sampling=None) -> AsyncIterator[TokenEvent | FinalEvent]:
        """append_generate() as a stream, in one request (restore_append_stream's events and rules)."""
        return self._turn_stream(None, prompt, max_new_tokens, sampling)

    async def _worker_for(self, name: str | None, tried: set[int]) -> int:
        """Where a turn runs: a worker holding capsule `name` (but those `tried`), or the least loaded one for a
        new session."""
        if name is None:
            return self.pool.least_loaded(range(len(self.pool)))
        return await self.router.serving_worker(name, tried)

    async def _turn(self, name: str | None, suffix, max_new_tokens: int, sampling, keep: bool,
                    timeout: float | None) -> tuple[int, GenerateResult]:
        request = self._restore_turn(name, suffix, max_new_tokens, sampling, keep)

        async def run(w: int) -> GenerateResult:
            call_id = next_call_id()
            try:
                return await self.pool.call_through_feed(w, request, call_id, timeout=timeout)
            except asyncio.CancelledError:
                if not keep:  # the caller went away: its generate stops at the next token, its session is closed
                    self.pool.send(w, Interrupt(None, call_id))
                raise
        if name is not None:
            return await self.router.on_holder(name, run)
        w = await self._worker_for(None, set())
        return w, await run(w)

    async def restore_append_stream(self, name: str, suffix, max_new_tokens: int, sampling=None
                                    ) -> AsyncIterator[TokenEvent | FinalEvent]:
        """restore_append_generate() as a stream, in one request: restore capsule `name` into a new session,
        append `suffix` and generate, yielding a TokenEvent per token and then a FinalEvent; the session is
        closed when the generate ends. Closing the iterator (or cancelling its consumer) stops the generate
        at the next token boundary. A refusal (no such capsule, a suffix past max_seq) is raised by the
        first step of the iteration."""
        async for event in self._turn_stream(name, suffix, max_new_tokens, sampling):
            yield event

    async def _turn_stream(self, name: str | None, suffix, max_new_tokens: int, sampling
                           ) -> AsyncIterator[TokenEvent | FinalEvent]:
        request = self._restore_turn(name, suffix, max_new_tokens, sampling, keep=False)
        tried: set[int] = set()
        while True:
            w = await self._worker_for(name, tried)
            await self.pool.check(w)
            started = False
            try:
                # closing this closes the pool's stream at once, which interrupts an unfinished generate
                async with aclosing(self.pool.stream(w, request, next_call_id())) as events:
                    async for event in events:
                        started = True
                        yield event
                return
            except UnknownCapsuleError:  # a refusal comes before any event: nothing was streamed yet
                tried.add(w)  # as router.on_holder passes a holder over
                if started or name is None or not self.router.held_elsewhere(name, tried):
                    raise

    def _restore_turn(self, name: str | None, suffix, max_new_tokens: int, sampling, keep: bool) -> Turn:
        """The Turn that restores `name` into a new session (None: opens an empty one), appends and generates
        (it checks itself)."""
        return Turn(None, name, suffix, max_new_tokens, sampling, self.ns, close=not keep)

    async def generate(self, sessions: list[AsyncSession], max_new_tokens: int, sampling=None) -> list:
        """Generate for several sessions at once: each is its own request, and each worker's step scheduler
        decodes its share together (workers run concurrently). One GenerateResult per session."""
        n = int_arg(max_new_tokens, "max_new_tokens", 0)
        sessions = list(sessions)
        sps = samplings_arg(sampling, len(sessions))
        if len({id(s) for s in sessions}) != len(sessions):
            raise InvalidRequestError("a session appears twice in one generate call")
        for s in sessions:
            if s.closed:
                raise SessionClosedError(f"session {s.sid} is closed; open or restore a new one")
            if getattr(s.sender, "pool", None) is not self.pool:
                raise InvalidRequestError(f"{s!r} belongs to another orchestrator")
        return list(await asyncio.gather(*(s.generate(n, sp) for s, sp in zip(sessions, sps))))

    async def tokenize(self, text: str) -> list[int]:
        text = tokens_arg(text, "text")
        return await self.pool.call(self.pool.least_loaded(range(len(self.pool))), Tokenize(text))

    async def detokenize(self, tokens: list[int]) -> str:
        return await self.pool.call(self.pool.least_loaded(range(len(self.pool))), Detokenize(list(tokens)))

    # ------------------------------------------------------------------ capsule verbs
    # the router's (router.py documents each): a handle passes them on, so one object owns the view
    def holders(self, name: str) -> set[int]:
        return self.router.holders(name)

    def placement(self) -> dict[str, set[int]]:
        return self.router.placement()

    @property
    def space(self):
        """This namespace's part of the capsule map (the router's view)."""
        return self.router.space

    async def migrate(self, name: str, worker: int, *, via: str = "auto", directory: str | None = None,
                      tier: str = "device") -> str | None:
        return await self.router.migrate(name, worker, via=via, directory=directory, tier=tier)

    async def capsules(self) -> list[dict]:
        return await self.router.capsules()

    async def promote(self, name: str, tier: str) -> None:
        await self.router.promote(name, tier)

    async def demote(self, name: str, tier: str | None = None) -> None:
        await self.router.demote(name, tier)

    async def rebuild(self, name: str) -> None:
        await self.router.rebuild(name)

    async def delete(self, name: str) -> None:
        await self.router.delete(name)
