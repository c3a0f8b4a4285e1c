"""DiskDirectory: the store's ownership of its disk_dir, and the index of the capsule files found there.

The store holds disk_dir's owner lock from construction to close() (or until it is collected), so no
other store or orchestrator writes there and the disk tier's index is exactly the capsule files there.
Block files (format/blockfiles.py) live beside the capsule files; when the store starts it removes the
block files no capsule file references (what a crash between writes leaves).

A store taking a disk_dir that holds capsule files (its own, from before a restart or a crash) indexes them
in place at start (`reindex`, the default): one file at a time, each verified in full (blocks included);
a file that does not verify is set aside into `quarantine/` with a warning and a typed record
(`quarantined`), and the rest are indexed, each counted in the disk budget as it comes (oldest first:
when the budget cannot hold them all, the oldest are dropped as budget pressure drops any capsule). So the
disk tier survives a restart, and no file of a previous process is left unindexed and uncounted.
`reindex=False` leaves them for an explicit `load(disk_dir)` (adopt), which indexes all of them or none.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from pathlib import Path

from capsulert.capsule_store.access import entry_of
from capsulert.capsule_store.blocks import Parts
from capsulert.capsule_store.capsule import CapsuleMeta, tensor_nbytes
from capsulert.capsule_store.file_reads import read_verified
from capsulert.capsule_store.format.blockfiles import block_file_name, referenced_blocks, sweep_orphans
from capsulert.capsule_store.format.disk import list_capsule_files, read_capsule_parts, scan_capsule_files
from capsulert.capsule_store.format.headers import read_header_refs
from capsulert.capsule_store.moves import Mover
from capsulert.capsule_store.owner import DirLock
from capsulert.capsule_store.quarantine import QuarantinedFile, quarantine
from capsulert.capsule_store.tiers import TierBook
from capsulert.errors import BudgetExceededError, CapsuleError

log = logging.getLogger("capsulert.capsule_store.persistence")


class DiskDirectory:
    def __init__(self, tiers: TierBook, mover: Mover, lock: threading.RLock, *, fingerprint: str,
                 layout_version: int):
        self._tiers, self._mover, self._lock = tiers, mover, lock
        self._fingerprint, self._layout_version = fingerprint, layout_version
        self._quarantined: list[QuarantinedFile] = []
        disk_dir = tiers.disk_dir
        self._owner_lock = DirLock(disk_dir, "capsule store") if disk_dir is not None else None
        if disk_dir is not None:
            scan_capsule_files(disk_dir, clean=True)  # temp files of a dead previous owner's writes
            referenced = referenced_blocks(disk_dir)
            sweep_orphans(disk_dir, referenced)
            tiers.pools["disk"].external = referenced  # kept for the capsule files load(disk_dir) indexes

    @property
    def quarantined(self) -> list[QuarantinedFile]:
        """The capsule files this store set aside instead of loading (quarantine.py), oldest first."""
        with self._lock:
            return list(self._quarantined)

    def release(self) -> None:
        """Let go of disk_dir's owner lock (files already written stay for a later load)."""
        if self._owner_lock is not None:
            self._owner_lock.release()

    def is_disk_dir(self, directory: Path) -> bool:
        disk_dir = self._tiers.disk_dir
        try:
            return disk_dir is not None and directory.exists() and os.path.samefile(directory, disk_dir)
        except OSError:
            return False

    def reindex(self) -> int:
        """Index the capsule files disk_dir holds (a previous owner's), in place, one at a time; the count
        indexed. See the module docstring."""
        tiers, directory = self._tiers, self._tiers.disk_dir
        files = list_capsule_files(directory) if directory is not None else []
        if not files:
            return 0
        if not tiers.usable("disk"):
            log.warning("capsule directory %s holds %d capsule file(s), but the disk tier is disabled (budget 0): "
                        "they are not indexed (load them with store.load)", directory, len(files))
            return 0
        verified: set[str] = set()  # block keys read and verified already (blocks are shared by files)
        found = []
        for p in files:
            try:
                meta, parts = read_capsule_parts(p, self._fingerprint, self._layout_version,
                                                 have=frozenset(verified))
            except CapsuleError as e:  # corrupt, another model's, unreadable: set aside, go on with the rest
                self._set_aside(p, e)
                continue
            verified.update(parts.refs.all_keys if parts.refs is not None else ())
            found.append((p, meta, parts))
        found.sort(key=lambda f: f[1].created_at)  # the newest indexed last: the most recently used
        with self._lock:
            for p, meta, parts in found:
                key = (meta.namespace, meta.name)
                plan = tiers.new_plan()
                plan.enter("disk", tensor_nbytes(parts.own), parts.refs)
                try:
                    tiers.make_room(plan, "disk", frozenset({key}))
                except BudgetExceededError as e:  # pinned capsules fill the budget: nothing to drop for it
                    self._drop_unindexed(p, parts, e)
                    continue
                self._mover.apply(plan)
                self._index_file(p, meta, parts)
            # what is left unreferenced: the block files of the files set aside or dropped
            sweep_orphans(directory, referenced_blocks(directory), "its capsule files were set aside or dropped")
            tiers.pools["disk"].external = Counter()  # every capsule file left is indexed
        log.info("capsule directory %s: indexed %d capsule file(s) left by a previous owner%s", directory,
                 len(found), f"; set aside {len(self._quarantined)}" if self._quarantined else "")
        return len(found)

    def adopt(self, files: list[Path]) -> int:
        """Index the capsule files of disk_dir that no entry holds, in place, all of them or none (caller
        holds the lock)."""
        tiers = self._tiers
        tiers.require_usable("disk")
        held = {e.path for e in tiers.entries.values() if e.path is not None}
        new = [p for p in files if p not in held]
        read = read_verified(new, self._fingerprint, self._layout_version, tiers.layout)  # verified in full
        found = [(p, meta, parts) for p, (meta, parts) in zip(new, read)]
        keys = [(m.namespace, m.name) for _, m, _ in found]
        tiers.refuse_known(keys)
        plan = tiers.new_plan()
        for _, _, parts in found:
            plan.enter("disk", tensor_nbytes(parts.own), parts.refs)
        tiers.make_room(plan, "disk", frozenset(keys))
        self._mover.apply(plan)
        for p, meta, parts in found:
            self._index_file(p, meta, parts)
        return len(found)

    def _set_aside(self, path: Path, error: CapsuleError) -> None:
        try:
            _, _, refs = read_header_refs(path)
        except CapsuleError:
            refs = None
        self._forget_external(refs)
        self._quarantined.append(quarantine(path, error))

    def _drop_unindexed(self, path: Path, parts: Parts, error: BudgetExceededError) -> None:
        self._forget_external(parts.refs)
        path.unlink(missing_ok=True)
        self._tiers.counters["dropped"] += 1
        self._tiers.counters["dropped_bytes"] += tensor_nbytes(parts.own) + (parts.refs.nbytes if parts.refs else 0)
        log.warning("capsule file %s removed at start: the disk tier has no room for it (%s)", path, error)

    def _forget_external(self, refs) -> None:
        """A capsule file that will not be indexed no longer holds its blocks' files."""
        disk = self._tiers.pools["disk"]
        for k in refs.all_keys if refs is not None else ():
            if disk.external[k] > 0:
                disk.external[k] -= 1

    def _index_file(self, path: Path, meta: CapsuleMeta, parts: Parts) -> None:
        """Index one verified capsule file of disk_dir in place, in the disk tier (room made by the caller)."""
        e = entry_of(meta, "disk", path, parts)
        self._tiers.ref("disk", e)
        disk = self._tiers.pools["disk"]
        for k in e.block_keys:
            rec = disk.records[k]
            rec.path = rec.path or path.parent / block_file_name(k)
            if disk.external[k] > 0:
                disk.external[k] -= 1  # its capsule file is indexed now: the reference is counted in rec.refs
        self._tiers.insert((meta.namespace, meta.name), e)
