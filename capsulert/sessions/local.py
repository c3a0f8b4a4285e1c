"""AsyncEngine: the in-process async API over the step scheduler.

    async with AsyncEngine(Engine.from_config(model="default")) as aeng:
        s = await aeng.open("A long system prompt ...")
        result = await s.generate(64, SamplingParams(temperature=0.8, seed=1, stop=["\\n\\n"]))
        async for event in s.stream(64):          # TokenEvent per token, then one FinalEvent
            ...

Independent tasks calling it share decode steps: the scheduler batches every running generate, so the
caller never batches by hand. Each verb is a typed request (protocol/requests.py) handed to the scheduler.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from capsulert.chat.prompt import ChatPrompt
from capsulert.chat.turn import ChatReply, ChatTurn
from capsulert.engine.engine import Engine
from capsulert.protocol.sampling import SamplingParams
from capsulert.worker.scheduler import Sink, StepScheduler, queue_sink, stream_item
from capsulert.protocol.requests import Append, Close, Fork, Generate, Open, Rederive, Request, Restore, Snapshot, Turn
from capsulert.protocol.results import FinalEvent, GenerateResult, SessionInfo, TokenEvent


class AsyncEngine:
    def __init__(self, engine: Engine, max_queue: int = 1024, step_prefill_tokens: int | None = None):
        self.engine = engine
        self.scheduler = StepScheduler(engine, max_queue=max_queue, step_prefill_tokens=step_prefill_tokens)

    async def __aenter__(self) -> "AsyncEngine":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.scheduler.stop()

    async def submit(self, request: Request) -> Any:
        """Run one request; its result (SessionInfo, GenerateResult, CapsuleRef, list, None)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle(fn, value):
            if not fut.done():
                fn(value)
        sink = Sink(done=lambda v: loop.call_soon_threadsafe(settle, fut.set_result, v),
                    error=lambda e: loop.call_soon_threadsafe(settle, fut.set_exception, e))
        job = self.scheduler.submit(request, sink)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            self.scheduler.cancel(job)  # a generate stops at its next token boundary, tokens committed
            raise

    async def stream(self, request: Generate | Turn) -> AsyncIterator[TokenEvent | FinalEvent]:
        """TokenEvents as tokens are produced, then a FinalEvent. Closing or cancelling the iterator stops
        the generate at the next token boundary with the produced tokens committed."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        job = self.scheduler.submit(request, queue_sink(lambda item: loop.call_soon_threadsafe(queue.put_nowait, item)))
        finished = False
        try:
            while not finished:
                item = await queue.get()
                finished = item[0] != "event"
                yield stream_item(item)
        finally:
            if not finished:
                self.scheduler.cancel(job)

    async def open(self, prompt=None, namespace: str | None = "default") -> "AsyncSession":
        """A new session, prefilled with `prompt` when given (from the longest cached prefix in `namespace`
        with EngineConfig.prefix_cache; None: no prefix reuse)."""
        info: SessionInfo = await self.submit(Open(prompt, namespace))
        return AsyncSession(self, info.session, info.length)

    async def restore(self, name: str, namespace: str = "default") -> "AsyncSession":
        info: SessionInfo = await self.submit(Restore(name, namespace))
        return AsyncSession(self, info.session, info.length, info.restored_from)

    async def fork(self, name: str, n: int, namespace: str = "default") -> list["AsyncSession"]:
        infos = await self.submit(Fork(name, n, namespace))
        return [AsyncSession(self, i.session, i.length, i.restored_from) for i in infos]

    async def chat(self, messages, max_new_tokens: int = 256, sampling: SamplingParams | None = None, *,
                   namespace: str | None = "default", **chat_args) -> ChatReply:
        """One chat turn on a session of its own (Session.chat's arguments; the session is closed after)."""
        session = await self.open(namespace=namespace)
        try:
            return await session.chat(messages, max_new_tokens, sampling, **chat_args)
        finally:
            await session.close()


class AsyncSession:
    """A session served by an AsyncEngine; its calls run in the order they are made. `restored_from`: for a
    session made by restore or fork, the tier the capsule was read from (gpu, host or disk)."""

    def __init__(self, owner: AsyncEngine, sid: int, length: int, restored_from: str | None = None):
        self.owner, self.id, self.length = owner, sid, length
        self.restored_from = restored_from

    def __repr__(self) -> str:
        return f"AsyncSession(id={self.id}, len={self.length})"

    async def append(self, tokens_or_text) -> int:
        info: SessionInfo = await self.owner.submit(Append(self.id, tokens_or_text))
        self.length = info.length
        return info.length

    async def generate(self, max_new_tokens: int, sampling: SamplingParams | None = None) -> GenerateResult:
        res: GenerateResult = await self.owner.submit(Generate(self.id, max_new_tokens, sampling))
        self.length = res.length
        return res

    def stream(self, max_new_tokens: int, sampling: SamplingParams | None = None
               ) -> AsyncIterator[TokenEvent | FinalEvent]:
        return self._stream(Generate(self.id, max_new_tokens, sampling))

    async def append_chat(self, messages, tools=None, *, add_generation_prompt: bool = True,
                          **template_kwargs) -> int:
        """Session.append_chat: the messages rendered by the checkpoint's chat template, appended; the length."""
        return await self.append(ChatPrompt.of(messages, tools, add_generation_prompt, **template_kwargs))

    async def chat(self, messages, max_new_tokens: int = 256, sampling: SamplingParams | None = None,
                   **chat_args) -> ChatReply:
        """Session.chat: append the rendered messages and generate the reply in one request; its ChatReply."""
        turn = ChatTurn.plan(messages, sampling, **chat_args)
        return turn.reply(await self.turn(turn.prompt, max_new_tokens, turn.sampling))

    async def turn(self, suffix=None, max_new_tokens: int = 0, sampling: SamplingParams | None = None, *,
                   restore: str | None = None, namespace: str = "default") -> GenerateResult:
        """[restore in place], append, generate in one request."""
        res = await self.owner.submit(Turn(self.id, restore, suffix, max_new_tokens, sampling, namespace))
        self.length = res.length
        return res

    def stream_turn(self, suffix=None, max_new_tokens: int = 0, sampling: SamplingParams | None = None, *,
                    restore: str | None = None, namespace: str = "default") -> AsyncIterator[TokenEvent | FinalEvent]:
        """turn() as a stream: [restore in place], append, then a TokenEvent per token and a FinalEvent."""
        return self._stream(Turn(self.id, restore, suffix, max_new_tokens, sampling, namespace))

    async def _stream(self, request: Generate | Turn) -> AsyncIterator[TokenEvent | FinalEvent]:
        async for ev in self.owner.stream(request):
            if isinstance(ev, FinalEvent):
                self.length = ev.result.length
            yield ev

    async def rederive(self) -> int:
        """Recompute a stale session's state (open across an update_weights) from its tokens under the
        current weights; its length."""
        info: SessionInfo = await self.owner.submit(Rederive(self.id))
        self.length = info.length
        return info.length

    async def snapshot(self, name: str, tier: str = "device", pin: bool = False, namespace: str = "default",
                       mode: str = "full"):
        return await self.owner.submit(Snapshot(self.id, name, tier, pin, namespace, mode))

    async def restore(self, name: str, namespace: str = "default") -> str:
        """Restore the capsule into this session in place; the tier it was read from."""
        info: SessionInfo = await self.owner.submit(Restore(name, namespace, into=self.id))
        self.length = info.length
        return info.restored_from

    async def close(self) -> None:
        await self.owner.submit(Close(self.id))
