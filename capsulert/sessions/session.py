"""AsyncSession: the caller's handle on one session of a step scheduler, in-process (AsyncEngine) or on a
worker of the orchestrator (Namespace); every session verb is defined here once and differs between the
two only in how its request is sent (a Sender, sender.py).

Every verb is one typed request (protocol/requests.py), which checks its own arguments when made. Calls on
one session are serialised by an asyncio lock (their order is their submission order). A generate can be
stopped at the next token boundary by `interrupt()` (it then returns the tokens made so far) or by
cancelling the awaiting task (or by its `timeout`): the interrupt travels in the control lane, the session
stays at a committed boundary holding the produced tokens, and the next call on the session waits for the
interrupted one to finish first (`wait()` returns its result).

A session belongs to the namespace that opened (or restored) it: its snapshots go into that namespace and
its restores read that namespace's capsules only. Every restore reports the tier the capsule was read from
(gpu, host or disk): `restored_from` of a restored session, the return value of `restore`, and
GenerateResult.restored_from of a turn with `restore`.
"""
from __future__ import annotations

import asyncio
from contextlib import aclosing, asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncGenerator, AsyncIterator

from capsulert.protocol.conversation import ChatPrompt
from capsulert.chat.turn import ChatReply, ChatTurn
from capsulert.errors import SessionClosedError, WorkerLost
from capsulert.protocol.requests import (
    Append, Close, Detokenize, Generate, Interrupt, ReadTokens, Rederive, Request, Restore, Snapshot, Truncate, Turn)
from capsulert.protocol.results import FinalEvent, GenerateResult, TokenEvent
from capsulert.sessions.sender import Sender, next_call_id

if TYPE_CHECKING:
    from capsulert.capsule_store.capsule import CapsuleRef

# how a generate's wait ends early, leaving the call running until the interrupt lands
_CUT_SHORT = (asyncio.CancelledError, WorkerLost, TimeoutError)


class AsyncSession:
    def __init__(self, sender: Sender, sid: int, length: int, restored_from: str | None = None):
        self.sender, self.id, self.length = sender, sid, length
        self.restored_from = restored_from  # made by a restore or fork: the tier the capsule was read from
        self.closed = False
        self.stop_reason: str | None = None
        self._lock = asyncio.Lock()
        self._running: int | None = None  # the call id of the generate running now
        self._inflight: tuple[Any, Generate | Turn] | None = None  # an interrupted generate not yet settled
        sender.opened(self)

    @property
    def sid(self) -> int:
        """The session's id on its scheduler (`id` under the name the scheduler uses)."""
        return self.id

    @property
    def namespace(self) -> str:
        return self.sender.namespace

    @property
    def worker(self) -> int | None:
        return self.sender.worker

    @property
    def pid(self) -> int | None:
        return self.sender.pid

    def __repr__(self) -> str:
        where = "" if self.worker is None else f"worker={self.worker}, "
        return (f"AsyncSession(namespace={self.namespace!r}, {where}id={self.id}, "
                f"len={self.length}{', closed' if self.closed else ''})")

    # ------------------------------------------------------------------ plumbing
    def _check(self) -> None:
        if self.closed:
            raise SessionClosedError(f"session {self.id} is closed; open or restore a new one")
        self.sender.check()  # its process died: WorkerLost now, not after the restart

    async def _settle(self) -> GenerateResult | None:
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return None
        try:
            res = await self.sender.result(*inflight)
        except Exception:
            return None
        return self._take(res)

    def _take(self, res: GenerateResult) -> GenerateResult:
        self.length, self.stop_reason = res.length, res.stop_reason
        return res

    @asynccontextmanager
    async def _turn(self):
        """The session's turn to run a call: its lock held, the previous call settled, the session checked."""
        self._check()
        async with self._lock:
            await self._settle()
            self._check()
            yield

    async def _run(self, request: Request, timeout: float | None = None) -> Any:
        """A request on this session, in its turn."""
        async with self._turn():
            return await self.sender.call(request, timeout)

    async def _gen(self, request: Generate | Turn, timeout: float | None) -> GenerateResult:
        async with self._turn():
            call_id = next_call_id()
            handle = await self.sender.start(request, call_id)
            self._running = call_id
            try:
                res = await self.sender.result(handle, request, timeout)
            except _CUT_SHORT:
                self.sender.post(Interrupt(self.id, call_id))  # lands at the next token; the next call settles it
                self._inflight = (handle, request)
                raise
            finally:
                self._running = None
            return self._take(res)

    async def _stream(self, request: Generate | Turn) -> AsyncGenerator[TokenEvent | FinalEvent, None]:
        async with self._turn():
            # closing this closes the sender's stream at once, which interrupts an unfinished generate
            async with aclosing(self.sender.stream(request, next_call_id())) as events:
                async for event in events:
                    if isinstance(event, FinalEvent):
                        self._take(event.result)
                    yield event

    # ------------------------------------------------------------------ prefill
    async def append(self, tokens_or_text, *, logits: bool = False, timeout: float | None = None):
        """Prefill more tokens (text, token ids, or a ChatPrompt); returns the next-token logits (numpy
        float32) when logits=True, else the session's new length."""
        info = await self._run(Append(self.id, tokens_or_text, logits), timeout)
        self.length = info.length
        return info.logits if logits else info.length

    async def append_chat(self, messages, tools=None, *, add_generation_prompt: bool = True,
                          timeout: float | None = None, **template_kwargs) -> int:
        """Append `messages` rendered by the checkpoint's chat template (where the tokenizer is), listing
        `tools`, opening the assistant's turn (Session.append_chat); the session's new length."""
        prompt = ChatPrompt.of(messages, tools, add_generation_prompt, **template_kwargs)
        return await self.append(prompt, timeout=timeout)

    async def rederive(self, *, timeout: float | None = None) -> int:
        """Recompute a stale session's state (open across an update_weights) from its tokens under the
        current weights (a prefill of them); its length."""
        info = await self._run(Rederive(self.id), timeout)
        self.length = info.length
        return info.length

    async def truncate(self, n: int, *, timeout: float | None = None) -> int:
        """Roll this session back to its first n tokens, bitwise the state a cold prefill of them computes
        (the same next-token logits and continuation); n == length changes nothing, n past it is refused
        (InvalidRequestError, the session unchanged). The new length."""
        info = await self._run(Truncate(self.id, n), timeout)
        self.length = info.length
        return info.length

    # ------------------------------------------------------------------ generate
    async def generate(self, max_new_tokens: int, sampling=None, *, timeout: float | None = None) -> GenerateResult:
        """Sample up to max_new_tokens (greedy when sampling is None); sets self.stop_reason. The step
        scheduler batches this generate with every other session's running there. The result is the list of
        tokens, with logprobs, text and stop reason."""
        return await self._gen(Generate(self.id, max_new_tokens, sampling), timeout)

    def stream(self, max_new_tokens: int, sampling=None) -> AsyncIterator[TokenEvent | FinalEvent]:
        """Yield a TokenEvent per token as it is produced (token, logprob, text delta, and the top-k logprobs
        when SamplingParams.logprobs = k), then a FinalEvent with the GenerateResult. Closing the iterator
        (or cancelling its consumer) stops the generate at the next token boundary with the produced tokens
        committed."""
        return self._stream(Generate(self.id, max_new_tokens, sampling))

    async def turn(self, suffix=Turn.suffix, max_new_tokens: int = Turn.max_new_tokens, sampling=None, *,
                   restore: str | None = None, timeout: float | None = None) -> GenerateResult:
        """[Restore capsule `restore` in place,] append `suffix` (None: nothing) and generate: one request to
        the step scheduler, batched with every other session's decode (an RL step, an agent turn)."""
        return await self._gen(await self._turn_request(suffix, max_new_tokens, sampling, restore), timeout)

    async def stream_turn(self, suffix=Turn.suffix, max_new_tokens: int = Turn.max_new_tokens, sampling=None, *,
                          restore: str | None = None) -> AsyncIterator[TokenEvent | FinalEvent]:
        """turn() as a stream: [restore in place,] append `suffix` and generate in one request, yielding what
        stream() yields (bitwise the same events as append then stream). A refusal of the restore or the
        append is raised by the first step of the iteration."""
        request = await self._turn_request(suffix, max_new_tokens, sampling, restore)
        async with aclosing(self._stream(request)) as events:  # closing this closes that at once (interrupt)
            async for event in events:
                yield event

    async def _turn_request(self, suffix, max_new_tokens: int, sampling, restore: str | None) -> Turn:
        """The Turn of turn() / stream_turn(); a capsule to restore is first made readable where the
        session lives (copied to its worker when it lives elsewhere)."""
        request = Turn(self.id, restore, suffix, max_new_tokens, sampling, self.namespace)
        if restore is not None:
            self._check()
            await self.sender.placing(restore)
        return request

    async def chat(self, messages, max_tokens: int | None = None, sampling=None, *, timeout: float | None = None,
                   **chat_args) -> ChatReply:
        """One chat turn in one request: append the rendered messages, generate the reply (constrained by
        tool_choice / response_format as Session.chat is, a forced call written in the call markup of the
        model's chat template) and parse its tool calls: a ChatReply."""
        turn = ChatTurn.plan(messages, sampling, max_tokens=max_tokens, call_format=self.sender.call_format(),
                             **chat_args)
        return turn.reply(await self.turn(turn.prompt, turn.max_tokens, turn.sampling, timeout=timeout))

    async def append_generate(self, tokens_or_text, max_new_tokens: int, sampling=None, *,
                              timeout: float | None = None) -> GenerateResult:
        """append + generate in one request (an agent turn, an RL step): turn() without a restore."""
        return await self.turn(tokens_or_text, max_new_tokens, sampling, timeout=timeout)

    async def restore_append_generate(self, name: str, suffix, max_new_tokens: int, sampling=None, *,
                                      timeout: float | None = None) -> GenerateResult:
        """Roll THIS session back to capsule `name` in place, append `suffix` (None: nothing) and generate:
        one Turn request, the same verb as Namespace.restore_append_generate (which starts a new session
        instead), with the same GenerateResult."""
        return await self.turn(suffix, max_new_tokens, sampling, restore=name, timeout=timeout)

    # ------------------------------------------------------------------ capsules
    async def snapshot(self, name: str, tier: str = Snapshot.tier, pin: bool = Snapshot.pin,
                       mode: str = Snapshot.mode) -> "CapsuleRef":
        """A named capsule of this session's complete state (a CapsuleRef) in the session's namespace;
        pin=True keeps it from eviction and persists it on a worker with a persist directory, so it survives
        a worker restart. mode="replay" keeps the state at the last grid point and the tokens past it, re-run
        on restore: a fraction of the memory for branches of one context, at the cost of a decode step per
        token past that point."""
        request = Snapshot(self.id, name, tier, pin, self.namespace, mode)
        self._check()
        async with self.sender.making(name):  # serialised with delete / migrate of it
            return await self._run(request)

    async def restore(self, name: str) -> str:
        """Replace this session's state with capsule `name` in place (rollback, episode reset); returns the
        tier it was read from (gpu, host or disk)."""
        request = Restore(name, self.namespace, into=self.id)
        self._check()
        await self.sender.placing(name)
        info = await self._run(request)
        self.length = info.length
        return info.restored_from

    # ------------------------------------------------------------------ control
    async def interrupt(self) -> bool:
        """Stop a running generate at the next token boundary; False when none is running."""
        call_id = self._running
        if call_id is None or self.closed:
            return False
        return await self.sender.call(Interrupt(self.id, call_id))

    async def wait(self) -> GenerateResult | None:
        """Wait for a generate whose awaiting task was cancelled (or timed out); its result (partial
        tokens) or None."""
        async with self._lock:
            return await self._settle()

    async def tokens(self) -> list[int]:
        """All token ids committed so far (read in the control lane: answers during a generate)."""
        self._check()
        return await self.sender.call(ReadTokens(self.id))

    async def text(self) -> str:
        return await self.sender.call(Detokenize(await self.tokens()))

    async def close(self) -> None:
        if self.closed:
            return
        async with self._lock:
            await self._settle()
            self.closed = True
            self.sender.closed(self)
            try:
                self.sender.check()
            except WorkerLost:
                return  # it died with its process: nothing to close there
            await self.sender.call(Close(self.id))
