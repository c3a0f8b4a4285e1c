"""Persistence: the store's durability verbs (flush, close, save, load) and the ownership of disk_dir.

The store holds disk_dir's owner lock from construction to close() (or until it is collected), so no
other store or orchestrator writes there and the disk tier's index is exactly the capsule files there.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from capsulert.capsule_store.capsule import tensor_specs
from capsulert.capsule_store.disk import read_capsule, scan_capsule_files, write_capsule_with_meta
from capsulert.capsule_store.owner import DirLock, ensure_directory
from capsulert.capsule_store.plan import Entry, Key, Plan
from capsulert.capsule_store.tiers import TierCore, pkey
from capsulert.errors import CapsuleError, CapsuleIOError, ConfigError, DuplicateCapsuleError, InvalidRequestError
from capsulert.policies.base import TIERS, CapsulePolicy


class Persistence(TierCore):
    def __init__(self, *, device: torch.device | str, fingerprint: str, layout_version: int,
                 budgets: dict[str, int | None] | None, disk_dir: Path | None, policy: str | CapsulePolicy):
        super().__init__(device=device, fingerprint=fingerprint, layout_version=layout_version, budgets=budgets,
                         disk_dir=disk_dir, policy=policy)
        self._closed = False
        self._owner_lock = DirLock(disk_dir, "capsule store") if disk_dir is not None else None
        if disk_dir is not None:
            scan_capsule_files(disk_dir, clean=True)  # temp files of a dead previous owner's writes

    def _check_open(self) -> None:
        if self._closed:
            raise CapsuleError("this capsule store was closed; make a new one")

    def _is_disk_dir(self, directory: Path) -> bool:
        try:
            return self._disk_dir is not None and directory.exists() and os.path.samefile(directory, self._disk_dir)
        except OSError:
            return False

    # -- durability, save and load ------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> None:
        """Wait until every background disk write is durable; CapsuleIOError if one failed since the
        last flush (those capsules stay readable from memory) or on timeout."""
        if not self._writer.wait_idle(timeout):
            raise CapsuleIOError(f"{self._writer.pending} background disk write(s) still running after {timeout:g} s")
        with self._lock:
            errors, self._write_errors = self._write_errors, []
        if errors:
            raise CapsuleIOError(f"{len(errors)} background disk write(s) failed; the capsules stay readable "
                                 f"from memory: {'; '.join(errors[:3])}")

    def close(self, flush: bool = True) -> None:
        """Let go of every capsule and of disk_dir's owner lock (files already written stay for a later
        load). flush=False cancels background writes instead of waiting, as a crash would."""
        try:
            if flush and not self._closed:
                self.flush()
        finally:
            with self._lock:
                for key, e in self._entries.items():
                    e.pending = None  # a write still running finds itself cancelled and removes its temp file
                    self._policy.on_remove(pkey(key))
                self._entries.clear()
                self._used = {t: 0 for t in TIERS}
                self._closed = True
            if self._owner_lock is not None:
                self._owner_lock.release()

    def save(self, directory: str | Path) -> int:
        """Write every capsule (any tier) as a verified capsule file into `directory`; returns the count.
        Refused: a file in the way, this store's own disk_dir, a directory another live store owns."""
        directory = ensure_directory(directory, create=True)
        if self._is_disk_dir(directory):
            raise InvalidRequestError(f"{directory} is this store's disk_dir (its disk tier); save into another "
                                      "directory (load(disk_dir) re-indexes what is there)")
        lock = DirLock(directory, "store.save")  # DiskDirInUseError if a live store owns it
        try:
            with self._lock:
                self._check_open()
                for e in self._entries.values():
                    if e.tensors is None:
                        data = self._read(e)
                    else:
                        if e.event is not None:
                            e.event.synchronize()
                        data = e.tensors
                    _, e.meta = write_capsule_with_meta(directory, e.meta, data)
                return len(self._entries)
        finally:
            lock.release()

    def load(self, directory: str | Path) -> int:
        """Load every capsule file in `directory`; all are verified first, and any bad file raises its
        typed error with nothing inserted. Temp files of interrupted writes are removed and logged
        (see tempfiles.py). From this store's own disk_dir the files are indexed in place, in the disk
        tier (the ones it already indexes are skipped); from anywhere else they are copied into the
        host tier (gpu if host is disabled)."""
        directory = Path(directory)
        with self._lock:
            self._check_open()
            if self._is_disk_dir(directory):
                return self._adopt(scan_capsule_files(directory, clean=True))
        files = scan_capsule_files(directory, clean=True)
        loaded = [read_capsule(p, self.fingerprint, self.layout_version) for p in files]
        tier = next((t for t in ("host", "gpu") if self._usable(t)), None)
        if tier is None:
            raise ConfigError("load needs the host or the gpu tier; both have budget 0")
        keys = [(m.namespace, m.name) for m, _ in loaded]  # distinct: file names derive from them
        with self._lock:
            self._check_open()
            self._refuse_known(keys)
            plan, protect = Plan(self._used), frozenset(keys)
            for m, _ in loaded:
                self._make_room(plan, tier, m.nbytes, protect)
                plan.used[tier] += m.nbytes
            self._apply(plan)
            for (meta, data), key in zip(loaded, keys):
                tensors, event = self._copy(data, tier)
                self._insert(key, Entry(meta, tier, tensors, None, False, time.time(), tensor_specs(data), event=event))
            return len(loaded)

    def _refuse_known(self, keys: list[Key]) -> None:
        for k in keys:
            if k in self._entries:
                raise DuplicateCapsuleError(f"capsule {k[1]!r} in namespace {k[0]!r} already exists")

    def _insert(self, key: Key, e: Entry) -> None:
        self._entries[key] = e
        self._used[e.tier] += e.meta.nbytes
        self._policy.on_insert(pkey(key), e.tier, e.meta.nbytes, e.meta.recompute_cost_s, e.pinned)

    def _adopt(self, files: list[Path]) -> int:
        """Index the capsule files of disk_dir that no entry holds, in place (caller holds the lock)."""
        self._require_usable("disk")
        held = {e.path for e in self._entries.values() if e.path is not None}
        found = []
        for p in files:
            if p not in held:
                meta, tensors = read_capsule(p, self.fingerprint, self.layout_version)  # verified in full
                found.append((p, meta, tensor_specs(tensors)))
        keys = [(m.namespace, m.name) for _, m, _ in found]
        self._refuse_known(keys)
        plan, protect = Plan(self._used), frozenset(keys)
        for _, m, _ in found:
            self._make_room(plan, "disk", m.nbytes, protect)
            plan.used["disk"] += m.nbytes
        self._apply(plan)
        for (p, meta, specs), key in zip(found, keys):
            self._insert(key, Entry(meta, "disk", None, p, False, time.time(), specs))
        return len(found)
