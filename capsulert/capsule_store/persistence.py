"""Persistence: the store's durability verbs (flush, close, save, load), the ownership of disk_dir, and
how an entry comes in (_put: a copy of the caller's tensors; _insert: bytes its tier holds already) and is
read (_reading: a read reference while the bytes are in use).

The store holds disk_dir's owner lock from construction to close() (or until it is collected), so no
other store or orchestrator writes there and the disk tier's index is exactly the capsule files there.
Block files (blockfiles.py) live beside the capsule files; when the store starts it removes the block
files no capsule file references (what a crash between writes leaves).

A store taking a disk_dir that holds capsule files (its own, from before a restart or a crash) indexes them
in place at start (`reindex`, the default): one file at a time, each verified in full (blocks included);
a file that does not verify is set aside into `quarantine/` with a warning and a typed record
(`quarantined`), and the rest are indexed, each counted in the disk budget as it comes (oldest first:
when the budget cannot hold them all, the oldest are dropped as budget pressure drops any capsule). So the
disk tier survives a restart, and no file of a previous process is left unindexed and uncounted.
`reindex=False` leaves them for an explicit `load(disk_dir)`, which indexes all of them or none.
"""
from __future__ import annotations

import logging
import os
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

from capsulert.capsule_store.format.blockfiles import block_file_name, referenced_blocks, stage_block, sweep_orphans
from capsulert.capsule_store.blocks import Parts, full_specs, split
from capsulert.capsule_store.capsule import tensor_nbytes, tensor_specs
from capsulert.capsule_store.format.disk import (
    fsync_dir, list_capsule_files, read_capsule_parts, scan_capsule_files, write_capsule_with_meta)
from capsulert.capsule_store.background import BackgroundWrites
from capsulert.capsule_store.owner import DirLock, ensure_directory
from capsulert.capsule_store.format.headers import read_header_refs
from capsulert.capsule_store.plan import Entry, Key
from capsulert.capsule_store.quarantine import QuarantinedFile, quarantine
from capsulert.capsule_store.tiers import pkey
from capsulert.errors import (BudgetExceededError, CapsuleError, CapsuleInUseError, CapsuleIOError, ConfigError,
                              DuplicateCapsuleError, InvalidRequestError)
from capsulert.policies.base import TIERS

log = logging.getLogger(__name__)


class Persistence(BackgroundWrites):
    def __init__(self, **kw):
        super().__init__(**kw)
        disk_dir = self._disk_dir
        self._closed = False
        self._quarantined: list[QuarantinedFile] = []
        self._owner_lock = DirLock(disk_dir, "capsule store") if disk_dir is not None else None
        if disk_dir is not None:
            scan_capsule_files(disk_dir, clean=True)  # temp files of a dead previous owner's writes
            referenced = referenced_blocks(disk_dir)
            sweep_orphans(disk_dir, referenced)
            self._pools["disk"].external = referenced  # kept for the capsule files load(disk_dir) indexes

    @property
    def quarantined(self) -> list[QuarantinedFile]:
        """The capsule files this store set aside instead of loading (quarantine.py), oldest first."""
        with self._lock:
            return list(self._quarantined)

    def _reindex_disk(self) -> int:
        """Index the capsule files disk_dir holds (a previous owner's), in place, one at a time; the count
        indexed. See the module docstring."""
        directory = self._disk_dir
        files = list_capsule_files(directory) if directory is not None else []
        if not files:
            return 0
        if not self._usable("disk"):
            log.warning("capsule directory %s holds %d capsule file(s), but the disk tier is disabled (budget 0): "
                        "they are not indexed (load them with store.load)", directory, len(files))
            return 0
        verified: set[str] = set()  # block keys read and verified already (blocks are shared by files)
        found = []
        for p in files:
            try:
                meta, parts = read_capsule_parts(p, self.fingerprint, self.layout_version, have=frozenset(verified))
            except CapsuleError as e:  # corrupt, another model's, unreadable: set aside, go on with the rest
                self._set_aside(p, e)
                continue
            verified.update(parts.refs.all_keys if parts.refs is not None else ())
            found.append((p, meta, parts))
        found.sort(key=lambda f: f[1].created_at)  # the newest indexed last: the most recently used
        with self._lock:
            for p, meta, parts in found:
                key = (meta.namespace, meta.name)
                plan = self._new_plan()
                plan.enter("disk", tensor_nbytes(parts.own), parts.refs)
                try:
                    self._make_room(plan, "disk", frozenset({key}))
                except BudgetExceededError as e:  # pinned capsules fill the budget: nothing to drop for it
                    self._drop_unindexed(p, parts, e)
                    continue
                self._apply(plan)
                self._index_file(p, meta, parts)
            # what is left unreferenced: the block files of the files set aside or dropped
            sweep_orphans(directory, referenced_blocks(directory), "its capsule files were set aside or dropped")
            self._pools["disk"].external = Counter()  # every capsule file left is indexed
        log.info("capsule directory %s: indexed %d capsule file(s) left by a previous owner%s", directory,
                 len(found), f"; set aside {len(self._quarantined)}" if self._quarantined else "")
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
        self._counters["dropped"] += 1
        self._counters["dropped_bytes"] += tensor_nbytes(parts.own) + (parts.refs.nbytes if parts.refs else 0)
        log.warning("capsule file %s removed at start: the disk tier has no room for it (%s)", path, error)

    def _forget_external(self, refs) -> None:
        """A capsule file that will not be indexed no longer holds its blocks' files."""
        disk = self._pools["disk"]
        for k in refs.all_keys if refs is not None else ():
            if disk.external[k] > 0:
                disk.external[k] -= 1

    def _index_file(self, path: Path, meta, parts: Parts) -> None:
        """Index one verified capsule file of disk_dir in place, in the disk tier (room made by the caller)."""
        e = self._entry(meta, "disk", path, parts)
        self._ref("disk", e)
        disk = self._pools["disk"]
        for k in e.block_keys:
            rec = disk.records[k]
            rec.path = rec.path or path.parent / block_file_name(k)
            if disk.external[k] > 0:
                disk.external[k] -= 1  # its capsule file is indexed now: the reference is counted in rec.refs
        self._insert((meta.namespace, meta.name), e)

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
                    self._policy_of(e).on_remove(pkey(key))
                self._entries.clear()
                for pool in self._pools.values():
                    pool.clear()
                self._index.clear()
                self._used = {t: 0 for t in TIERS}
                self._closed = True
            if self._owner_lock is not None:
                self._owner_lock.release()

    def save(self, directory: str | Path) -> int:
        """Write every capsule (any tier) as a verified capsule file into `directory`, each block file once;
        returns the count. Refused: a file in the way, this store's own disk_dir, a directory another live
        store owns. Prefix-cache entries are not saved (the cache is rebuilt by use)."""
        directory = ensure_directory(directory, create=True)
        if self._is_disk_dir(directory):
            raise InvalidRequestError(f"{directory} is this store's disk_dir (its disk tier); save into another "
                                      "directory (load(disk_dir) re-indexes what is there)")
        lock = DirLock(directory, "store.save")  # DiskDirInUseError if a live store owns it
        try:
            with self._lock:
                self._check_open()
                written: set[str] = set()
                named = [e for e in self._entries.values() if not e.anonymous]
                for e in named:
                    parts, events = self._source(e)
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
        staged = [stage_block(directory, k, b) for k, b in parts.by_key().items() if k not in written]
        for s in staged:
            s.commit()
            written.add(s.final.name[:64])
        if staged:
            fsync_dir(directory)

    def load(self, directory: str | Path) -> int:
        """Load every capsule file in `directory`; all are verified first (block files included), and any
        bad file raises its typed error with nothing inserted. Temp files of interrupted writes are removed
        and logged (see tempfiles.py). From this store's own disk_dir the files are indexed in place, in the
        disk tier (the ones it already indexes are skipped); from anywhere else they are copied into the
        host tier (gpu if host is disabled), each block once, and a whole capsule whose file records this
        store's block origin (export_file) is cut into blocks, shared with the store's capsules of its prefix."""
        directory = Path(directory)
        with self._lock:
            self._check_open()
            if self._is_disk_dir(directory):
                return self._adopt(scan_capsule_files(directory, clean=True))
        files = scan_capsule_files(directory, clean=True)
        loaded = self._read_all(files, cut=True)
        tier = self._load_tier()
        keys = [(m.namespace, m.name) for m, _ in loaded]  # distinct: file names derive from them
        with self._lock:
            self._check_open()
            self._refuse_known(keys)
            plan = self._new_plan()
            for _, parts in loaded:
                plan.enter(tier, tensor_nbytes(parts.own), parts.refs)
            self._make_room(plan, tier, frozenset(keys))
            self._apply(plan)
            for meta, parts in loaded:
                self._insert_read(meta, parts, tier, pin=False)
            return len(loaded)

    def load_file(self, path: str | Path, *, pin: bool = False, replace: bool = False):
        """Load one capsule file, verified in full (its block files too), into the tier `load` uses, pinned
        when `pin`; its CapsuleMeta. A capsule of its name already held is DuplicateCapsuleError, or with
        `replace` is replaced (only once the file verified and room was found: a refusal changes nothing)."""
        [(meta, parts)] = self._read_all([Path(path)], cut=True)
        tier = self._load_tier()
        key = (meta.namespace, meta.name)
        with self._lock:
            self._check_open()
            old = self._entries.get(key)
            if old is not None and not replace:
                self._refuse_known([key])
            plan = self._new_plan()
            if old is not None:
                plan.leave(old.tier, old.own_nbytes, old.blocks)
            plan.enter(tier, tensor_nbytes(parts.own), parts.refs)
            self._make_room(plan, tier, frozenset({key}))
            if old is not None:
                if old.readers:
                    raise CapsuleInUseError(f"capsule {meta.name!r} is being read; it cannot be replaced now")
                self._remove(key, old)
            self._apply(plan)
            self._insert_read(meta, parts, tier, pin)
            return meta

    def _load_tier(self) -> str:
        tier = next((t for t in ("host", "gpu") if self._usable(t)), None)
        if tier is None:
            raise ConfigError("load needs the host or the gpu tier; both have budget 0")
        return tier

    def _insert_read(self, meta, parts: Parts, tier: str, pin: bool) -> None:
        """Insert a capsule read from a file into memory tier `tier` (room made by the caller)."""
        e = self._entry(meta, tier, None, parts)
        e.pinned = pin
        self._materialize(e, tier, parts.own, None, {k: (b, None) for k, b in parts.by_key().items()})
        self._insert((meta.namespace, meta.name), e)

    def _read_all(self, files: list[Path], cut: bool = False) -> list[tuple]:
        """Every capsule file read and verified in full, each block file once (capsules of a prefix share
        the tensors of its blocks). With `cut`, a whole capsule whose file records this store's block origin
        (one exported or persisted by a store of the same numerics) is cut into blocks like a put of it."""
        seen: dict[str, dict] = {}
        out = []
        for p in files:
            meta, parts = read_capsule_parts(p, self.fingerprint, self.layout_version, have=frozenset(seen))
            if cut and parts.refs is None and self._layout is not None and parts.origin == self._layout.origin:
                parts = split(meta, parts.own, self._layout, parts.origin)
            if parts.refs is not None:
                for k, b in parts.by_key().items():
                    seen.setdefault(k, b)  # type: ignore[arg-type]
                parts = Parts.of(parts.own, parts.refs, seen)
            out.append((meta, parts))
        return out

    @staticmethod
    def _entry(meta, tier: str, path: Path | None, parts: Parts) -> Entry:
        return Entry(meta, tier, None, path, False, time.time(), full_specs(tensor_specs(parts.own), parts.refs),
                     blocks=parts.refs)

    def _put(self, key: Key, meta, tensors: Mapping[str, torch.Tensor], tier: str, pin: bool, origin: str | None,
             anonymous: bool = False) -> Entry:
        """Insert a copy of `tensors` (cut into blocks when `origin` is the store's block origin) into
        `tier`, room made first (an anonymous entry only displaces other anonymous ones). Into disk the
        files are durable before it returns; a refusal changes nothing (caller holds the lock)."""
        parts = split(meta, tensors, self._layout, origin)
        own = tensor_nbytes(parts.own)
        plan, budget = self._new_plan(), self._budgets[tier]
        need = plan.added(tier, own, parts.refs)
        if budget is not None and need > budget:
            raise BudgetExceededError(f"a capsule of {need} bytes cannot fit tier {tier!r} (budget {budget})")
        plan.enter(tier, own, parts.refs)
        self._make_room(plan, tier, frozenset({key}), anon_only=anonymous)
        # a disk write is staged before any move, so a failed write (disk full) changes nothing
        staged = self._stage(meta, parts) if tier == "disk" else None
        e = Entry(meta, tier, None, None, pin, time.time(), tensor_specs(tensors), blocks=parts.refs,
                  anonymous=anonymous)
        try:
            self._apply(plan)
            if staged is not None:
                self._ref("disk", e)
                try:
                    self._settle_on_disk(e, staged)
                except BaseException:
                    self._unref("disk", e)
                    self._collect()
                    raise
            else:  # on the current stream: ordered after the work that wrote the caller's tensors
                self._materialize(e, tier, parts.own, None, {k: (b, None) for k, b in parts.by_key().items()},
                                  copy_stream=False, whole=tensors)
        except BaseException:
            if staged is not None:
                staged.discard()
            raise
        self._insert(key, e)
        return e

    @contextmanager
    def _reading(self, resolve: Callable[[], tuple[Key, Entry]]) -> Iterator[tuple[Entry, Parts, str]]:
        """The entry `resolve` names (called under the lock: a refusal there changes nothing), its parts
        on the device and the tier they were found in, with a read reference held: delete refuses and
        budget moves skip it meanwhile."""
        with self._lock:
            key, e = resolve()
            parts, found = self._acquire(key, e)
            e.readers += 1
        try:
            yield e, parts, found
        finally:
            with self._lock:
                e.readers -= 1

    def _refuse_known(self, keys: list[Key]) -> None:
        for k in keys:
            if k in self._entries:
                raise DuplicateCapsuleError(f"capsule {k[1]!r} in namespace {k[0]!r} already exists")

    def _insert(self, key: Key, e: Entry) -> None:
        """Index an entry whose bytes (and block references) its tier holds already."""
        self._entries[key] = e
        self._used[e.tier] += e.own_nbytes
        self._policy_of(e).on_insert(pkey(key), e.tier, e.meta.nbytes, e.meta.recompute_cost_s, e.pinned)
        self._index.add(key, e)

    def _adopt(self, files: list[Path]) -> int:
        """Index the capsule files of disk_dir that no entry holds, in place (caller holds the lock)."""
        self._require_usable("disk")
        held = {e.path for e in self._entries.values() if e.path is not None}
        new = [p for p in files if p not in held]
        found = [(p, meta, parts) for p, (meta, parts) in zip(new, self._read_all(new))]  # verified in full
        keys = [(m.namespace, m.name) for _, m, _ in found]
        self._refuse_known(keys)
        plan = self._new_plan()
        for _, _, parts in found:
            plan.enter("disk", tensor_nbytes(parts.own), parts.refs)
        self._make_room(plan, "disk", frozenset(keys))
        self._apply(plan)
        for p, meta, parts in found:
            self._index_file(p, meta, parts)
        return len(found)
