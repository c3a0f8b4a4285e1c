"""RemoteSession: the caller's handle on one session living in a WorkerActor.

Every verb is one typed request (protocol/requests.py) to the session's worker. Calls on one session are
serialised by an asyncio lock (their order is their submission order). A generate can be stopped at the
next token boundary by `interrupt()` (it then returns the tokens made so far) or by cancelling the
awaiting task: the interrupt travels in the worker's control lane, the session stays at a committed
boundary holding the produced tokens, and the next call on the session waits for the interrupted one to
finish first (`wait()` returns its result).

A session belongs to the namespace handle that opened (or restored) it: its snapshots go into that
namespace and its restores read that namespace's capsules only. Every restore reports the tier the worker
read the capsule from (gpu, host or disk): `restored_from` of a restored session, the return value of
`restore`, and GenerateResult.restored_from of a turn with `restore`.
"""
from __future__ import annotations

import asyncio
import itertools
import random
from contextlib import aclosing, asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator

from capsulert.chat.prompt import ChatPrompt
from capsulert.chat.turn import ChatReply, ChatTurn
from capsulert.errors import InvalidRequestError, SessionClosedError, WorkerLost
from capsulert.config.orchestrator import int_arg, name_arg, sampling_params, tier_arg, tokens_arg
from capsulert.protocol.requests import (
    Append, Close, Generate, Interrupt, ReadTokens, Rederive, Request, Restore, Snapshot, Turn)
from capsulert.protocol.results import FinalEvent, GenerateResult, TokenEvent

if TYPE_CHECKING:
    from capsulert.capsule_store.capsule import CapsuleRef
    from capsulert.orchestrator.namespace import Namespace

_call_ids = itertools.count(random.getrandbits(32) << 16)


def next_call_id() -> int:
    """A call id unique in this process (what an Interrupt names; a stream's key in the event feed)."""
    return next(_call_ids)


class RemoteSession:
    def __init__(self, owner: "Namespace", worker: int, sid: int, length: int, restored_from: str | None = None):
        self.owner, self.pool = owner, owner.pool
        self.worker, self.sid, self.length = worker, sid, length
        self.restored_from = restored_from  # made by a restore or fork: the tier the capsule was read from
        # the worker process holding the session, as the orchestrator knew it when the session was made
        self.pid = self.pool.workers[worker].pid
        self.closed = False
        self.stop_reason: str | None = None
        self._lock = asyncio.Lock()
        self._running: tuple[Any, int] | None = None  # (reply ref, call id) of the generate running now
        self._inflight: tuple[Any, Request] | None = None  # an interrupted generate not yet settled

    @property
    def namespace(self) -> str:
        return self.owner.ns

    def __repr__(self) -> str:
        return (f"RemoteSession(namespace={self.owner.ns!r}, worker={self.worker}, sid={self.sid}, "
                f"len={self.length}{', closed' if self.closed else ''})")

    # ------------------------------------------------------------------ plumbing
    def _check(self) -> None:
        if self.closed:
            raise SessionClosedError(f"session {self.sid} is closed; open or restore a new one")
        self.pool.check_session(self.worker, self.pid)  # its process died: WorkerLost now, not after the restart

    async def _settle(self) -> GenerateResult | None:
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return None
        try:
            res = await self.pool.wait(self.worker, *inflight)
        except Exception:
            return None
        return self._take(res)

    def _take(self, res: GenerateResult) -> GenerateResult:
        self.length, self.stop_reason = res.length, res.stop_reason
        return res

    async def _run(self, request: Request, timeout: float | None = None):
        """A request on this session, in its turn."""
        self._check()
        async with self._lock:
            await self._settle()
            self._check()
            return await self.pool.call(self.worker, request, timeout=timeout)

    @asynccontextmanager
    async def _generating(self):
        """The session's turn to run a generate: its lock held, the previous call settled, the worker
        checked; yields a fresh call id (what an interrupt names)."""
        self._check()
        async with self._lock:
            await self._settle()
            self._check()
            await self.pool.check(self.worker)
            yield next_call_id()

    async def _gen(self, request: Generate | Turn, timeout: float | None) -> GenerateResult:
        async with self._generating() as call_id:
            ref = self.pool.send(self.worker, request, call_id)
            self._running = (ref, call_id)
            try:
                res = await self.pool.wait(self.worker, ref, request, timeout)
            except (asyncio.CancelledError, WorkerLost):
                self._interrupt(call_id)  # lands at the next token; the next call settles it
                self._inflight = (ref, request)
                raise
            finally:
                self._running = None
            return self._take(res)

    def _interrupt(self, call_id) -> None:
        self.pool.send(self.worker, Interrupt(self.sid, call_id))

    # ------------------------------------------------------------------ verbs
    async def append(self, tokens_or_text, *, logits: bool = False, timeout: float | None = None):
        """Prefill more tokens; returns the next-token logits (numpy float32) when logits=True, else None."""
        tokens = tokens_arg(tokens_or_text)
        info = await self._run(Append(self.sid, tokens, bool(logits)), timeout)
        self.length = info.length
        return info.logits

    async def rederive(self, *, timeout: float | None = None) -> int:
        """Recompute a stale session's state (open across an update_weights) from its tokens under the
        current weights (a prefill of them); its length."""
        info = await self._run(Rederive(self.sid), timeout)
        self.length = info.length
        return info.length

    async def generate(self, max_new_tokens: int, sampling=None, *, timeout: float | None = None) -> GenerateResult:
        """Sample up to max_new_tokens (greedy when sampling is None); sets self.stop_reason. The worker's step
        scheduler batches this generate with every other session's running on that worker. The result is
        the list of tokens, with logprobs, text and stop reason."""
        n = int_arg(max_new_tokens, "max_new_tokens", 0)
        return await self._gen(Generate(self.sid, n, sampling_params(sampling)), timeout)

    def stream(self, max_new_tokens: int, sampling=None) -> AsyncIterator[TokenEvent | FinalEvent]:
        """Yield a TokenEvent per token as the worker produces it (token, logprob, text delta, and the top-k
        logprobs when SamplingParams.logprobs = k), then a FinalEvent with the GenerateResult. Closing the
        iterator (or cancelling its consumer) stops the generate at the next token boundary with the
        produced tokens committed."""
        n = int_arg(max_new_tokens, "max_new_tokens", 0)
        return self._stream(Generate(self.sid, n, sampling_params(sampling)))

    async def turn(self, suffix, max_new_tokens: int, sampling=None, *, restore: str | None = None,
                   timeout: float | None = None) -> GenerateResult:
        """[Restore capsule `restore` in place,] append `suffix` (None: nothing) and generate: one request to
        the worker's step scheduler, batched with every other session's decode (an RL step, an agent turn)."""
        return await self._gen(await self._turn_request(suffix, max_new_tokens, sampling, restore), timeout)

    async def stream_turn(self, suffix, max_new_tokens: int, sampling=None, *, restore: str | None = None
                          ) -> AsyncIterator[TokenEvent | FinalEvent]:
        """turn() as a stream: [restore in place,] append `suffix` and generate in one request, yielding what
        stream() yields (bitwise the same events as append then stream). A refusal of the restore or the
        append is raised by the first step of the iteration."""
        request = await self._turn_request(suffix, max_new_tokens, sampling, restore)
        async with aclosing(self._stream(request)) as events:  # closing this closes that at once (interrupt)
            async for event in events:
                yield event

    async def _turn_request(self, suffix, max_new_tokens: int, sampling, restore: str | None) -> Turn:
        """The Turn of turn() / stream_turn(), its arguments checked; a capsule to restore is first copied to
        this session's worker when it lives elsewhere."""
        suffix = None if suffix is None else tokens_arg(suffix, "suffix")
        n = int_arg(max_new_tokens, "max_new_tokens", 0)
        if restore is not None:
            restore = name_arg(restore)
            self._check()
            await self.owner.ensure_on(restore, self.worker)
        return Turn(self.sid, restore, suffix, n, sampling_params(sampling), self.owner.ns)

    async def _stream(self, request: Generate | Turn) -> AsyncIterator[TokenEvent | FinalEvent]:
        async with self._generating() as call_id:
            # closing this closes the pool's stream at once, which interrupts an unfinished generate
            async with aclosing(self.pool.stream(self.worker, request, call_id)) as events:
                async for event in events:
                    if isinstance(event, FinalEvent):
                        self._take(event.result)
                    yield event

    async def append_chat(self, messages, tools=None, *, add_generation_prompt: bool = True,
                          timeout: float | None = None, **template_kwargs) -> None:
        """Append `messages` rendered by the checkpoint's chat template (on the worker, with its tokenizer),
        listing `tools`, opening the assistant's turn (Session.append_chat)."""
        prompt = ChatPrompt.of(messages, tools, add_generation_prompt, **template_kwargs)
        info = await self._run(Append(self.sid, prompt), timeout)
        self.length = info.length

    async def chat(self, messages, max_new_tokens: int = 256, sampling=None, *, timeout: float | None = None,
                   **chat_args) -> ChatReply:
        """One chat turn in one request: append the rendered messages, generate the reply (constrained by
        tool_choice / response_format as Session.chat is) and parse its tool calls: a ChatReply."""
        turn = ChatTurn.plan(messages, sampling_params(sampling), **chat_args)
        n = int_arg(max_new_tokens, "max_new_tokens", 0)
        return turn.reply(await self._gen(Turn(self.sid, None, turn.prompt, n, turn.sampling, self.owner.ns), timeout))

    async def append_generate(self, tokens_or_text, max_new_tokens: int, sampling=None, *,
                              timeout: float | None = None) -> GenerateResult:
        """append + generate in one request (an agent turn, an RL step): turn() without a restore."""
        return await self.turn(tokens_arg(tokens_or_text), max_new_tokens, sampling, timeout=timeout)

    async def restore_append_generate(self, name: str, suffix, max_new_tokens: int, sampling=None, *,
                                      timeout: float | None = None) -> GenerateResult:
        """Roll THIS session back to capsule `name` in place, append `suffix` (None: nothing) and generate:
        one Turn request, the same verb as Namespace.restore_append_generate (which starts a new session
        instead), with the same GenerateResult."""
        return await self.turn(suffix, max_new_tokens, sampling, restore=name, timeout=timeout)

    async def snapshot(self, name: str, tier: str = "gpu", pin: bool = False, mode: str = "full") -> "CapsuleRef":
        """A named capsule of this session's complete state (a CapsuleRef); pin=True keeps it from eviction
        and persists it on the worker (with disk_dir), so it survives a worker restart. mode="replay" keeps
        the state at the last grid point and the tokens past it, re-run on restore: a fraction of the
        memory for branches of one context, at the cost of a decode step per token past that point."""
        name, tier = name_arg(name), tier_arg(tier)
        if not isinstance(pin, bool):
            raise InvalidRequestError(f"pin must be a bool, got {pin!r}")
        if mode not in ("full", "replay"):
            raise InvalidRequestError(f"mode must be 'full' or 'replay', got {mode!r}")
        self._check()
        async with self.owner.new_capsules([name], self.worker):  # serialised with delete / migrate of it
            return await self._run(Snapshot(self.sid, name, tier, pin, self.owner.ns, mode))

    async def restore(self, name: str) -> str:
        """Replace this session's state with capsule `name` in place (rollback, episode reset); returns the
        tier the worker read it from (gpu, host or disk)."""
        name = name_arg(name)
        self._check()
        await self.owner.ensure_on(name, self.worker)
        info = await self._run(Restore(name, self.owner.ns, into=self.sid))
        self.length = info.length
        return info.restored_from

    async def interrupt(self) -> bool:
        """Stop a running generate at the next token boundary; False when none is running."""
        run = self._running
        if run is None or self.closed:
            return False
        return await self.pool.call(self.worker, Interrupt(self.sid, run[1]))

    async def wait(self) -> GenerateResult | None:
        """Wait for a generate whose awaiting task was cancelled; its result (partial tokens) or None."""
        async with self._lock:
            return await self._settle()

    async def tokens(self) -> list[int]:
        """All token ids committed so far (read in the worker's control lane: answers during a generate)."""
        self._check()
        return await self.pool.call(self.worker, ReadTokens(self.sid))

    async def text(self) -> str:
        return await self.owner.detokenize(await self.tokens())

    async def close(self) -> None:
        if self.closed:
            return
        async with self._lock:
            await self._settle()
            self.closed = True
            self.pool.closed_session(self)
            try:
                self.pool.check_session(self.worker, self.pid)
            except WorkerLost:
                return  # it died with its process: nothing to close there
            await self.pool.call(self.worker, Close(self.sid))
