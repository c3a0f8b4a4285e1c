"""RemoteSender: how the sessions a Namespace hands out send their requests, to the one worker (a Ray
WorkerActor) of the orchestrator's pool that holds them. The sessions are the one session class
(sessions/session.py: AsyncSession), holding this sender.

A request travels as it is (a typed request, protocol/requests.py) through the pool (worker_pool.py),
which turns every failure into a typed error: a dead or silent worker is WorkerLost within the timeout. A
capsule a session restores is first copied to the session's worker when it lives elsewhere, and a
snapshot holds the router's lock on its name (router.py).
"""
from __future__ import annotations

from contextlib import aclosing
from typing import TYPE_CHECKING, Any, AsyncGenerator

from capsulert.protocol.requests import Generate, Request, Turn
from capsulert.protocol.results import FinalEvent, GenerateResult, TokenEvent
from capsulert.sessions.sender import Sender, next_call_id
from capsulert.sessions.session import AsyncSession

if TYPE_CHECKING:
    from capsulert.orchestrator.router import CapsuleRouter
    from capsulert.orchestrator.worker_pool import WorkerPool

class RemoteSender(Sender):
    def __init__(self, pool: "WorkerPool", router: "CapsuleRouter", worker: int):
        self.pool, self.router, self.worker = pool, router, worker
        self.namespace = router.ns
        # the worker process holding the sessions, as the orchestrator knew it when they were made
        self.pid = pool.workers[worker].pid

    async def call(self, request: Request, timeout: float | None = None) -> Any:
        return await self.pool.call(self.worker, request, timeout=timeout)

    async def start(self, request: Generate | Turn, call_id: int) -> Any:
        # through the event feed, in one Batch with the generates and turns started at the same moment
        return await self.pool.start_through_feed(self.worker, request, call_id)

    async def result(self, handle: Any, request: Generate | Turn, timeout: float | None = None) -> Any:
        return await self.pool.reply(self.worker, handle, request, timeout)

    async def stream(self, request: Generate | Turn, call_id: int) -> AsyncGenerator[TokenEvent | FinalEvent, None]:
        await self.pool.check(self.worker)
        # closing this closes the pool's stream at once, which interrupts an unfinished generate
        async with aclosing(self.pool.stream(self.worker, request, call_id)) as events:
            async for event in events:
                yield event

    def post(self, request: Request) -> None:
        self.pool.send(self.worker, request)

    def call_format(self) -> str:
        return self.pool.workers[self.worker].call_format

    def check(self) -> None:
        self.pool.check_session(self.worker, self.pid)

    async def placing(self, name: str) -> None:
        await self.router.ensure_on(name, self.worker)

    def making(self, name: str):
        return self.router.new_capsules([name], self.worker)

    def opened(self, session: AsyncSession) -> None:
        self.pool.opened(session)

    def closed(self, session: AsyncSession) -> None:
        self.pool.closed_session(session)


__all__ = ["GenerateResult", "RemoteSender", "next_call_id"]
