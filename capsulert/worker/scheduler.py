"""StepScheduler: the worker's continuous-batching loop over one Engine.

Requests (typed verbs, protocol/requests.py) from any thread enter one bounded queue; a single loop thread owns
the engine and runs steps. Each step:
1. starts the requests that can start, in arrival order (a session's requests run one after another, in
   order; requests on different sessions do not wait for each other). Capsule verbs (snapshot, restore,
   fork, close, delete) run here, between decode steps, so a delete never meets a restore mid-copy.
   Requests that need free slots (open, restore, fork, a turn restoring into a new session) start in
   arrival order: one that finds too few waits, without blocking anything else, and the slot-needing
   requests after it wait behind it (a fork of 8 is never starved by a stream of opens), each up to
   `slot_wait_s` from its arrival, then NoFreeSlotError. One that needs more slots than the engine has is
   refused at once (ExceedsCapacityError);
2. runs prefill work under a token budget (`step_prefill_tokens`, default one chunk): appends are cut at
   grid points, so a long prefill advances one chunk per step while decoding sessions keep producing
   tokens, and the pieces give bitwise the same state as one append. Before an append is cut, the whole
   of it is looked up in the prefix cache (EngineConfig.prefix_cache): the longest cached grid prefix is
   restored and only the rest is prefilled (a Turn's `cached_tokens` counts what was served);
3. advances every running generate by one token in one batched decode step (engine/decoding.py).
Every running generate advances once per step, so a long generate never starves a short one.

Results and stream events go to each request's sink from the loop thread; AsyncEngine (async_engine.py)
turns them into awaitables and async iterators.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from capsulert.errors import (ExceedsCapacityError, InvalidRequestError, NoFreeSlotError, QueueFullError,
                              SessionClosedError)
from capsulert.progress import Bar, NullBar, progress_bar
from capsulert.engine.decoding import DecodeStream, advance
from capsulert.engine.engine import LONG_PREFILL_CHUNKS, SESSION_CALLS, Engine
from capsulert.engine.session import Session
from capsulert.protocol.requests import (
    SESSION, Append, Close, Delete, Fork, Generate, Open, Rederive, Request, Restore, Turn)
from capsulert.protocol.results import FinalEvent, GenerateResult, SessionInfo, TokenEvent


@dataclass
class Sink:
    """Where a request's outcome goes (called on the loop thread)."""
    done: Callable[[Any], None]
    error: Callable[[BaseException], None]
    event: Callable[[TokenEvent], None] | None = None


def queue_sink(put: Callable[[tuple[str, Any]], None]) -> Sink:
    """A sink that puts ("event", ev), ("done", result) or ("error", exc) items through `put`."""
    return Sink(done=lambda v: put(("done", v)), error=lambda e: put(("error", e)),
                event=lambda ev: put(("event", ev)))


def stream_item(item: tuple[str, Any]) -> TokenEvent | FinalEvent:
    """The stream event of a queue_sink item: a TokenEvent, the FinalEvent (the last one), or the error raised."""
    kind, value = item
    if kind == "error":
        raise value
    return value if kind == "event" else FinalEvent(value)


@dataclass
class _Job:
    request: Request
    sink: Sink
    session: int | None  # the session it runs on, once known
    deadline: float = 0.0  # for slot waits
    phases: deque = field(default_factory=deque)  # remaining steps of a chained request
    prefill: list[int] | None = None  # tokens still to append
    stream: DecodeStream | None = None
    cancelled: bool = False
    restored_from: str | None = None  # the tier its restore read the capsule from
    restore_s: float | None = None  # and the time that restore took here
    cached_tokens: int = 0  # tokens its appends restored from the prefix cache instead of prefilling
    bar: Bar = field(default_factory=NullBar)  # a long prefill's progress, one chunk piece per update


class StepScheduler:
    def __init__(self, engine: Engine, max_queue: int = 1024, step_prefill_tokens: int | None = None,
                 first_id: int = 1):
        if max_queue < 1:
            raise InvalidRequestError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self.budget = step_prefill_tokens or engine.chunk
        self._cv = threading.Condition()
        self._incoming: deque[_Job] = deque()
        self._waiting: list[_Job] = []  # admitted, not started (arrival order)
        self._active: list[_Job] = []  # started: prefilling or generating
        self._sessions: dict[int, Session] = {}
        self._ids = itertools.count(first_id)
        self._stopped = False
        self.steps = 0
        # where the loop's time goes (seconds): starting requests and capsule copies, prefill pieces, decode
        # steps (sampling, the batched step, stop rules and the events handed to sinks); read by Stats
        self.busy_s = {"start": 0.0, "prefill": 0.0, "decode": 0.0}
        self.decoded_tokens = 0
        # CPU kernels may reduce in another order with another thread count, and a new thread starts with
        # torch's default count, not the one its creator set: run the loop with the creator's
        self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._loop, name="capsulert-step-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side (any thread)
    def submit(self, request: Request, sink: Sink) -> _Job:
        if not isinstance(request, Request) or request.lane != SESSION:
            raise InvalidRequestError(f"not a session request: {type(request).__name__}")
        with self._cv:
            if self._stopped:
                raise SessionClosedError("the scheduler is stopped")
            if len(self._incoming) + len(self._waiting) >= self.max_queue:
                raise QueueFullError(f"{self.max_queue} requests are already waiting; retry later or raise max_queue")
            job = _Job(request, sink, request.target)
            job.deadline = time.monotonic() + self.engine.config.slot_wait_s
            self._incoming.append(job)
            self._cv.notify()
        return job

    def cancel(self, job: _Job) -> None:
        """Stop a generate at its next token boundary (its tokens stay committed)."""
        job.cancelled = True

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=30)

    def session(self, sid: int) -> Session:
        """The engine session behind an id (SessionClosedError when it is closed or unknown)."""
        return self._session(sid)

    @property
    def session_count(self) -> int:
        return len(self._sessions)

    @property
    def queued(self) -> int:
        with self._cv:
            return len(self._incoming) + len(self._waiting)

    # ------------------------------------------------------------------ loop thread
    def _loop(self) -> None:
        torch.set_num_threads(self._threads)
        while True:
            with self._cv:
                while not (self._stopped or self._incoming or self._active or self._waiting):
                    self._cv.wait()
                if self._stopped:
                    break
                self._waiting += self._incoming
                self._incoming.clear()
            try:
                t0 = time.perf_counter()
                self._start_ready()
                t1 = time.perf_counter()
                self._prefill()
                t2 = time.perf_counter()
                self._decode()
                t3 = time.perf_counter()
                busy = self.busy_s
                busy["start"] += t1 - t0
                busy["prefill"] += t2 - t1
                busy["decode"] += t3 - t2
            except BaseException as e:  # a bug in the loop must not hang every caller
                for job in self._waiting + self._active:
                    job.sink.error(e)
                self._waiting, self._active = [], []
            if self._waiting and not self._active:
                time.sleep(0.002)  # only slot waiters left: poll their slots without spinning hot
        for job in self._waiting + self._active + list(self._incoming):
            job.sink.error(SessionClosedError("the scheduler stopped"))

    def _busy(self) -> set[int]:
        return {j.session for j in self._active if j.session is not None}

    def _start_ready(self) -> None:
        busy = self._busy()
        still = []
        blocked: NoFreeSlotError | None = None  # an earlier request waits for slots: later ones queue behind it
        for job in self._waiting:
            if job.session is not None and job.session in busy:
                still.append(job)  # an earlier request of this session runs first
                continue
            if blocked is not None and _takes_slots(job.request):
                if time.monotonic() < job.deadline:
                    still.append(job)  # first come, first served: a fork of 8 is not starved by opens of 1
                else:
                    job.sink.error(NoFreeSlotError(f"no slot came free within slot_wait_s "
                                                   f"({self.engine.config.slot_wait_s:g} s): {blocked}"))
                continue
            try:
                started = self._start(job)
            except NoFreeSlotError as e:
                if time.monotonic() < job.deadline and not isinstance(e, ExceedsCapacityError):
                    still.append(job)
                    blocked = e
                else:
                    job.sink.error(e)
                continue
            except Exception as e:  # typed refusals and untyped errors alike reach the caller, never the loop
                job.sink.error(e)
                continue
            if started and job.session is not None:
                busy.add(job.session)
        self._waiting = still

    def _session(self, sid: int | None) -> Session:
        s = self._sessions.get(sid)
        if s is None:
            raise SessionClosedError(f"session {sid} is closed or unknown")
        return s

    def _adopt(self, s: Session) -> int:
        sid = next(self._ids)
        self._sessions[sid] = s
        return sid

    def _start(self, job: _Job) -> bool:
        """Run a request's immediate part; True when it continues (prefill or decode) in later steps."""
        r, eng = job.request, self.engine
        if isinstance(r, Open):
            job.session = self._adopt(eng.open(wait_s=0, namespace=r.namespace))
            if r.prompt is not None:
                job.phases.append(("append", r.prompt))
        elif isinstance(r, Append):
            job.phases.append(("append", r.tokens))
        elif isinstance(r, Rederive):
            tokens = eng.begin_rederive(self._session(r.session))
            if tokens:
                job.phases.append(("append", tokens))
        elif isinstance(r, Generate):
            job.phases.append(("generate", r.max_new_tokens, r.sampling))
        elif type(r) in SESSION_CALLS:  # a simple verb on one session: the engine call its type selects
            job.sink.done(SESSION_CALLS[type(r)](eng, self._session(r.session), r))
            return False
        elif isinstance(r, Restore):
            self._restore(job, r.name, r.namespace)
            job.sink.done(SessionInfo(job.session, len(self._session(job.session).tokens),
                                      restored_from=job.restored_from))
            return False
        elif isinstance(r, Fork):
            restored = eng.restore_sessions(r.name, r.n, r.namespace, wait_s=0)
            job.sink.done([SessionInfo(self._adopt(s), len(s.tokens), restored_from=restored.tier)
                           for s in restored.sessions])
            return False
        elif isinstance(r, Delete):
            eng.store.delete(r.name, r.namespace)
            job.sink.done(None)
            return False
        elif isinstance(r, Close):
            s = self._sessions.pop(r.session, None)
            if s is not None:
                s.close()
            job.sink.done(None)
            return False
        elif isinstance(r, Turn):
            if r.restore is not None:
                self._restore(job, r.restore, r.namespace)
            eng.prefix.claim(self._session(job.session), r.namespace)  # its prompts are that namespace's
            if r.suffix is not None:
                job.phases.append(("append", r.suffix))
            job.phases.append(("generate", r.max_new_tokens, r.sampling))
        self._session(job.session)
        self._active.append(job)
        try:
            self._next_phase(job)
        except BaseException:
            if job in self._active:
                self._active.remove(job)
            if isinstance(r, Open):  # a refused prompt leaves no half-made session behind
                self._sessions.pop(job.session).close()
            raise
        return True

    def _restore(self, job: _Job, name: str, namespace: str) -> None:
        """Restore capsule `name` into the job's session in place, or into a new one when it has none; the
        tier it was read from goes to the job's reply."""
        eng, t0 = self.engine, time.perf_counter()
        if job.session is None:
            restored = eng.restore_sessions(name, 1, namespace, wait_s=0)
            job.session = self._adopt(restored.sessions[0])
            job.restored_from = restored.tier
        else:
            job.restored_from = eng.restore_into(self._session(job.session), name, namespace)
        job.restore_s = time.perf_counter() - t0

    def _next_phase(self, job: _Job) -> None:
        """Enter the job's next phase, or finish it."""
        s = self._sessions.get(job.session)
        if s is None:
            self._fail(job, SessionClosedError(f"session {job.session} was closed"))
            return
        while job.phases:
            phase = job.phases.popleft()
            if phase[0] == "append":
                tokens = self.engine.codec.validate(phase[1], self.engine.config.max_seq - len(s.tokens))
                held = len(s.tokens)
                job.prefill = self.engine.reuse_prefix(s, tokens)  # a cached prefix: only the rest is prefilled
                job.cached_tokens += len(s.tokens) - held
                chunk = self.engine.chunk
                pieces = (len(s.tokens) + len(job.prefill) - 1) // chunk - len(s.tokens) // chunk + 1
                if pieces > LONG_PREFILL_CHUNKS:  # drawn only where someone watches (EngineConfig.progress)
                    job.bar = progress_bar(pieces, f"capsulert: prefill (session {job.session})", unit="chunk",
                                           progress=self.engine.config.progress)
                return
            _, n, sampling = phase
            eng = self.engine
            eng.check_generate([s], n, [sampling])
            if not s.tokens:
                raise InvalidRequestError("the session is empty; append a prompt before generating")
            job.stream = DecodeStream(eng, s, n, sampling)
            if job.stream.done:
                break
            return
        self._finish(job)

    def _finish(self, job: _Job) -> None:
        self._active.remove(job)
        r, s = job.request, self._sessions.get(job.session)
        if job.stream is not None:
            res: GenerateResult = job.stream.result
            res.session, res.restored_from, res.restore_s = job.session, job.restored_from, job.restore_s
            res.cached_tokens = job.cached_tokens
            res.length = len(s.tokens) if s is not None else res.length
            if isinstance(r, Turn) and r.close and s is not None:
                self._sessions.pop(job.session, None)
                s.close()
                res.session = None
            job.sink.done(res)
        else:
            want_logits = isinstance(r, Append) and r.logits
            job.sink.done(SessionInfo(job.session, len(s.tokens), _host_logits(s) if want_logits else None))

    def _fail(self, job: _Job, e: BaseException) -> None:
        if job in self._active:
            self._active.remove(job)
        job.sink.error(e)

    def _prefill(self) -> None:
        budget = self.budget
        for job in [j for j in self._active if j.prefill is not None]:
            if budget <= 0:
                break
            s = self._sessions.get(job.session)
            try:
                if s is None:
                    raise SessionClosedError(f"session {job.session} was closed")
                while job.prefill and budget > 0:
                    P, chunk = len(s.tokens), self.engine.chunk
                    end = min(P + len(job.prefill), (P // chunk + 1) * chunk)  # cut at the next chunk boundary
                    piece, job.prefill = job.prefill[:end - P], job.prefill[end - P:]
                    self.engine.append(s, piece)
                    budget -= end - P // self.engine.grid * self.engine.grid  # with the re-run past the grid point
                    job.bar.update()
                if not job.prefill:
                    job.prefill = None
                    job.bar.close()
                    self._next_phase(job)
            except BaseException as e:
                job.bar.close()
                self._fail(job, e)

    def _decode(self) -> None:
        jobs = [j for j in self._active if j.stream is not None and not j.stream.done and j.prefill is None]
        if not jobs:
            return
        self.steps += 1
        by_stream = {id(j.stream): j for j in jobs}
        events = advance(self.engine, [j.stream for j in jobs],
                         should_stop=lambda st: by_stream[id(st)].cancelled)
        self.decoded_tokens += len(events)
        for st, ev in events:
            job = by_stream[id(st)]
            if job.sink.event is not None:
                job.sink.event(ev)
        for j in jobs:
            if j.stream.done:
                self._finish(j)


def _takes_slots(r: Request) -> bool:
    """Whether the request needs free slots to start (a new session, or n of them)."""
    return isinstance(r, (Open, Fork)) or (isinstance(r, Restore) and r.into is None) or \
        (isinstance(r, Turn) and r.session is None)


def _host_logits(s: Session):
    """The next-token logits as a float32 numpy array of their own (plain data for any caller)."""
    return s.logits().float().cpu().numpy().copy()
