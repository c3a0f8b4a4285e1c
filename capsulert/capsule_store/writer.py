"""DiskWriter: writes the capsule files of budget-cascade demotions on a background thread.

Why: a put or a promotion that pushes other capsules down to disk used to write and fsync their files
before returning, in the caller's latency path. Now the store books the move at once (the capsule is
in the disk tier, counted in its budget) and queues the write here; the caller goes on.

Crash safety is unchanged: the file is staged (temp file, fsync) and renamed, so a crash leaves either
the complete file or none. A capsule cut into blocks first writes the block files the directory lacks,
renames them and fsyncs the directory, and only then its capsule file (format/blockfiles.py). Until the file is durable (renamed and the directory fsynced) the store keeps
the capsule's source bytes and serves reads from them, so the capsule is readable throughout; those bytes
are only then dropped. A crash before that loses the capsule exactly as a crash just before the demotion
would have (it was only in memory then, too).

The store decides, under its own lock, whether a job is still wanted (a capsule deleted, promoted or
dropped meanwhile cancels its write) and whether to rename; this class only runs the jobs. Its thread
starts on demand and exits when the queue is empty, so an idle store holds no thread.
"""
from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from capsulert.capsule_store.format.blockfiles import stage_block
from capsulert.capsule_store.blocks import BlockRefs
from capsulert.capsule_store.capsule import CapsuleMeta
from capsulert.capsule_store.format.disk import stage_capsule
from capsulert.capsule_store.format.staging import StagedWrite, fsync_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)  # eq=False: a job is identified by the object (the store compares with `is`)
class DiskJob:
    key: tuple[str, str]
    meta: CapsuleMeta
    tensors: Mapping[str, torch.Tensor]  # the source bytes (owned by the store, never written to)
    event: Any  # CUDA event the source bytes are complete after (None on CPU)
    directory: Path
    blocks: BlockRefs | None = None  # the blocks its file references
    held: Mapping[str, Any] | None = None  # block key -> (tensors, event): the source bytes of its blocks


@dataclass(frozen=True)
class WriterHooks:
    """The store's side of a job, each called without the writer's lock held."""

    wanted: Callable[[DiskJob], bool]  # still needed? (checked before the write, to skip cancelled ones)
    block_wanted: Callable[[DiskJob, str], bool]  # does the directory still lack this block file?
    block_staged: Callable[[DiskJob, str, StagedWrite], None]  # rename it if still needed, else discard
    staged: Callable[[DiskJob, StagedWrite], bool]  # rename it if still wanted; False: it was discarded
    durable: Callable[[DiskJob, StagedWrite], None]  # renamed and the directory fsynced
    failed: Callable[[DiskJob, BaseException], None]


# Writers with work in flight when the interpreter exits. A daemon thread still inside torch or a file
# write at interpreter shutdown aborts the process ("terminate called without an active exception") and
# loses the queued capsules; a clean exit drains the queue first.
_live_writers: "weakref.WeakSet[DiskWriter]" = weakref.WeakSet()
EXIT_DRAIN_S = 120.0


@atexit.register
def _drain_at_exit() -> None:
    for writer in list(_live_writers):
        if not writer.wait_idle(EXIT_DRAIN_S):
            log.warning("exiting with %d capsule write(s) unfinished after %.0f s", writer.pending, EXIT_DRAIN_S)
        writer.join_idle_thread()


class DiskWriter:
    def __init__(self, hooks: WriterHooks):
        self._hooks = hooks
        self._cv = threading.Condition()
        self._queue: deque[DiskJob] = deque()
        self._unfinished = 0  # queued + running
        self._thread: threading.Thread | None = None
        self._exiting: threading.Thread | None = None  # the last thread, possibly still returning
        _live_writers.add(self)

    @property
    def pending(self) -> int:
        with self._cv:
            return self._unfinished

    def submit(self, job: DiskJob) -> None:
        with self._cv:
            self._queue.append(job)
            self._unfinished += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="capsulert-disk-writer", daemon=True)
                self._thread.start()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has finished; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._unfinished == 0, timeout)

    def join_idle_thread(self, timeout: float = 5.0) -> None:
        """Wait for an idle writer's thread to have returned (it may still be leaving its loop after the
        last job): a thread still inside torch when the interpreter finalizes aborts the process."""
        with self._cv:
            threads = [t for t in (self._thread, self._exiting) if t is not None]
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._queue:
                    self._thread = None
                    self._exiting = threading.current_thread()
                    return
                job = self._queue.popleft()
            try:
                self._one(job)
            except BaseException as e:  # never lose the accounting of a job, whatever broke
                log.exception("disk writer: unexpected error writing capsule %s/%s", *job.key)
                self._hooks.failed(job, e)
            finally:
                with self._cv:
                    self._unfinished -= 1
                    self._cv.notify_all()

    def _one(self, job: DiskJob) -> None:
        if not self._hooks.wanted(job):
            return
        if job.event is not None:
            job.event.synchronize()
        try:
            if job.blocks is not None:
                self._write_blocks(job)
            staged = stage_capsule(job.directory, job.meta, job.tensors, job.blocks)
        except Exception as e:
            self._hooks.failed(job, e)
            return
        if self._hooks.staged(job, staged):
            fsync_dir(staged.final.parent)
            self._hooks.durable(job, staged)

    def _write_blocks(self, job: DiskJob) -> None:
        """The block files the directory lacks, renamed into place; then the directory fsync that makes
        them durable before the capsule file that references them is renamed."""
        for key in job.blocks.all_keys:  # type: ignore[union-attr]
            if not self._hooks.block_wanted(job, key):
                continue
            tensors, event = job.held[key]  # type: ignore[index]
            if event is not None:
                event.synchronize()
            self._hooks.block_staged(job, key, stage_block(job.directory, key, tensors))
        fsync_dir(job.directory)
