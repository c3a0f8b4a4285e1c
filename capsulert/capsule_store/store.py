"""CapsuleStore: capsules in three tiers (device = the engine device's memory, host = pinned memory, disk = files),
with byte budgets, moves between tiers, and a policy that names victims. A capsule of the store's own
origin is held as prefix blocks shared by reference with every capsule of the same prefix (blocks.py,
block_pool.py: the KV blocks [0, G) and the grid-state block, its recurrent and conv state at G) plus its
own tensors; anonymous prefix entries and the prefix index serve
automatic prefix reuse (prefix_entries.py, prefix_index.py).

The store holds its parts, each made once here and given only what it needs (the store's one RLock is
shared): the books and the planner (tiers.py: entries, bytes per tier, budgets, policies, prefix index),
the mover that acts on a plan (moves.py), the background writes of cascade demotions (background.py),
how entries come in and are read (access.py), the disk directory it owns (disk_dir.py), save and load
(persistence.py) and the anonymous prefix entries (prefix_entries.py). Every capsule byte layout is
format/'s.

A store owns its disk_dir: it holds the directory's owner lock while it lives (owner.py), so no other
store or orchestrator writes there, and its index of disk capsules is exactly the capsule files there.
`load(disk_dir)` re-indexes, in place, the capsule files a previous owner left (after a crash, say);
`load` of any other directory copies its capsules into memory. Both sweep stale temp files first.
"""
from __future__ import annotations

import threading
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

from capsulert.capsule_store.access import EntryAccess
from capsulert.capsule_store.background import BackgroundWrites
from capsulert.capsule_store.blocks import BlockLayout, Parts
from capsulert.capsule_store.capsule import (CapsuleInfo, CapsuleMeta, CapsuleRef, TensorSpec, model_of,
                                             tensor_nbytes, validate_name)
from capsulert.capsule_store.disk_dir import DiskDirectory
from capsulert.capsule_store.format.disk import write_capsule_with_meta
from capsulert.capsule_store.moves import Mover
from capsulert.capsule_store.owner import ensure_directory
from capsulert.capsule_store.persistence import Persistence
from capsulert.capsule_store.plan import Entry
from capsulert.capsule_store.prefix_entries import PrefixEntries
from capsulert.capsule_store.prefix_index import PrefixMatch
from capsulert.capsule_store.quarantine import QuarantinedFile
from capsulert.capsule_store.tiers import RANK, TierBook, check_budget, pkey, tier_name
from capsulert.errors import (CapsuleInUseError, DuplicateCapsuleError, IncompatibleCapsuleError,
                              InvalidRequestError)
from capsulert.policies.base import TIERS, CapsulePolicy
from capsulert.protocol.names import DEFAULT_NAMESPACE

ReadCheck = Callable[[CapsuleMeta, Mapping[str, TensorSpec]], None]


class CapsuleStore:
    def __init__(self, *, device: torch.device | str, fingerprint: str, layout_version: int,
                 budgets: dict[str, int | None] | None = None, disk_dir: str | Path | None = None,
                 policy: str | CapsulePolicy = "pinned_lru", blocks: BlockLayout | None = None,
                 prefix_policy: str | CapsulePolicy = "cost_aware", prefix_bytes: int | None = 0,
                 reindex: bool = True):
        """`blocks`: how to cut the capsules of `put(..., origin=blocks.origin)` into shared prefix blocks
        (None: every capsule is held whole, as it comes). `prefix_bytes`: the most bytes anonymous prefix
        entries may hold alone (0: no prefix cache; None: bounded by the tier budgets only), kept and
        evicted in the order of `prefix_policy`. `reindex`: index the capsule files disk_dir holds now (a
        previous owner's), in the disk tier; False leaves them for an explicit load(disk_dir)."""
        self.device = torch.device(device)
        self.fingerprint, self.layout_version = fingerprint, layout_version
        ident = dict(fingerprint=fingerprint, layout_version=layout_version)
        self._lock = threading.RLock()
        self._tiers = TierBook(budgets=budgets, policy=policy, blocks=blocks, prefix_policy=prefix_policy,
                               disk_dir=ensure_directory(disk_dir, create=True) if disk_dir is not None else None)
        self._writes = BackgroundWrites(self._tiers, self._lock)
        self._mover = Mover(self._tiers, self._writes, device=self.device, **ident)
        self._access = EntryAccess(self._tiers, self._mover, self._lock)
        self._disk = DiskDirectory(self._tiers, self._mover, self._lock, **ident)  # takes disk_dir's owner lock
        self._persistence = Persistence(self._tiers, self._mover, self._access, self._disk, self._lock, **ident)
        self._prefix = PrefixEntries(self._tiers, self._mover, self._access, self._lock,
                                     layout_version=layout_version, prefix_bytes=prefix_bytes)
        self.reindexed = self._disk.reindex() if reindex else 0  # capsule files of disk_dir indexed at start

    @property
    def policy(self) -> CapsulePolicy:
        return self._tiers.policy

    @property
    def disk_dir(self) -> Path | None:
        return self._tiers.disk_dir

    @property
    def pending_writes(self) -> int:
        """Background disk writes not finished yet (budget-cascade demotions)."""
        return self._writes.pending

    @property
    def quarantined(self) -> list[QuarantinedFile]:
        """The capsule files this store set aside instead of loading (quarantine.py), oldest first."""
        return self._disk.quarantined

    @property
    def block_origin(self) -> str | None:
        """The numerics whose capsules the store cuts into blocks and indexes (None: it cuts none)."""
        return self._prefix.block_origin

    @property
    def prefix_enabled(self) -> bool:
        return self._prefix.prefix_enabled

    # -- capsules ---------------------------------------------------------------------------------
    def put(self, meta: CapsuleMeta, tensors: dict[str, torch.Tensor], *, tier: str = "device",
            pin: bool = False, origin: str | None = None) -> CapsuleRef:
        """Store a copy of `tensors` (never aliases them) as capsule meta.name in `tier`. Into disk the
        write is synchronous: the file is durable when put returns. `origin`: the numerics that computed
        the bytes; when it is the store's block origin the capsule is cut into prefix blocks shared with
        every capsule of the same prefix (an engine passes it for its own snapshots; others stay whole)."""
        tier = tier_name(tier)
        key = (validate_name(meta.namespace, "namespace"), validate_name(meta.name))
        # the model must match; the weights version may be older (the engine refuses those as stale)
        if model_of(meta.fingerprint) != model_of(self.fingerprint) or meta.layout_version != self.layout_version:
            raise IncompatibleCapsuleError(
                f"capsule {meta.name!r} is for model {meta.fingerprint!r} layout {meta.layout_version}; this "
                f"store serves {self.fingerprint!r} layout {self.layout_version}")
        n = tensor_nbytes(tensors)
        if n != meta.nbytes:
            raise ValueError(f"capsule {meta.name!r}: meta.nbytes={meta.nbytes} but the tensors hold {n} bytes")
        with self._lock:
            self._tiers.check_open()
            self._tiers.require_usable(tier)
            if key in self._tiers.entries:
                raise DuplicateCapsuleError(f"capsule {meta.name!r} already exists in namespace "
                                            f"{meta.namespace!r}; capsules are immutable: delete it first")
            self._access.put(key, meta, tensors, tier, bool(pin), origin if origin == self.block_origin else None)
            return CapsuleRef(meta.name, meta.namespace, tier, n, meta.boundary)

    def get(self, name: str, namespace: str = DEFAULT_NAMESPACE) -> tuple[CapsuleMeta, dict[str, torch.Tensor]]:
        """The capsule's tensors on `device` (promoted to gpu first), each in one piece (a capsule held as
        prefix blocks is assembled: a copy). Treat them as read-only."""
        with self._lock:
            key, e = self._tiers.lookup(name, namespace)
            return e.meta, self._mover.acquire(key, e)[0].full()

    @contextmanager
    def reading(self, name: str, namespace: str = DEFAULT_NAMESPACE, check: ReadCheck | None = None,
                ) -> Iterator[tuple[CapsuleMeta, dict[str, torch.Tensor]]]:
        """Like get, holding a read reference for the block: delete refuses, budget moves skip it.
        `check(meta, specs)` runs first, before any tier move: a read it refuses changes nothing."""
        with self.reading_tier(name, namespace, check) as (meta, tensors, _):
            yield meta, tensors

    @contextmanager
    def reading_tier(self, name: str, namespace: str = DEFAULT_NAMESPACE, check: ReadCheck | None = None,
                     ) -> Iterator[tuple[CapsuleMeta, dict[str, torch.Tensor], str]]:
        """`reading`, also yielding the tier the capsule was read from: where this read found it (gpu, host
        or disk), before any promotion the read made."""
        with self.reading_parts(name, namespace, check) as (meta, parts, found):
            yield meta, parts.full(), found

    @contextmanager
    def reading_parts(self, name: str, namespace: str = DEFAULT_NAMESPACE, check: ReadCheck | None = None,
                      ) -> Iterator[tuple[CapsuleMeta, Parts, str]]:
        """`reading_tier` with the capsule as the store holds it: own tensors and its blocks' tensors (no
        assembling copy; a restore writes each piece into place)."""
        def resolve():
            key, e = self._tiers.lookup(name, namespace)
            if check is not None:
                check(e.meta, e.specs)
            return key, e

        with self._access.reading(resolve) as (e, parts, found):
            yield e.meta, parts, found

    def export_file(self, name: str, directory: str | Path, namespace: str = DEFAULT_NAMESPACE) -> Path:
        """Write the capsule as one self-contained capsule file (format 1: every tensor whole, no block
        files) into `directory`, crash-safely; its path. A canonical capsule's file records its origin, so a
        store of the same origin that loads it (`load`, or `put` with the origin `read_capsule_origin`
        returns) shares its blocks again; a file without an origin is held whole."""
        with self.reading_parts(name, namespace) as (meta, parts, _):
            return write_capsule_with_meta(directory, meta, parts.full(), origin=parts.origin)[0]

    def contains(self, name: str, namespace: str = DEFAULT_NAMESPACE) -> bool:
        with self._lock:
            return (validate_name(namespace, "namespace"), validate_name(name)) in self._tiers.entries

    def _info(self, e: Entry) -> CapsuleInfo:
        return CapsuleInfo(e.meta, e.tier, e.pinned, e.last_used, own_nbytes=e.own_nbytes,
                           blocks=len(e.block_keys), on_disk=e.tier == "disk" or e.disk_copy)

    def info(self, name: str, namespace: str = DEFAULT_NAMESPACE) -> CapsuleInfo:
        with self._lock:
            return self._info(self._tiers.lookup(name, namespace)[1])

    def list(self, namespace: str | None = None) -> list[CapsuleInfo]:
        with self._lock:
            if namespace is not None:
                validate_name(namespace, "namespace")
            return [self._info(self._tiers.entries[k]) for k in sorted(self._tiers.entries)
                    if (namespace is None or k[0] == namespace) and not self._tiers.entries[k].anonymous]

    # -- moves ------------------------------------------------------------------------------------
    def promote(self, name: str, tier: str, namespace: str = DEFAULT_NAMESPACE) -> None:
        tier = tier_name(tier)
        with self._lock:
            key, e = self._tiers.lookup(name, namespace)
            self._tiers.require_usable(tier)
            if RANK[tier] > RANK[e.tier]:
                raise InvalidRequestError(f"cannot promote {name!r} from {e.tier!r} to slower tier {tier!r}; use demote")
            if tier != e.tier:
                self._mover.promote(key, tier)

    def prefetch(self, name: str, tier: str = "device", namespace: str = DEFAULT_NAMESPACE) -> None:
        """Start promoting toward `tier`; returns once queued (CUDA) or done (CPU). The bookkeeping moves at
        once, so a second prefetch while the copy is in flight finds it there and copies nothing."""
        tier = tier_name(tier)
        with self._lock:
            key, e = self._tiers.lookup(name, namespace)
            self._tiers.require_usable(tier)
            if RANK[tier] < RANK[e.tier]:
                self._mover.promote(key, tier)

    def demote(self, name: str, tier: str | None = None, namespace: str = DEFAULT_NAMESPACE) -> None:
        """Move to a slower tier (None: the next usable slower one), making room there per policy. Into
        disk the write is synchronous: the file is durable when demote returns."""
        tier = tier_name(tier)
        with self._lock:
            key, e = self._tiers.lookup(name, namespace)
            if tier is None:
                tier = next((t for t in TIERS[RANK[e.tier] + 1:] if self._tiers.usable(t)), None)
                if tier is None:
                    raise InvalidRequestError(f"capsule {name!r} is in {e.tier!r}; no usable slower tier (delete it instead)")
            self._tiers.require_usable(tier)
            if RANK[tier] < RANK[e.tier]:
                raise InvalidRequestError(f"cannot demote {name!r} from {e.tier!r} to faster tier {tier!r}; use promote")
            if tier == e.tier:
                if tier == "disk" and e.path is None:  # a background write in flight (or failed): finish it now
                    self._mover.settle_on_disk(e, self._mover.stage_entry(e))
                return
            if e.readers:
                raise CapsuleInUseError(f"capsule {name!r} is being read; demote it after the restore ends")
            plan = self._tiers.plan_to(key, tier)
            # written before any move (a capsule promoted out of disk has its file there still)
            staged = {key: self._mover.stage_entry(e)} if tier == "disk" and not e.disk_copy else None
            try:
                self._mover.apply(plan, staged=staged)
            except BaseException:
                for s in (staged or {}).values():
                    s.discard()
                raise

    def pin(self, name: str, namespace: str = DEFAULT_NAMESPACE) -> None:
        """A pinned capsule is never dropped nor moved out by budget pressure (it counts in budgets)."""
        self._set_pin(name, namespace, True)

    def unpin(self, name: str, namespace: str = DEFAULT_NAMESPACE) -> None:
        self._set_pin(name, namespace, False)

    def _set_pin(self, name: str, namespace: str, flag: bool) -> None:
        with self._lock:
            key, e = self._tiers.lookup(name, namespace)
            e.pinned = flag
            (self._tiers.policy.pin if flag else self._tiers.policy.unpin)(pkey(key))

    def delete(self, name: str, namespace: str = DEFAULT_NAMESPACE) -> None:
        with self._lock:
            key, e = self._tiers.lookup(name, namespace)
            if e.readers:
                raise CapsuleInUseError(f"capsule {name!r} is being read by {e.readers} restore(s); retry after")
            self._mover.remove(key, e)  # its blocks stay while another capsule of the tier references them
            self._mover.collect()

    def set_budget(self, tier: str, nbytes: int | None) -> None:
        """Change a tier's budget; shrinking moves capsules out at once (or refuses, changing nothing)."""
        tier = tier_name(tier)
        check_budget(tier, nbytes)
        with self._lock:
            self._mover.apply(self._tiers.plan_budget(tier, nbytes))

    def stats(self) -> dict:
        """Bytes, budget and count per tier, and the counters: hits, misses, promotions, demotions,
        dropped (unpinned capsules dropped because every slower tier was full; `evictions` is the same
        count under its older name), dropped_bytes, disk_write_errors (failed background writes), quarantined (capsule files set aside
        instead of loaded: `quarantined` lists them).
        A tier's bytes are what it holds: own tensors plus each prefix block once (`blocks`: how many per
        tier, KV and grid-state blocks); `count` counts named capsules. `prefix`: the prefix cache (engine/prefix_reuse.py)."""
        tiers = self._tiers
        with self._lock:
            out: dict = {t: {"bytes": tiers.used[t], "budget": tiers.budgets[t],
                             "count": sum(1 for e in tiers.entries.values() if e.tier == t and not e.anonymous)}
                         for t in TIERS}
            out.update(tiers.counters)
            out["blocks"] = {t: sum(1 for r in tiers.pools[t].records.values() if r.refs) for t in TIERS}
            out["prefix"] = self._prefix.stats()
            out["quarantined"] = len(self._disk.quarantined)
            return out

    # -- durability, save and load (persistence.py, disk_dir.py) -------------------------------------
    def flush(self, timeout: float | None = None) -> None:
        """Wait until every background disk write is durable; CapsuleIOError if one failed since the
        last flush (those capsules stay readable from memory) or on timeout."""
        self._writes.flush(timeout)

    def close(self, flush: bool = True) -> None:
        """Let go of every capsule and of disk_dir's owner lock (files already written stay for a later
        load). flush=False cancels background writes instead of waiting, as a crash would."""
        try:
            if flush and not self._tiers.closed:
                self.flush()
        finally:
            with self._lock:
                self._tiers.close()
            self._disk.release()

    def save(self, directory: str | Path) -> int:
        return self._persistence.save(directory)

    def load(self, directory: str | Path) -> int:
        return self._persistence.load(directory)

    def load_file(self, path: str | Path, *, pin: bool = False, replace: bool = False) -> CapsuleMeta:
        return self._persistence.load_file(path, pin=pin, replace=replace)

    # -- the prefix cache (prefix_entries.py) ---------------------------------------------------------
    def match_prefix(self, namespace: str, fingerprint: str, tokens: list[int], rows: int, *,
                     after: int = 0, count: bool = True) -> PrefixMatch:
        return self._prefix.match_prefix(namespace, fingerprint, tokens, rows, after=after, count=count)

    def reading_prefix(self, match: PrefixMatch, start: int = 0, count: bool = True,
                       ) -> AbstractContextManager[tuple[CapsuleMeta, Parts]]:
        """The checkpoint `match` found, on the device, with a read reference held (prefix_entries.py)."""
        return self._prefix.reading_prefix(match, start, count)

    def keep_prefix(self, meta: CapsuleMeta, tensors: Mapping[str, torch.Tensor]) -> bool:
        return self._prefix.keep_prefix(meta, tensors)

    def anonymous_entries(self) -> list[Entry]:
        """The anonymous entries (for tests and the benchmark: read-only)."""
        return self._prefix.anonymous_entries()
