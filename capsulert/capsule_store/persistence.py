"""Persistence: the store's save and load verbs: every named capsule written as verified capsule files into
a directory, and capsule files read back, verified in full before anything is inserted. From the store's
own disk_dir a load indexes the files in place (disk_dir.py); from anywhere else it copies them into memory.
"""
from __future__ import annotations

import threading
from pathlib import Path

from capsulert.capsule_store.access import EntryAccess
from capsulert.capsule_store.blocks import Parts
from capsulert.capsule_store.capsule import CapsuleMeta, tensor_nbytes
from capsulert.capsule_store.disk_dir import DiskDirectory
from capsulert.capsule_store.file_reads import read_verified
from capsulert.capsule_store.format.blockfiles import stage_block
from capsulert.capsule_store.format.disk import scan_capsule_files, write_capsule_with_meta
from capsulert.capsule_store.format.staging import fsync_dir
from capsulert.capsule_store.moves import Mover
from capsulert.capsule_store.owner import DirLock, ensure_directory
from capsulert.capsule_store.tiers import TierBook
from capsulert.errors import CapsuleInUseError, ConfigError, InvalidRequestError


class Persistence:
    def __init__(self, tiers: TierBook, mover: Mover, access: EntryAccess, disk: DiskDirectory,
                 lock: threading.RLock, *, fingerprint: str, layout_version: int):
        self._tiers, self._mover, self._access, self._disk, self._lock = tiers, mover, access, disk, lock
        self._fingerprint, self._layout_version = fingerprint, layout_version

    def save(self, directory: str | Path) -> int:
        """Write every capsule (any tier) as a verified capsule file into `directory`, each block file once;
        returns the count. Refused: a file in the way, this store's own disk_dir, a directory another live
        store owns. Prefix-cache entries are not saved (the cache is rebuilt by use)."""
        directory = ensure_directory(directory, create=True)
        if self._disk.is_disk_dir(directory):
            raise InvalidRequestError(f"{directory} is this store's disk_dir (its disk tier); save into another "
                                      "directory (load(disk_dir) re-indexes what is there)")
        lock = DirLock(directory, "store.save")  # DiskDirInUseError if a live store owns it
        try:
            with self._lock:
                self._tiers.check_open()
                written: set[str] = set()
                named = [e for e in self._tiers.entries.values() if not e.anonymous]
                for e in named:
                    parts, events = self._mover.source(e)
                    for ev in events:
                        if ev is not None:
                            ev.synchronize()
                    self._save_blocks(directory, parts, written)
                    _, e.meta = write_capsule_with_meta(directory, e.meta, parts.own, parts.refs)
                return len(named)
        finally:
            lock.release()

    @staticmethod
    def _save_blocks(directory: Path, parts: Parts, written: set[str]) -> None:
        """The block files of a capsule this save has not written yet, durable before its capsule file."""
        staged = {k: stage_block(directory, k, b) for k, b in parts.by_key().items() if k not in written}
        for k, s in staged.items():
            s.commit()
            written.add(k)
        if staged:
            fsync_dir(directory)

    def load(self, directory: str | Path) -> int:
        """Load every capsule file in `directory`; all are verified first (block files included), and any
        bad file raises its typed error with nothing inserted. Temp files of interrupted writes are removed
        and logged (see format/tempfiles.py). From this store's own disk_dir the files are indexed in place, in the
        disk tier (the ones it already indexes are skipped); from anywhere else they are copied into the
        host tier (gpu if host is disabled), each block once, and a whole capsule whose file records this
        store's block origin (export_file) is cut into blocks, shared with the store's capsules of its prefix."""
        directory = Path(directory)
        tiers = self._tiers
        with self._lock:
            tiers.check_open()
            if self._disk.is_disk_dir(directory):
                return self._disk.adopt(scan_capsule_files(directory, clean=True))
        files = scan_capsule_files(directory, clean=True)
        loaded = self._read(files)
        tier = self._load_tier()
        keys = [(m.namespace, m.name) for m, _ in loaded]  # distinct: file names derive from them
        with self._lock:
            tiers.check_open()
            tiers.refuse_known(keys)
            plan = tiers.new_plan()
            for _, parts in loaded:
                plan.enter(tier, tensor_nbytes(parts.own), parts.refs)
            tiers.make_room(plan, tier, frozenset(keys))
            self._mover.apply(plan)
            for meta, parts in loaded:
                self._access.insert_read(meta, parts, tier, pin=False)
            return len(loaded)

    def load_file(self, path: str | Path, *, pin: bool = False, replace: bool = False) -> CapsuleMeta:
        """Load one capsule file, verified in full (its block files too), into the tier `load` uses, pinned
        when `pin`; its CapsuleMeta. A capsule of its name already held is DuplicateCapsuleError, or with
        `replace` is replaced (only once the file verified and room was found: a refusal changes nothing)."""
        [(meta, parts)] = self._read([Path(path)])
        tier = self._load_tier()
        key = (meta.namespace, meta.name)
        tiers = self._tiers
        with self._lock:
            tiers.check_open()
            old = tiers.entries.get(key)
            if old is not None and not replace:
                tiers.refuse_known([key])
            plan = tiers.new_plan()
            if old is not None:
                plan.leave(old.tier, old.own_nbytes, old.blocks)
            plan.enter(tier, tensor_nbytes(parts.own), parts.refs)
            tiers.make_room(plan, tier, frozenset({key}))
            if old is not None:
                if old.readers:
                    raise CapsuleInUseError(f"capsule {meta.name!r} is being read; it cannot be replaced now")
                self._mover.remove(key, old)
            self._mover.apply(plan)
            self._access.insert_read(meta, parts, tier, pin)
            return meta

    def _read(self, files: list[Path]) -> list[tuple[CapsuleMeta, Parts]]:
        return read_verified(files, self._fingerprint, self._layout_version, self._tiers.layout, cut=True)

    def _load_tier(self) -> str:
        tier = next((t for t in ("host", "device") if self._tiers.usable(t)), None)
        if tier is None:
            raise ConfigError("load needs the host or the device tier; both have budget 0")
        return tier
