"""BackgroundWrites: the store's side of the DiskWriter (writer.py) that writes cascade demotions: it
queues a capsule's write (moves.py books the move first), answers the writer's questions, and reports
failures at flush().

The store decides, under its lock, whether a job is still wanted (a capsule deleted, promoted or dropped
meanwhile cancels its write), whether a block file is still missing (another capsule's write, or the
caller's own demote, may have renamed it since), and renames each file under the lock: a capsule or a
block nothing wants any more never gets its file.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from capsulert.capsule_store.block_pool import BlockRecord
from capsulert.capsule_store.format.staging import StagedWrite
from capsulert.capsule_store.plan import Entry, Key
from capsulert.capsule_store.tiers import TierBook
from capsulert.capsule_store.writer import DiskJob, DiskWriter, WriterHooks
from capsulert.errors import CapsuleIOError

log = logging.getLogger("capsulert.capsule_store.store")


class BackgroundWrites:
    def __init__(self, tiers: TierBook, lock: threading.RLock):
        self._tiers, self._lock = tiers, lock
        self._errors: list[str] = []  # since the last flush()
        self._writer = DiskWriter(WriterHooks(self._job_wanted, self._job_block_wanted, self._job_block_staged,
                                              self._job_staged, self._job_durable, self._job_failed))

    @property
    def pending(self) -> int:
        """Writes not finished yet."""
        return self._writer.pending

    def write_later(self, key: Key, e: Entry, held: dict[str, Any] | None) -> None:
        """Queue the files of a capsule booked into the disk tier. `held`: where its blocks' bytes are (the
        source bytes, its own tensors and its blocks', stay with the entry and the job until the file is
        durable, while its old tier releases them)."""
        e.held = held
        e.pending = DiskJob(key, e.meta, e.tensors, e.event,  # type: ignore[arg-type]
                            self._tiers.disk_dir, e.blocks, e.held)
        self._writer.submit(e.pending)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every background disk write is durable; CapsuleIOError if one failed since the
        last flush (those capsules stay readable from memory) or on timeout."""
        if not self._writer.wait_idle(timeout):
            raise CapsuleIOError(f"{self._writer.pending} background disk write(s) still running after {timeout:g} s")
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise CapsuleIOError(f"{len(errors)} background disk write(s) failed; the capsules stay readable "
                                 f"from memory: {'; '.join(errors[:3])}")

    # -- the background writer's side (see writer.py) ----------------------------------------------
    def _current(self, job: DiskJob) -> Entry | None:
        e = self._tiers.entries.get(job.key)
        return e if e is not None and e.pending is job else None

    def _job_wanted(self, job: DiskJob) -> bool:
        with self._lock:
            return self._current(job) is not None

    def _missing_block(self, job: DiskJob, key: str) -> BlockRecord | None:
        rec = self._tiers.pools["disk"].get(key)
        return rec if self._current(job) is not None and rec is not None and rec.refs and rec.path is None else None

    def _job_block_wanted(self, job: DiskJob, key: str) -> bool:
        with self._lock:
            return self._missing_block(job, key) is not None

    def _job_block_staged(self, job: DiskJob, key: str, staged: StagedWrite) -> None:
        # renamed under the lock: a block nothing references any more (its capsules deleted or moved)
        # never gets its file
        with self._lock:
            rec = self._missing_block(job, key)
            if rec is None:
                staged.discard()
                return
            staged.commit()
            rec.path = staged.final

    def _job_staged(self, job: DiskJob, staged: StagedWrite) -> bool:
        # renamed under the lock: a capsule deleted, moved or replaced meanwhile never gets this file
        with self._lock:
            e = self._current(job)
            if e is None:
                staged.discard()
                return False
            try:
                staged.commit()
            except CapsuleIOError as err:
                self._write_failed(e, err)
                return False
            e.path, e.meta = staged.final, staged.meta  # its bytes serve reads until durable
            return True

    def _job_durable(self, job: DiskJob, staged: StagedWrite) -> None:
        with self._lock:
            e = self._current(job)
            if e is not None:
                e.tensors, e.event, e.pending, e.held = None, None, None, None

    def _job_failed(self, job: DiskJob, err: BaseException) -> None:
        with self._lock:
            e = self._current(job)
            if e is not None:
                self._write_failed(e, err)

    def _write_failed(self, e: Entry, err: BaseException) -> None:
        # the capsule stays readable from its bytes in memory; flush() reports the failure, and an
        # explicit demote to disk (or the next move) writes it again
        e.pending = None
        self._tiers.counters["disk_write_errors"] += 1
        self._errors.append(f"{e.meta.namespace}/{e.meta.name}: {err}")
        log.error("background write of capsule %s/%s to disk failed (%s); it stays readable from memory",
                  e.meta.namespace, e.meta.name, err)
