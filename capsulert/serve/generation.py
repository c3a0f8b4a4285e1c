"""Running one HTTP generation request on the orchestrator, through its public async API only.

A request is one or more prompts (a batch), each answered by n choices. Per prompt:
- its session starts empty (`open`) or from the request's `capsule` (`restore`: no prefill; the tier the
  capsule was read from is counted in the metrics); every prompt is appended by a `turn`, which names the
  request's namespace, so the worker serves the longest cached grid prefix of it from that namespace's
  prefix cache (`usage.prompt_tokens_details.cached_tokens` counts those tokens too);
- n = 1: one `turn` (append the prompt + generate in one request to the worker's step scheduler, which
  interleaves the prefill with every other session's decode), or `stream_turn` when streamed; with nothing
  to keep (no snapshot_as), the open (or the capsule's restore), the turn and the close are one request
  (`append_generate` / `append_stream`, `restore_append_generate` / `restore_append_stream`: one round trip
  to the worker instead of three);
- n > 1: the prompt is appended first and snapshotted once as a private fork point, forked into n sessions
  on one worker and the fork point deleted, and the n branches generate concurrently, so the worker's step
  scheduler decodes them in one batch. Branch j samples with seed + j (a request's choices differ, and
  each is reproducible).
A streamed request starts its streams and waits for each one's first event before the response's status
line goes out (`begin_stream`), so a refusal up to then (a prompt past max_seq) is still an HTTP status,
not an error inside a started stream. Every session a request opened is closed when it ends, however it
ends (a client that goes away interrupts its generates at the next token).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

from capsulert.errors import InvalidRequestError, UnknownCapsuleError
from capsulert.serve.streaming import PendingTokens
from capsulert.protocol.sampling import SamplingParams
from capsulert.protocol.results import FinalEvent, GenerateResult

if TYPE_CHECKING:
    from capsulert.capsule_store.capsule import CapsuleRef
    from capsulert.orchestrator.namespace import Namespace
    from capsulert.serve.metrics import ServerMetrics

log = logging.getLogger(__name__)

# capsule names the server keeps for itself (fork points); a client can neither make nor name them
RESERVED_PREFIX = "capsulert:"


def check_client_name(name: str | None, what: str) -> None:
    if name is not None and name.startswith(RESERVED_PREFIX):
        raise InvalidRequestError(f"{what}: capsule names starting with {RESERVED_PREFIX!r} are reserved")


@dataclass(frozen=True)
class Plan:
    """A generation request, decided: token ids per prompt (empty: nothing to append to the capsule)."""
    prompts: tuple[tuple[int, ...], ...]
    n: int
    max_tokens: int
    sampling: SamplingParams  # choice 0's (its seed is the request's); choice j's differ only by seed + j
    capsule: str | None = None
    snapshot_as: str | None = None
    pin: bool = False
    parse_tools: bool = False  # the replies' tool-call markup becomes tool_calls (chat with tools)

    @property
    def sessions(self) -> int:
        """Sessions the request holds at once (its admission reserves them): n branches of every prompt."""
        return len(self.prompts) * self.n

    @classmethod
    def of(cls, prompts, n: int, max_tokens: int, sampling: dict, seed: int | None, **kw) -> "Plan":
        """The plan with its sampling fields checked once, as SamplingParams: the last choice's too (the
        largest seed), so a bad value is refused before anything runs."""
        first = SamplingParams(**sampling, seed=seed)
        if n > 1 and seed is not None:
            SamplingParams(**sampling, seed=seed + n - 1)
        return cls(prompts, n, max_tokens, first, **kw)

    def params(self, branch: int) -> SamplingParams:
        """Choice `branch`'s sampling: the request's, with seed + branch (checked by Plan.of)."""
        seed = self.sampling.seed
        if branch == 0 or seed is None:
            return self.sampling
        return self.sampling.model_copy(update={"seed": seed + branch})


@dataclass(frozen=True)
class Choice:
    index: int
    tokens: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]
    stop_reason: str

    @classmethod
    def of(cls, index: int, res: GenerateResult) -> "Choice":
        return cls(index, tuple(res), res.text or "", tuple(res.logprobs),
                   tuple(tuple(row) for row in res.top_logprobs), res.stop_reason or "length")


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens restored (from the capsule, or the prefix cache) instead of prefilled


@dataclass(frozen=True)
class Made:
    """The capsule a request's snapshot_as made: the orchestrator's CapsuleRef, and whether it is pinned."""
    ref: "CapsuleRef"
    pinned: bool


@dataclass(frozen=True)
class Chunk:
    """New output of one streamed choice (its tokens, their logprobs and, when asked for, the top-k
    alternatives of each); `final` is set on its last chunk."""
    index: int
    text: str
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    final: Choice | None = None


@dataclass
class _Group:
    """One prompt's sessions (one, or its n branches once forked)."""
    sessions: list
    cached_tokens: int
    prompt_tokens: int = 0
    prefilled: bool = False


_END = object()  # a streamed choice is complete


# asyncio.gather, without a task per awaitable when there is one (most requests: one prompt, one choice)
async def _each(aws: list) -> list:
    return [await aws[0]] if len(aws) == 1 else await asyncio.gather(*aws)


async def _settled(aws: list) -> list:  # asyncio.gather(*aws, return_exceptions=True)
    if len(aws) != 1:
        return await asyncio.gather(*aws, return_exceptions=True)
    try:
        return [await aws[0]]
    except Exception as e:
        return [e]


class Run:
    """The sessions of one request, from start to close (an async context manager: closing is certain)."""

    def __init__(self, namespace: "Namespace", plan: Plan, metrics: "ServerMetrics"):
        self.ns, self.plan, self.metrics = namespace, plan, metrics
        self.groups: list[_Group | None] = [None] * len(plan.prompts)
        self.first_token_at: float | None = None
        self._queue: asyncio.Queue = asyncio.Queue()  # the chunks of every streamed choice (several streams)
        self._pumps: list[asyncio.Task] = []
        self._single: tuple | None = None  # (i, j, events) of the one stream read by stream() itself, until its end
        self._first = None  # its first event (read by begin_stream)

    async def __aenter__(self) -> "Run":
        return self

    async def __aexit__(self, *exc) -> None:
        # nothing left to close (a one-request run that ran to its end): no task for it
        if self._single is not None or any(not p.done() for p in self._pumps) or self._sessions():
            # shielded: a cancelled request (client gone) still closes its sessions
            await asyncio.shield(self._close())

    def _sessions(self) -> list:
        return [s for g in self.groups if g is not None for s in g.sessions]

    async def _close(self) -> None:
        if self._single is not None:  # not read to its end (the client went away): it interrupts its generate
            await self._single[2].aclose()
        running = [p for p in self._pumps if not p.done()]
        for p in running:
            p.cancel()  # a client that went away: each stream interrupts its generate
        if running:
            await asyncio.gather(*running, return_exceptions=True)
        for r in await _settled([s.close() for s in self._sessions()]):
            if isinstance(r, BaseException):
                log.debug("closing a session failed: %s: %s", type(r).__name__, r)

    # ------------------------------------------------------------------ start
    @property
    def one_request(self) -> bool:
        """One prompt, one choice, nothing kept: the worker opens a session of its own (or restores the capsule
        into one), appends, generates and closes that session in one request (no session of this Run)."""
        p = self.plan
        return p.n == 1 and len(p.prompts) == 1 and p.snapshot_as is None

    async def start(self) -> None:
        """Open or restore every prompt's session; for n > 1 append the prompts and fork."""
        if self.one_request:
            self.groups[0] = _Group([], 0)
            return
        # every start settles before an error propagates: a session opened after close() ran would leak
        outcomes = await _settled([self._start(i, prompt) for i, prompt in enumerate(self.plan.prompts)])
        for r in outcomes:
            if isinstance(r, BaseException):
                raise r

    async def _start(self, i: int, prompt: tuple[int, ...]) -> None:
        fork = self.plan.n > 1
        if self.plan.capsule is None:
            session = await self.ns.open()
        else:
            t0 = time.perf_counter()
            with self._lookup():
                session = await self.ns.restore(self.plan.capsule)
            self.metrics.capsule_lookup(hit=True, restore_s=time.perf_counter() - t0, tier=session.restored_from)
        # registered at once, so the session is closed whatever follows
        group = self.groups[i] = _Group([session], session.length)
        if not fork:
            return
        if prompt:  # a turn that generates nothing: its prefill is served from the namespace's prefix cache
            group.cached_tokens += (await session.turn(list(prompt), 0)).cached_tokens
        group.prompt_tokens, group.prefilled = session.length, True
        await self._fork(group)

    async def _fork(self, group: _Group) -> None:
        point = f"{RESERVED_PREFIX}fork:{uuid.uuid4().hex}"
        source = group.sessions[0]
        await source.snapshot(point)
        try:
            await source.close()  # its slot is free for a branch; the fork point holds its state
            group.sessions = []
            group.sessions = await self.ns.fork(point, self.plan.n)
        finally:
            await asyncio.shield(self._drop(point))

    async def _drop(self, point: str) -> None:
        try:
            await self.ns.delete(point)
        except Exception as e:  # a lost worker took it along; nothing else holds it
            log.warning("could not delete fork point %s: %s: %s", point, type(e).__name__, e)

    def _prompt(self, i: int) -> list[int] | None:
        """What choice i's generate appends first: the prompt, unless it was appended before the fork."""
        return None if self.groups[i].prefilled else list(self.plan.prompts[i]) or None

    # ------------------------------------------------------------------ generate
    async def generate(self) -> tuple[list[Choice], Usage]:
        per_group = await _each([self._generate(i, g) for i, g in enumerate(self.groups)])
        choices = [c for group in per_group for c in group]
        return choices, self.usage(choices)

    async def _generate(self, i: int, group: _Group) -> list[Choice]:
        plan = self.plan
        if self.one_request:
            if plan.capsule is None:
                results = [await self.ns.append_generate(self._prompt(i), plan.max_tokens, plan.params(0))]
            else:
                with self._lookup():
                    results = [await self.ns.restore_append_generate(plan.capsule, self._prompt(i), plan.max_tokens,
                                                                     plan.params(0))]
        else:
            results = await _each([s.turn(self._prompt(i), plan.max_tokens, plan.params(j))
                                   for j, s in enumerate(group.sessions)])
        self._took(i, results[0])
        return [Choice.of(i * plan.n + j, r) for j, r in enumerate(results)]

    def _took(self, i: int, res: GenerateResult) -> None:
        """Prompt i's generate ended: its usage, and the capsule lookup of a one-request Run."""
        group = self.groups[i]
        group.prompt_tokens = res.length - len(res)
        if self.one_request and self.plan.capsule is not None:  # the capsule's tokens were restored by the same request
            group.cached_tokens += group.prompt_tokens - len(self.plan.prompts[i])
            self.metrics.capsule_lookup(hit=True, restore_s=res.restore_s, tier=res.restored_from)
        if not group.prefilled:  # n = 1: the turn's own prefill
            group.cached_tokens += res.cached_tokens

    @contextmanager
    def _lookup(self):
        """A capsule lookup (a restore, or a one-request Run's call) that finds no capsule counts as a miss."""
        try:
            yield
        except UnknownCapsuleError:
            self.metrics.capsule_lookup(hit=False)
            raise

    async def keep(self) -> "Made | None":
        """Snapshot the end state as the plan's `snapshot_as` (one prompt, n = 1); what was made."""
        if self.plan.snapshot_as is None:
            return None
        ref = await self.groups[0].sessions[0].snapshot(self.plan.snapshot_as, pin=self.plan.pin)
        return Made(ref, self.plan.pin)

    def usage(self, choices: list[Choice]) -> Usage:
        groups = [g for g in self.groups if g is not None]
        return Usage(prompt_tokens=sum(g.prompt_tokens for g in groups),
                     completion_tokens=sum(len(c.tokens) for c in choices),
                     cached_tokens=sum(g.cached_tokens for g in groups))

    # ------------------------------------------------------------------ stream
    async def begin_stream(self) -> None:
        """Start every choice's stream and wait for each one's first event (its first token, or its
        refusal): an error up to then is raised here, before anything of the response is sent. One stream
        (one prompt, one choice) is read by the request's own task (`stream`); several are each read by a
        task of their own (`_pump`) into one queue, so their choices interleave."""
        loop, plan = asyncio.get_running_loop(), self.plan
        if self.one_request:
            events = (self.ns.append_stream(self._prompt(0), plan.max_tokens, plan.params(0)) if plan.capsule is None
                      else self.ns.restore_append_stream(plan.capsule, self._prompt(0), plan.max_tokens, plan.params(0)))
            streams = [(0, 0, events)]
        else:
            streams = [(i, j, s.stream_turn(self._prompt(i), plan.max_tokens, plan.params(j)))
                       for i, g in enumerate(self.groups) for j, s in enumerate(g.sessions)]
        if len(streams) == 1:
            self._single = streams[0]
            with self._lookup():
                self._first = await anext(self._single[2])
            return
        firsts = []
        for i, j, events in streams:
            first = loop.create_future()
            firsts.append(first)
            self._pumps.append(asyncio.create_task(self._pump(i, j, events, first)))
        with self._lookup():
            for r in await asyncio.gather(*firsts, return_exceptions=True):
                if isinstance(r, BaseException):
                    raise r

    async def stream(self) -> AsyncIterator[Chunk]:
        """Chunks of every choice as their tokens arrive (choices interleaved); ends when all are done."""
        if self._single is not None:
            i, j, events = self._single
            async for chunk in self._chunks(i, j, _after(self._first, events)):
                yield chunk
            self._single = None  # read to its end: nothing to close
            return
        left = len(self._pumps)
        while left:
            item = await self._queue.get()
            if item is _END:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item

    async def _pump(self, i: int, j: int, events: AsyncIterator, first: asyncio.Future) -> None:
        queue = self._queue

        async def seen() -> AsyncIterator:  # the events, the first one settling `first`
            async for ev in events:
                if not first.done():
                    first.set_result(None)
                yield ev
        try:
            async for chunk in self._chunks(i, j, seen()):
                queue.put_nowait(chunk)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if first.done():
                queue.put_nowait(e)
            else:
                first.set_exception(e)  # refused before its first event: begin_stream raises it
        finally:
            if not first.done():
                first.cancel()
        queue.put_nowait(_END)

    async def _chunks(self, i: int, j: int, events: AsyncIterator) -> AsyncIterator[Chunk]:
        """Choice (i, j)'s chunks from its stream's events. The worker's events never show text a stop string
        may start, so their texts are shown as they come (the final chunk carries what the result's text
        has past them)."""
        index, pending, shown = i * self.plan.n + j, PendingTokens(), 0
        async for ev in events:
            if isinstance(ev, FinalEvent):
                res = ev.result
                self._took(i, res)
                rest = "" if res.text is None else res.text[shown:]
                yield Chunk(index, rest, *pending.take(), final=Choice.of(index, res))
                continue
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            pending.add(ev.token, ev.logprob, ev.top_logprobs)
            if ev.text or ev.text is None:  # a model without tokenizer streams ids: every token is news
                shown += len(ev.text or "")
                yield Chunk(index, ev.text or "", *pending.take())


async def _after(first, events: AsyncIterator) -> AsyncIterator:
    """`first`, then the rest of `events`."""
    yield first
    async for ev in events:
        yield ev
