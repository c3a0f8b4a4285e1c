"""RunningCalls: a worker's scheduler jobs by the caller's call id, so that an interrupt naming a call
stops its generate at the next token boundary, even when the interrupt overtakes the call (the interrupt
travels through the control lane, the call through the session lane)."""
from __future__ import annotations

import threading
from typing import Any

from capsulert.scheduler.step_scheduler import StepScheduler

# interrupts whose call never arrived (it finished first, or was lost): remembered this many at most
_EARLY_LIMIT = 4096


class RunningCalls:
    def __init__(self, scheduler: StepScheduler):
        self.scheduler = scheduler
        self._lock = threading.Lock()
        self._jobs: dict[Any, Any] = {}  # call id -> its scheduler job
        self._early: dict[Any, None] = {}  # call ids interrupted before their job was submitted (ordered)

    def track(self, call_id, job) -> None:
        if call_id is None:
            return
        with self._lock:
            self._jobs[call_id] = job
            overtaken = self._early.pop(call_id, False) is None
        if overtaken:
            self.scheduler.cancel(job)

    def untrack(self, call_id) -> None:
        if call_id is not None:
            with self._lock:
                self._jobs.pop(call_id, None)

    def interrupt(self, call_id) -> None:
        with self._lock:
            job = self._jobs.get(call_id)
            if job is None:
                self._early[call_id] = None
                if len(self._early) > _EARLY_LIMIT:
                    del self._early[next(iter(self._early))]
        if job is not None:
            self.scheduler.cancel(job)

    def interrupt_session(self, sid: int) -> None:
        """Stop every tracked call running on session `sid`."""
        with self._lock:
            jobs = [j for j in self._jobs.values() if j.session == sid]
        for job in jobs:
            self.scheduler.cancel(job)
