"""Grammar masks computed off the decode step, on a few threads of their own.

A constrained session's next token mask used to be computed inside the shared decode step: one costly
mask (the 15-byte regex `(a{1000}){1000}` takes ~1.5 s for its first on the CPU) held every session's
step, and masks of long enums added milliseconds to every other tenant's inter-token latency. Now a
session's mask is computed here as soon as its previous token is committed (its first when its generate
starts), while the step runs; a session whose mask is not ready when a step starts skips that step
(engine/decoding.py). llguidance releases the GIL while it builds a matcher and computes a mask
(`py.allow_threads` in its Python binding), so these threads run beside the step loop's torch work.

Each computation knows when it began running (a mask waiting for a free thread is not charged for the
wait, nor for the matcher built before a first mask: it compiles what the Constraint's check compiled
already, a cost its maker paid once, bounded at the HTTP edge by serve/grammar_budget.py): GrammarState
(grammar.py) refuses a grammar whose mask has run past its budget.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable


def default_mask_threads() -> int:
    """Half the cores this process may run on, 1 to 4: on the 2-core CI box one, so that a costly mask and
    the decode step (one torch thread) each keep a core of their own."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, min(4, cores // 2))


class PendingMask:
    """One computation handed to the worker: its future, and when a thread began running it."""

    def __init__(self) -> None:
        self.future: Future[None] = Future()
        self.started: float | None = None  # time.monotonic() when a thread took it; None while it waits

    def running_for(self, now: float) -> float:
        """Seconds it has run on its thread (0 while it waits for one)."""
        return 0.0 if self.started is None else now - self.started


class MaskWorker:
    """Runs mask computations in arrival order on `threads` threads (default_mask_threads() by default).
    A computation whose caller gave up (a refused grammar) runs to its end: llguidance cannot be stopped
    part way, and its closure keeps the buffer it writes into alive until then."""

    def __init__(self, threads: int | None = None):
        self.threads = threads or default_mask_threads()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="capsulert-grammar-mask")

    def submit(self, compute: Callable[[], None], prepare: Callable[[], None] | None = None) -> PendingMask:
        """Run `prepare` (not charged to the computation's time), then `compute`."""
        pending = PendingMask()

        def run() -> None:
            try:
                if prepare is not None:
                    prepare()
                pending.started = time.monotonic()
                compute()
            except BaseException as e:  # noqa: BLE001 - handed to whoever reads the mask
                pending.future.set_exception(e)
            else:
                pending.future.set_result(None)
        self._pool.submit(run)
        return pending
