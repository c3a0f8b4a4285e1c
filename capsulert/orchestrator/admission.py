"""SessionGate: admission of requests that need session slots, across the orchestrator's workers.

A request that will hold k sessions at once (an HTTP request with p prompts and n choices: p * n; a
best-of-n: n) reserves k slots here before it opens any, and gives them back when it has closed them.
Reserving all of a request's sessions at once is what keeps requests from deadlocking: without it, two
batch requests could each hold half the slots and wait for the other half for good (a 16-prompt batch on
8 slots, two prompts of n = 8, 200 clients at once: every one of those waited `slot_wait_s` and was
refused, on an idle server).

- A request that could never start (k more than the live workers' slots together, or a fork of n more
  than one worker's slots) is refused at once: ExceedsCapacityError.
- Otherwise it waits in a bounded queue: first come first served within a namespace, round robin across
  namespaces, so a tenant with a thousand requests queued delays another tenant's next one by at most one
  request per tenant. The head of the rotation waits for its slots even when a smaller request behind it
  would fit: a large request is never starved by small ones.
- A full queue (`max_queued` waiting) is refused at once: QueueFullError with `retry_after_s`, an estimate
  from the recent holding times (the server's 429 Retry-After).
- A waiter whose caller goes away (cancelled) leaves the queue; a reservation is released however its
  holder ends.

The gate counts the slots of the requests it admitted; sessions opened around it (orch.open called
directly) are not counted here and queue at their worker instead (scheduler/step_scheduler.py).
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from capsulert.errors import ExceedsCapacityError, InvalidRequestError, QueueFullError

RETRY_AFTER_RANGE_S = (1.0, 60.0)


@dataclass(eq=False)
class _Waiter:
    need: int
    granted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class SessionGate:
    def __init__(self, slots_per_worker: int, live_workers: Callable[[], int], max_queued: int):
        self.slots_per_worker = slots_per_worker
        self._live_workers = live_workers  # workers gone for good take their slots with them
        self.max_queued = max_queued
        self.in_use = 0
        self._queues: dict[str, deque[_Waiter]] = {}
        self._turns: deque[str] = deque()  # namespaces with waiters, in round-robin order
        self._hold_s = 1.0  # a moving average of how long reservations are held (Retry-After)

    @property
    def capacity(self) -> int:
        return self._live_workers() * self.slots_per_worker

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self._queues.values())

    @asynccontextmanager
    async def reserve(self, sessions: int, namespace: str, *, together: int = 1) -> AsyncIterator[None]:
        """Hold `sessions` slots for the body: waits its turn in the queue, refuses what could never start or
        finds the queue full (see the module docstring). `together`: the most of them one worker must hold
        at once (the n branches of a fork)."""
        self._check(sessions, together)
        waiter = _Waiter(sessions)
        if self.in_use + sessions > self.capacity or self._turns:  # someone waits already: behind them
            if self.queued >= self.max_queued:
                raise QueueFullError(f"{self.queued} requests are waiting for sessions, the queue's bound; retry "
                                     f"later", retry_after_s=self.retry_after_s())
            self._queues.setdefault(namespace, deque()).append(waiter)
            if namespace not in self._turns:
                self._turns.append(namespace)
            self._grant()
            try:
                await asyncio.shield(waiter.granted)
            except asyncio.CancelledError:
                g = waiter.granted
                if g.done() and not g.cancelled() and g.exception() is None:
                    self._release(sessions, 0.0)  # granted just as its caller left
                else:
                    g.cancel()
                    self._leave(namespace, waiter)
                raise
        else:
            self.in_use += sessions
        t0 = time.monotonic()
        try:
            yield
        finally:
            self._release(sessions, time.monotonic() - t0)

    def retry_after_s(self) -> float:
        """When a slot-holding request is likely to have left: the queue ahead over the capacity, times the
        recent holding time."""
        lo, hi = RETRY_AFTER_RANGE_S
        waves = (self.queued + 1) / max(self.capacity, 1)
        return float(min(hi, max(lo, math.ceil(self._hold_s * waves))))

    # -------------------------------------------------------------------------------------------
    def _check(self, sessions: int, together: int) -> None:
        if together > sessions:
            raise InvalidRequestError(f"together ({together}) cannot be more than sessions ({sessions})")
        if together > self.slots_per_worker:
            raise ExceedsCapacityError(f"{together} sessions must be held on one worker at once (n choices of one "
                                       f"prompt), and a worker has {self.slots_per_worker} slots: ask for fewer")
        if sessions > self.capacity:
            raise ExceedsCapacityError(
                f"the request needs {sessions} sessions at once and the workers have {self.capacity} slots in all "
                f"({self._live_workers()} worker(s) x {self.slots_per_worker}): split it into smaller requests")

    def _release(self, sessions: int, held_s: float) -> None:
        self.in_use -= sessions
        if held_s:
            self._hold_s = 0.9 * self._hold_s + 0.1 * held_s
        self._grant()

    def _leave(self, namespace: str, waiter: _Waiter) -> None:
        q = self._queues.get(namespace)
        if q is not None and waiter in q:
            q.remove(waiter)
            if not q:
                del self._queues[namespace]
                self._turns.remove(namespace)
        self._grant()  # it may have been the head that blocked the others

    def _grant(self) -> None:
        """Admit waiters in turn while the one whose turn it is fits (never skipping it for a smaller one)."""
        while self._turns:
            ns = self._turns[0]
            q = self._queues[ns]
            head = q[0]
            if head.need > self.capacity:  # workers were lost since it queued: it can never start now
                q.popleft()
                head.granted.set_exception(ExceedsCapacityError(
                    f"the request needs {head.need} sessions at once and the live workers have {self.capacity} "
                    "slots in all"))
            elif self.in_use + head.need <= self.capacity:
                q.popleft()
                self.in_use += head.need
                head.granted.set_result(None)
            else:
                return
            self._turns.rotate(-1)
            if not q:
                del self._queues[ns]
                self._turns.remove(ns)
