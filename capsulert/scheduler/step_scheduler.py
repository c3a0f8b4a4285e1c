"""StepScheduler: the worker's continuous-batching loop over one Engine.

Requests (typed verbs, protocol/requests.py) from any thread enter one bounded queue; a single loop thread owns
the engine and runs steps. Each step:
1. starts the requests that can start, in arrival order (a session's requests run one after another, in
   order; requests on different sessions do not wait for each other). Capsule verbs (snapshot, restore,
   fork, close, delete) run here, between decode steps, so a delete never meets a restore mid-copy; the
   restores of the step's starting requests are done first, together (restore_batch.py).
   Requests that need free slots (open, restore, fork, a turn restoring into a new session) start in
   arrival order: one that finds too few waits, without blocking anything else, and the slot-needing
   requests after it wait behind it (a fork of 8 is never starved by a stream of opens), each up to
   `slot_wait_s` from its arrival, then NoFreeSlotError. One that needs more slots than the engine has is
   refused at once (ExceedsCapacityError);
2. runs prefill work under a token budget (`step_prefill_tokens`; unset, one chunk while generates run, and
   while none does one round as wide as a crowd forward, `batched_piece_rows`; while generates run,
   `step_prefill_tokens_decoding` where set, which bounds their inter-token latency): appends are cut at
   grid points, so a long prefill advances one chunk per step while decoding sessions keep producing
   tokens, and the pieces give bitwise the same state as one append. Before an append is cut, the whole
   of it is looked up in the prefix cache (EngineConfig.prefix_cache): the longest cached grid prefix is
   restored and only the rest is prefilled (a Turn's `cached_tokens` counts what was served);
3. advances every running generate by one token in one batched decode step (engine/decoding.py).
Every running generate advances once per step, so a long generate never starves a short one; where
`step_rederive_rows` bounds a step's grid re-derivations (a step that decodes a streamed generate), the generates
past it whose step would reach a grid point sit that step out and go first in the next (their tokens stay the
same). A constrained
generate whose grammar mask is not ready when the step starts skips it (its tokens stay the same); its
generate starts without waiting for the first mask, and when only such generates are left the loop sleeps
until a mask is ready. One whose mask runs past its budget fails with GrammarTooCostlyError and is undone
like a failed prefill (prefill_undo.py).

A request starts by its type's starter (starters.py: the session half of the worker's dispatch, see
worker/core.py), which answers at once or queues the job's typed phases (jobs.py: Prefill, then / or Decode). A
Prefill checks the request's tokens once, when it begins, and appends them in pieces through
Engine.append_checked, which checks them no more.

Results and stream events go to each request's sink from the loop thread; AsyncEngine (sessions/local.py)
turns them into awaitables and async iterators.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Iterator

import torch

from capsulert.errors import (ExceedsCapacityError, InvalidRequestError, NoFreeSlotError, QueueFullError,
                              SessionClosedError)
from capsulert.progress import progress_bar
from capsulert.engine.decoding import DecodeStream, advance, check_generate
from capsulert.engine.engine import LONG_PREFILL_CHUNKS, Engine
from capsulert.engine.session import Session
from capsulert.protocol.requests import SESSION, Request
from capsulert.protocol.results import GenerateResult, SessionInfo
from capsulert.scheduler.jobs import Decode, Job, Phase, Prefill, Sink, queue_sink, stream_item
from capsulert.scheduler.prefill_undo import roll_back
from capsulert.scheduler.restore_batch import restore_together
from capsulert.scheduler.session_ids import SessionIds
from capsulert.scheduler.starters import starter, takes_slots
from capsulert.scheduler.step_trace import StepRecord, StepTrace

__all__ = ["StepScheduler", "Sink", "queue_sink", "stream_item"]
MASK_POLL_S = 0.02  # longest sleep while every job waits for a grammar mask


def prefill_steps(held: int, new: int, grid: int, chunk: int, replayed: int | None = None) -> list[tuple[int, int]]:
    """The scheduler's prefill steps for `new` tokens after `held`: (end, work) each, a step ending a chunk past
    the last grid point before it (one prefill piece: engine.prefill_pieces) and its work counted with the
    re-run past that grid point; `replayed`: where the tail the first step replays in the linear-attention
    layers ends (SessionTable.replayable_end), rows that never pass through the rest of the model and so are
    not counted."""
    steps, P, end = [], held, held + new
    while P < end:
        G = P // grid * grid
        stop = min(end, G + chunk)
        steps.append((stop, stop - (max(G, replayed) if replayed is not None and not steps else G)))
        P = stop
    return steps


class StepScheduler:
    def __init__(self, engine: Engine, max_queue: int | None = None, step_prefill_tokens: int | None = None,
                 first_id: int = 1):
        """max_queue and step_prefill_tokens: this scheduler's own values where given, else the engine
        config's (EngineConfig.scheduler)."""
        config = engine.config.scheduler
        max_queue = config.max_queue if max_queue is None else max_queue
        if max_queue < 1:
            raise InvalidRequestError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        set_budget = step_prefill_tokens or config.step_prefill_tokens
        # while generates run, a step prefills at most this much: their next token waits for it
        running = set_budget or engine.chunk
        self.decoding_budget = min(running, config.step_prefill_tokens_decoding or running)
        self.batch_prefill = config.batch_prefill
        # with none running, no token waits for the step: unset, it takes a whole crowd forward (a batched
        # append of batched_piece_rows rows), so a crowd's turns that arrive together (64 RL envs' steps) run in
        # one forward and start decoding in one step, not a chunk's worth of sessions at a time
        crowd = max(engine.chunk, engine.config.batched_piece_rows) if self.batch_prefill else engine.chunk
        self.budget = set_budget or crowd
        # that wider budget buys width, not depth: such a step runs one round (a piece of each prefilling job), so
        # a long prompt still advances a piece a step and a request arriving meanwhile starts after one forward
        self.idle_one_round = set_budget is None and self.batch_prefill
        rows = config.step_rederive_rows
        self.rederive_sessions = None if rows is None else max(1, rows // engine.grid)
        self._cv = threading.Condition()
        self._incoming: deque[Job] = deque()
        self._waiting: list[Job] = []  # admitted, not started (arrival order)
        self._active: list[Job] = []  # started: prefilling or generating
        self._sessions = SessionIds(first_id)
        self._stopped = False
        self._mask_ready = False  # a grammar mask came ready since the loop last looked (set by its thread)
        self.steps = 0
        self.prefill_forwards = 0  # the forwards its prefill work ran (Engine.prefill_forwards)
        self.restore_batches = 0  # restores of several starting requests run together (restore_batch.py)
        # where the loop's time goes (seconds): starting requests and capsule copies, prefill pieces, decode
        # steps (sampling, the batched step, stop rules and the events handed to sinks); read by Stats
        self.busy_s = {"start": 0.0, "prefill": 0.0, "decode": 0.0}
        self.decoded_tokens = 0
        self.started = 0  # requests started
        self.prefill_tokens = 0  # new tokens of the prefill pieces run
        self.trace = StepTrace()  # the recent steps, one record each (step_trace.py)
        # CPU kernels may reduce in another order with another thread count, and a new thread starts with
        # torch's default count, not the one its creator set: run the loop with the creator's
        self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._loop, name="capsulert-step-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side (any thread)
    def submit(self, request: Request, sink: Sink) -> Job:
        if not isinstance(request, Request) or request.lane != SESSION:
            raise InvalidRequestError(f"not a session request: {type(request).__name__}")
        starter(type(request))  # refused here, in the caller's thread, when nothing starts it
        with self._cv:
            if self._stopped:
                raise SessionClosedError("the scheduler is stopped")
            if len(self._incoming) + len(self._waiting) >= self.max_queue:
                raise QueueFullError(f"{self.max_queue} requests are already waiting; retry later or raise max_queue")
            job = Job(request, sink, request.target)
            job.deadline = time.monotonic() + self.engine.config.slot_wait_s
            self._incoming.append(job)
            self._cv.notify()
        return job

    @contextmanager
    def together(self) -> Iterator[None]:
        """Requests submitted inside the block reach the loop together: it takes none of them before the block
        ends, so one step starts them all (a Batch of a crowd's appends is one prefill forward, not a lone
        first one and then the rest). Submit only: a reply waited for inside the block never comes."""
        with self._cv:  # re-entrant (a Condition's own RLock): submit takes it again inside
            yield

    def cancel(self, job: Job) -> None:
        """Stop a generate at its next token boundary (its tokens stay committed)."""
        job.cancelled = True

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=30)

    def session(self, sid: int) -> Session:
        """The engine session behind an id (SessionClosedError when it is closed or unknown)."""
        return self._sessions.get(sid)

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
                at, counts = time.monotonic(), (self.started, self.prefill_forwards, self.prefill_tokens,
                                                self.decoded_tokens)
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
                self.trace.add(StepRecord(at, (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3,
                                          self.started - counts[0], self.prefill_forwards - counts[1],
                                          self.prefill_tokens - counts[2], self.decoded_tokens - counts[3]))
            except BaseException as e:  # a bug in the loop must not hang every caller
                for job in self._waiting + self._active:
                    job.sink.error(e)
                self._waiting, self._active = [], []
            if self._waiting and not self._active:
                time.sleep(0.002)  # only slot waiters left: poll their slots without spinning hot
            elif self._active and all(j.phase is Phase.DECODE and j.stream.mask_pending for j in self._active):
                self._sleep_until_a_mask()
        for job in self._waiting + self._active + list(self._incoming):
            job.sink.error(SessionClosedError("the scheduler stopped"))

    def _wake_for_mask(self) -> None:
        with self._cv:
            self._mask_ready = True
            self._cv.notify()

    def _sleep_until_a_mask(self) -> None:
        """Every active job waits for its grammar's mask: sleep until one is ready or a request arrives
        (MASK_POLL_S at most: a mask past its budget is failed by the next step)."""
        for job in self._active:
            job.stream.when_mask_ready(self._wake_for_mask)
        with self._cv:
            if not (self._mask_ready or self._incoming or self._stopped):
                self._cv.wait(MASK_POLL_S)
            self._mask_ready = False

    def _busy(self) -> set[int]:
        return {j.session for j in self._active if j.session is not None}

    def _start_ready(self) -> None:
        busy = self._busy()
        if self.batch_prefill:  # the capsules the starting requests restore, in one batch (restore_batch.py)
            self.restore_batches += restore_together(self.engine, self._sessions, self._waiting, busy)
        still = []
        blocked: NoFreeSlotError | None = None  # an earlier request waits for slots: later ones queue behind it
        for job in self._waiting:
            if job.session is not None and job.session in busy:
                still.append(job)  # an earlier request of this session runs first
                continue
            if blocked is not None and takes_slots(job.request):
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
            self.started += 1
            if started and job.session is not None:
                busy.add(job.session)
        self._waiting = still

    def _start(self, job: Job) -> bool:
        """Run a request's immediate part; True when it continues (prefill or decode) in later steps."""
        if not starter(type(job.request))(self.engine, self._sessions, job, job.request):
            return False
        self._sessions.get(job.session)
        self._active.append(job)
        try:
            self._next_phase(job)
        except BaseException:
            if job in self._active:
                self._active.remove(job)
            if job.opened:  # a refused prompt leaves no half-made session behind
                self._sessions.pop(job.session).close()
            raise
        return True

    def _next_phase(self, job: Job) -> None:
        """Enter the job's next phase, or finish it."""
        s = self._sessions.find(job.session)
        if s is None:
            self._fail(job, SessionClosedError(f"session {job.session} was closed"))
            return
        while job.steps:
            step = job.steps.popleft()
            job.phase = step.phase
            if step.phase is Phase.PREFILL:
                self._begin_prefill(job, s, step)
                return
            if self._begin_decode(job, s, step):
                return
        self._finish(job)

    def _begin_prefill(self, job: Job, s: Session, step: Prefill) -> None:
        eng = self.engine
        # the one check of the request's tokens: from here they go to the slot as they are (Engine.append_checked)
        tokens = eng.codec.validate(step.tokens, eng.config.max_seq - len(s.tokens))
        held = len(s.tokens)
        job.undo = list(s.tokens) if job.undo is None else job.undo
        job.prefill = eng.reuse_prefix(s, tokens)  # a cached prefix: only the rest is prefilled
        job.cached_tokens += len(s.tokens) - held
        pieces = len(prefill_steps(len(s.tokens), len(job.prefill), eng.grid, eng.chunk))
        if pieces > LONG_PREFILL_CHUNKS:  # drawn only where someone watches (EngineConfig.progress)
            job.bar = progress_bar(pieces, f"capsulert: prefill (session {job.session})", unit="chunk",
                                   progress=eng.config.progress)

    def _begin_decode(self, job: Job, s: Session, step: Decode) -> bool:
        """Start the job's generate; False when it has nothing to generate (it finishes now)."""
        eng = self.engine
        check_generate([s], step.max_new_tokens, [step.sampling])
        if not s.tokens:
            raise InvalidRequestError("the session is empty; append a prompt before generating")
        job.stream = DecodeStream(eng, s, step.max_new_tokens, step.sampling)
        return not job.stream.done

    def _finish(self, job: Job) -> None:
        self._active.remove(job)
        job.phase = None
        s = self._sessions.find(job.session)
        if job.stream is not None:
            res: GenerateResult = job.stream.result
            res.session, res.restored_from, res.restore_s = job.session, job.restored_from, job.restore_s
            res.cached_tokens = job.cached_tokens
            res.length = len(s.tokens) if s is not None else res.length
            if job.close_after and s is not None:
                self._sessions.pop(job.session)
                s.close()
                res.session = None
            job.sink.done(res)
        else:
            job.sink.done(SessionInfo(job.session, len(s.tokens), _host_logits(s) if job.want_logits else None))

    def _fail(self, job: Job, e: BaseException) -> None:
        if job in self._active:
            self._active.remove(job)
        job.phase = None
        job.sink.error(e)

    def _prefill(self) -> None:
        """The step's prefill work under its token budget: each round takes the next piece of every prefilling
        job (arrival order) while budget is left, and runs them as one batched append (Engine.append_checked_many:
        one forward for the round's pieces, or one per group of similar lengths where padding them all to the
        longest costs more than another forward, engine/prefill_groups.py; each session bitwise what its own
        append gives)."""
        decoding = any(j.phase is Phase.DECODE for j in self._active)
        budget = self.decoding_budget if decoding else self.budget
        one_round = self.idle_one_round and not decoding
        for job in [j for j in self._active if j.phase is Phase.PREFILL and not j.prefill]:
            self._prefilled(job)  # nothing left to prefill (the prefix cache served it all)
        while budget > 0:
            batch: list[tuple[Job, Session, list[int]]] = []
            for job in [j for j in self._active if j.phase is Phase.PREFILL and j.prefill]:
                if budget <= 0:
                    break
                s = self._sessions.find(job.session)
                try:
                    if s is None:
                        raise SessionClosedError(f"session {job.session} was closed")
                    s.check_current()  # refused alone, before the batch runs
                except BaseException as e:
                    self._fail_prefill(job, e)
                    continue
                P = len(s.tokens)
                [(end, work)] = prefill_steps(P, len(job.prefill), self.engine.grid, self.engine.chunk,
                                              self.engine.table.replayable_end(s))[:1]
                batch.append((job, s, job.prefill[:end - P]))
                budget -= work
            if not batch:
                return
            for part in [batch] if self.batch_prefill else [[b] for b in batch]:
                forwards = self.engine.prefill_forwards
                self.prefill_tokens += sum(len(piece) for _, _, piece in part)
                try:
                    if len(part) == 1:  # alone: the one-session path (it replays a kept tail, where one is)
                        self.engine.append_checked(part[0][1], part[0][2])
                    else:
                        self.engine.append_checked_many([s for _, s, _ in part], [piece for _, _, piece in part])
                except BaseException as e:
                    for job, _, _ in part:
                        self._fail_prefill(job, e)
                    batch = [b for b in batch if all(b is not x for x in part)]
                self.prefill_forwards += self.engine.prefill_forwards - forwards
            for job, _, piece in batch:
                job.prefill = job.prefill[len(piece):]
                job.bar.update()
                if not job.prefill:
                    self._prefilled(job)
            if one_round:
                return

    def _prefilled(self, job: Job) -> None:
        job.prefill = None
        job.bar.close()
        try:
            self._next_phase(job)
        except BaseException as e:
            self._fail(job, e)

    def _fail_prefill(self, job: Job, e: BaseException) -> None:
        job.bar.close()
        s = self._sessions.find(job.session)
        if s is not None and job.undo is not None:
            roll_back(self.engine, s, job.undo)  # all or nothing (prefill_undo.py)
        self._fail(job, e)

    def _decode(self) -> None:
        jobs = [j for j in self._active if j.phase is Phase.DECODE and not j.stream.done]
        if not jobs:
            return
        by_stream = {id(j.stream): j for j in jobs}
        # the bound keeps streamed tokens evenly spaced; with none streamed (RL turns, best-of-N, whole generates)
        # no caller sees a token before its last, which re-deriving every grid point the step reaches gives soonest
        streamed = any(j.sink.event is not None for j in jobs)
        events = advance(self.engine, [j.stream for j in jobs], should_stop=lambda st: by_stream[id(st)].cancelled,
                         rederive_sessions=self.rederive_sessions if streamed else None)
        self.steps += bool(events)  # a step every generate skipped (all waiting for masks) is none
        self.decoded_tokens += len(events)
        for st, ev in events:
            job = by_stream[id(st)]
            if job.sink.event is not None:
                job.sink.event(ev)
        for j in jobs:
            if j.stream.error is not None:
                self._fail_decode(j, j.stream.error)
            elif j.stream.done:
                self._finish(j)

    def _fail_decode(self, job: Job, e: BaseException) -> None:
        """A generate refused part way (its grammar): the session is put back as it was before the request."""
        s = self._sessions.find(job.session)
        if s is not None:
            roll_back(self.engine, s, job.undo if job.undo is not None else s.tokens[:job.stream.start])
        self._fail(job, e)


def _host_logits(s: Session):
    """The next-token logits as a float32 numpy array of their own (plain data for any caller)."""
    return s.logits().float().cpu().numpy().copy()

