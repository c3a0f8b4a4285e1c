"""RemoteSession: the caller's handle on one session living in a WorkerActor.

Calls on one session are serialised by an asyncio lock (their order is their submission order). A
generate can be stopped at the next token boundary by `interrupt()` (it then returns the tokens made so
far) or by cancelling the awaiting task: the interrupt is sent through the actor's "control" group, the
session stays at a committed boundary holding the produced tokens, and the next call on the session
waits for the interrupted one to finish first (`wait()` returns its result).

A session belongs to the namespace handle that opened (or restored) it: its snapshots go into that
namespace and its restores read that namespace's capsules only.
"""
from __future__ import annotations

import asyncio
import itertools
from contextlib import asynccontextmanager
import random
from typing import TYPE_CHECKING, Any, AsyncIterator

from ray.exceptions import RayTaskError

from capsulert.errors import CapsuleRTError, SessionClosedError, WorkerLost
from capsulert.orchestrator.orchestrator_config import int_arg, name_arg, sampling_arg, tier_arg, tokens_arg
from capsulert.worker.sampler import SamplingParams
from capsulert.worker.verbs import FinalEvent, Generate, GenerateResult, TokenEvent, Turn

if TYPE_CHECKING:
    from capsulert.orchestrator.namespace import Namespace

_call_ids = itertools.count(random.getrandbits(32) << 16)


def _sampling(value) -> SamplingParams | None:
    d = sampling_arg(value)
    return None if d is None else SamplingParams(**d)


class RemoteSession:
    def __init__(self, space: "Namespace", worker: int, sid: int, length: int):
        self._scope, self._orch = space, space._orch
        self.worker, self.sid, self.length = worker, sid, length
        self.closed = False
        self.stop_reason: str | None = None
        self._lock = asyncio.Lock()
        self._running: tuple[Any, int] | None = None
        self._inflight: Any = None

    @property
    def namespace(self) -> str:
        return self._scope.ns

    def __repr__(self) -> str:
        return (f"RemoteSession(namespace={self._scope.ns!r}, worker={self.worker}, sid={self.sid}, "
                f"len={self.length}{', closed' if self.closed else ''})")

    # ------------------------------------------------------------------ plumbing
    def _check(self) -> None:
        if self.closed:
            raise SessionClosedError(f"session {self.sid} is closed; open or restore a new one")

    async def _settle(self) -> GenerateResult | None:
        ref, self._inflight = self._inflight, None
        if ref is None:
            return None
        try:
            res = await self._orch._await(self.worker, ref, "generate", None)
        except Exception:
            return None
        return self._take(res)

    def _take(self, res: dict | GenerateResult) -> GenerateResult:
        if isinstance(res, dict):  # the one-call chained verbs answer a dict
            res = GenerateResult(res["tokens"], stop_reason=res["stop_reason"], length=res["len"])
        self.length, self.stop_reason = res.length, res.stop_reason
        return res

    async def _run(self, method: str, *args, timeout: float | None = None, **kwargs):
        self._check()
        async with self._lock:
            await self._settle()
            return await self._orch._call(self.worker, method, self.sid, *args, timeout=timeout, **kwargs)

    @asynccontextmanager
    async def _generating(self):
        """The session's turn to run a generate: its lock held, the previous call settled, the worker
        checked; yields the actor handle and a fresh call id (what an interrupt names)."""
        self._check()
        async with self._lock:
            await self._settle()
            await self._orch._check_worker(self.worker)
            yield self._orch.workers[self.worker].handle, next(_call_ids)

    async def _gen(self, method: str, *args, timeout: float | None = None, **kwargs) -> GenerateResult:
        async with self._generating() as (handle, call_id):
            if method == "submit_request":  # a typed request for the worker's step scheduler
                ref = handle.submit_request.remote(*args, call_id=call_id)
            else:
                ref = getattr(handle, method).remote(self.sid, *args, call_id=call_id, **kwargs)
            self._running = (ref, call_id)
            try:
                res = await self._orch._await(self.worker, ref, method, timeout)
            except (asyncio.CancelledError, WorkerLost):
                handle.interrupt.remote(self.sid, call_id)  # control group: lands at the next token
                self._inflight = ref
                raise
            finally:
                self._running = None
            return self._take(res)

    # ------------------------------------------------------------------ verbs
    async def append(self, tokens_or_text, *, logits: bool = False, timeout: float | None = None):
        """Prefill more tokens; returns the next-token logits (numpy float32) when logits=True, else None."""
        tokens = tokens_arg(tokens_or_text)
        res = await self._run("append", tokens, bool(logits), timeout=timeout)
        self.length = res["len"]
        return res["logits"]

    async def generate(self, max_new_tokens: int, sampling=None, *, timeout: float | None = None) -> GenerateResult:
        """Sample up to max_new_tokens (greedy when sampling is None); sets self.stop_reason. The worker's step
        scheduler batches this generate with every other session's running on that worker. The result is
        the list of tokens, with logprobs, text and stop reason."""
        n = int_arg(max_new_tokens, "max_new_tokens", 0)
        return await self._gen("submit_request", Generate(self.sid, n, _sampling(sampling)), timeout=timeout)

    async def stream(self, max_new_tokens: int, sampling=None) -> AsyncIterator[TokenEvent | FinalEvent]:
        """Yield a TokenEvent per token as the worker produces it (token, logprob, text delta), then a
        FinalEvent with the GenerateResult. Closing the iterator (or cancelling its consumer) stops the
        generate at the next token boundary with the produced tokens committed."""
        n = int_arg(max_new_tokens, "max_new_tokens", 0)
        request = Generate(self.sid, n, _sampling(sampling))
        async with self._generating() as (handle, call_id):
            finished = False
            try:
                async for ref in handle.stream_request.remote(request, call_id=call_id):
                    event = await ref
                    if isinstance(event, FinalEvent):
                        finished = True
                        self._take(event.result)
                    yield event
            except RayTaskError as e:
                if isinstance(e.cause, CapsuleRTError):
                    raise e.cause from None
                raise
            finally:
                if not finished:
                    handle.interrupt.remote(self.sid, call_id)  # stops at the next token, tokens committed

    async def turn(self, suffix, max_new_tokens: int, sampling=None, *, restore: str | None = None,
                   timeout: float | None = None) -> GenerateResult:
        """[Restore capsule `restore` in place,] append `suffix` (None: nothing) and generate: one request to
        the worker's step scheduler, batched with every other session's decode (an RL step, an agent turn)."""
        suffix = None if suffix is None else tokens_arg(suffix, "suffix")
        n = int_arg(max_new_tokens, "max_new_tokens", 0)
        if restore is not None:
            restore = name_arg(restore)
            self._check()
            await self._scope._ensure_on(restore, self.worker)
        request = Turn(self.sid, restore, suffix, n, _sampling(sampling), self._scope.ns)
        return await self._gen("submit_request", request, timeout=timeout)

    async def append_generate(self, tokens_or_text, max_new_tokens: int, sampling=None, *,
                              timeout: float | None = None) -> GenerateResult:
        """append + generate in one request (an agent turn, an RL step): turn() without a restore."""
        return await self.turn(tokens_arg(tokens_or_text), max_new_tokens, sampling, timeout=timeout)

    async def restore_append_generate(self, name: str, suffix, max_new_tokens: int, sampling=None, *,
                                      timeout: float | None = None) -> GenerateResult:
        """Roll this session back to capsule `name`, append `suffix` (None: nothing), generate: turn() with
        a restore."""
        return await self.turn(suffix, max_new_tokens, sampling, restore=name, timeout=timeout)

    async def snapshot(self, name: str, tier: str = "gpu", pin: bool = False) -> dict:
        """A named capsule of this session's complete state; pin=True also persists it (with disk_dir)."""
        name, tier = name_arg(name), tier_arg(tier)
        if not isinstance(pin, bool):
            from capsulert.errors import InvalidRequestError

            raise InvalidRequestError(f"pin must be a bool, got {pin!r}")
        self._check()
        space = self._scope
        async with space._space.locks.hold(name):  # serialised with delete / migrate of that name
            space._check_new_name(name)
            ref = await self._run("snapshot", name, tier, pin, namespace=space.ns)
            space._add_holder(name, self.worker)
        return ref

    async def restore(self, name: str) -> None:
        """Replace this session's state with capsule `name` in place (rollback, episode reset)."""
        name = name_arg(name)
        self._check()
        await self._scope._ensure_on(name, self.worker)
        self.length = (await self._run("restore_into", name, namespace=self._scope.ns))["len"]

    async def interrupt(self) -> bool:
        """Stop a running generate at the next token boundary; False when none is running."""
        run = self._running
        if run is None or self.closed:
            return False
        return await self._orch._call(self.worker, "interrupt", self.sid, run[1])

    async def wait(self) -> GenerateResult | None:
        """Wait for a generate whose awaiting task was cancelled; its result (partial tokens) or None."""
        async with self._lock:
            return await self._settle()

    async def tokens(self) -> list[int]:
        """All token ids committed so far (read through the control group: answers during a generate)."""
        self._check()
        return await self._orch._call(self.worker, "tokens", self.sid)

    async def text(self) -> str:
        return await self._orch.detokenize(await self.tokens())

    async def close(self) -> None:
        if self.closed:
            return
        async with self._lock:
            await self._settle()
            self.closed = True
            self._orch._forget(self)
            await self._orch._call(self.worker, "close", self.sid)
