"""AsyncEngine: the in-process async API over the step scheduler, and LocalSender, its sessions' sender.

    async with AsyncEngine(Engine.from_config(model="default")) as aeng:
        s = await aeng.open("A long system prompt ...")
        result = await s.generate(64, SamplingParams(temperature=0.8, seed=1, stop=["\\n\\n"]))
        async for event in s.stream(64):          # TokenEvent per token, then one FinalEvent
            ...

Independent tasks calling it share decode steps: the scheduler batches every running generate, so the
caller never batches by hand. Each verb is a typed request (protocol/requests.py) handed to the scheduler;
the sessions are the AsyncSession of sessions/session.py, the same class the orchestrator hands out.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncGenerator

from capsulert.chat.turn import ChatReply
from capsulert.engine.engine import Engine
from capsulert.errors import InvalidRequestError, SessionClosedError
from capsulert.protocol.requests import (
    CONTROL, Detokenize, Fork, Generate, Interrupt, Open, ReadTokens, Request, Restore, Turn)
from capsulert.protocol.results import FinalEvent, SessionInfo, TokenEvent
from capsulert.sessions.sender import Sender
from capsulert.sessions.session import AsyncSession
from capsulert.scheduler.running_calls import RunningCalls
from capsulert.scheduler.step_scheduler import Sink, StepScheduler, queue_sink, stream_item


class AsyncEngine:
    def __init__(self, engine: Engine, max_queue: int | None = None, step_prefill_tokens: int | None = None):
        """max_queue and step_prefill_tokens override the engine config's (EngineConfig.scheduler)."""
        self.engine = engine
        self.scheduler = StepScheduler(engine, max_queue=max_queue, step_prefill_tokens=step_prefill_tokens)
        self.calls = RunningCalls(self.scheduler)  # running generates by call id: what an Interrupt names

    async def __aenter__(self) -> "AsyncEngine":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.scheduler.stop()

    def start(self, request: Request, call_id: Any = None) -> asyncio.Future:
        """Submit one session request; a future of its result (SessionInfo, GenerateResult, CapsuleRef,
        list, None). The call runs on whatever happens to the future; `call_id` names it for interrupts."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle(fn, value):
            if not fut.done():
                fn(value)
        sink = Sink(done=lambda v: loop.call_soon_threadsafe(settle, fut.set_result, v),
                    error=lambda e: loop.call_soon_threadsafe(settle, fut.set_exception, e))
        self.calls.track(call_id, self.scheduler.submit(request, sink))
        fut.add_done_callback(lambda _: self.calls.untrack(call_id))
        return fut

    async def submit(self, request: Request) -> Any:
        """Run one request; its result. Cancelling the caller stops a generate at its next token boundary,
        tokens committed."""
        call_id = object()
        fut = self.start(request, call_id)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            self.calls.interrupt(call_id)
            raise

    async def stream(self, request: Generate | Turn, call_id: Any = None) -> AsyncGenerator[TokenEvent | FinalEvent, None]:
        """TokenEvents as tokens are produced, then a FinalEvent. Closing or cancelling the iterator stops
        the generate at the next token boundary with the produced tokens committed."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        job = self.scheduler.submit(request, queue_sink(lambda item: loop.call_soon_threadsafe(queue.put_nowait, item)))
        self.calls.track(call_id, job)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                finished = item[0] != "event"
                yield stream_item(item)
        finally:
            if not finished:
                self.scheduler.cancel(job)
            self.calls.untrack(call_id)

    def control(self, request: Request) -> Any:
        """A control request answered at once, on the caller's thread (what a worker's control lane does)."""
        if isinstance(request, ReadTokens):
            return list(self.scheduler.session(request.session).tokens)
        if isinstance(request, Detokenize):
            return self.engine.detokenize(list(request.tokens))
        if isinstance(request, Interrupt):
            if request.call_id is not None:
                self.calls.interrupt(request.call_id)
            elif request.session is not None:
                self.calls.interrupt_session(request.session)
            try:
                return request.session is not None and self.scheduler.session(request.session) is not None
            except SessionClosedError:
                return False
        raise InvalidRequestError(f"an AsyncEngine answers no {type(request).__name__} request")

    # ------------------------------------------------------------------ opening verbs
    def sender(self, namespace: str | None = Open.namespace) -> "LocalSender":
        return LocalSender(self, namespace)

    async def open(self, prompt=None, namespace: str | None = Open.namespace) -> AsyncSession:
        """A new session, prefilled with `prompt` when given (from the longest cached prefix in `namespace`
        with EngineConfig.prefix_cache; None: no prefix reuse)."""
        request = Open(prompt, namespace)
        info: SessionInfo = await self.submit(request)
        return AsyncSession(self.sender(namespace), info.session, info.length)

    async def restore(self, name: str, namespace: str = Restore.namespace) -> AsyncSession:
        info: SessionInfo = await self.submit(Restore(name, namespace))
        return AsyncSession(self.sender(namespace), info.session, info.length, info.restored_from)

    async def fork(self, name: str, n: int, namespace: str = Fork.namespace) -> list[AsyncSession]:
        infos = await self.submit(Fork(name, n, namespace))
        return [AsyncSession(self.sender(namespace), i.session, i.length, i.restored_from) for i in infos]

    async def chat(self, messages, max_tokens: int | None = None, sampling=None, *,
                   namespace: str | None = Open.namespace, **chat_args) -> ChatReply:
        """One chat turn on a session of its own (Session.chat's arguments; the session is closed after)."""
        session = await self.open(namespace=namespace)
        try:
            return await session.chat(messages, max_tokens, sampling, **chat_args)
        finally:
            await session.close()


class LocalSender(Sender):
    """An AsyncEngine's sessions' sender: requests go to its step scheduler on this process. A session
    opened with namespace None (no prefix reuse) keeps its capsules in "default"."""

    def __init__(self, aeng: AsyncEngine, namespace: str | None):
        self.aeng = aeng
        self.namespace = namespace if namespace is not None else Restore.namespace

    async def call(self, request: Request, timeout: float | None = None) -> Any:
        if request.lane == CONTROL:
            return self.aeng.control(request)
        return await asyncio.wait_for(self.aeng.submit(request), timeout)

    async def start(self, request: Generate | Turn, call_id: int) -> asyncio.Future:
        return self.aeng.start(request, call_id)

    async def result(self, handle: asyncio.Future, request: Generate | Turn, timeout: float | None = None) -> Any:
        return await asyncio.wait_for(asyncio.shield(handle), timeout)

    def stream(self, request: Generate | Turn, call_id: int) -> AsyncGenerator[TokenEvent | FinalEvent, None]:
        return self.aeng.stream(request, call_id)

    def post(self, request: Request) -> None:
        self.aeng.control(request)

    def call_format(self) -> str:
        return self.aeng.engine.codec.chat.call_format
