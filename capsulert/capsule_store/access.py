"""EntryAccess: how an entry comes into the store (put: a copy of the caller's tensors; insert_read: the
bytes of a file just read) and how it is read (reading: its parts on the device, with a read reference
held so delete refuses and budget moves skip it meanwhile)."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

from capsulert.capsule_store.blocks import Parts, full_specs, split
from capsulert.capsule_store.capsule import CapsuleMeta, tensor_nbytes, tensor_specs
from capsulert.capsule_store.moves import Mover
from capsulert.capsule_store.plan import Entry, Key
from capsulert.capsule_store.tiers import TierBook
from capsulert.errors import BudgetExceededError


def entry_of(meta: CapsuleMeta, tier: str, path: Path | None, parts: Parts) -> Entry:
    """A new entry for the parts of a capsule read from a file (not yet in any tier's books)."""
    return Entry(meta, tier, None, path, False, time.time(), full_specs(tensor_specs(parts.own), parts.refs),
                 blocks=parts.refs)


class EntryAccess:
    def __init__(self, tiers: TierBook, mover: Mover, lock: threading.RLock):
        self._tiers, self._mover, self._lock = tiers, mover, lock

    def put(self, key: Key, meta: CapsuleMeta, tensors: Mapping[str, torch.Tensor], tier: str, pin: bool,
            origin: str | None, anonymous: bool = False) -> Entry:
        """Insert a copy of `tensors` (cut into blocks when `origin` is the store's block origin) into
        `tier`, room made first (an anonymous entry only displaces other anonymous ones). Into disk the
        files are durable before it returns; a refusal changes nothing (caller holds the lock)."""
        tiers, mover = self._tiers, self._mover
        parts = split(meta, tensors, tiers.layout, origin, tiers.chains)
        own = tensor_nbytes(parts.own)
        plan, budget = tiers.new_plan(), tiers.budgets[tier]
        need = plan.enter(tier, own, parts.refs)
        if budget is not None and need > budget:
            raise BudgetExceededError(f"a capsule of {need} bytes cannot fit tier {tier!r} (budget {budget})")
        tiers.make_room(plan, tier, frozenset({key}), anon_only=anonymous)
        # a disk write is staged before any move, so a failed write (disk full) changes nothing
        staged = mover.stage(meta, parts) if tier == "disk" else None
        e = Entry(meta, tier, None, None, pin, time.time(), tensor_specs(tensors), blocks=parts.refs,
                  anonymous=anonymous)
        try:
            mover.apply(plan)
            if staged is not None:
                tiers.ref("disk", e)
                try:
                    mover.settle_on_disk(e, staged)
                except BaseException:
                    tiers.unref("disk", e)
                    mover.collect()
                    raise
            else:  # on the current stream: ordered after the work that wrote the caller's tensors. The KV
                # slabs are copied from `tensors` whole, so of the blocks only the grid-state one is read
                refs = parts.refs
                state = {refs.state: (parts.state, None)} if refs is not None and refs.state is not None else {}
                mover.materialize(e, tier, parts.own, None, state, copy_stream=False, whole=tensors)
        except BaseException:
            if staged is not None:
                staged.discard()
            raise
        tiers.insert(key, e)
        return e

    def insert_read(self, meta: CapsuleMeta, parts: Parts, tier: str, pin: bool) -> None:
        """Insert a capsule read from a file into memory tier `tier` (room made by the caller)."""
        e = entry_of(meta, tier, None, parts)
        e.pinned = pin
        self._mover.materialize(e, tier, parts.own, None, {k: (b, None) for k, b in parts.by_key().items()})
        self._tiers.insert((meta.namespace, meta.name), e)

    @contextmanager
    def reading(self, resolve: Callable[[], tuple[Key, Entry]]) -> Iterator[tuple[Entry, Parts, str]]:
        """The entry `resolve` names (called under the lock: a refusal there changes nothing), its parts
        on the device and the tier they were found in, with a read reference held: delete refuses and
        budget moves skip it meanwhile."""
        with self._lock:
            key, e = resolve()
            parts, found = self._mover.acquire(key, e)
            e.readers += 1
        try:
            yield e, parts, found
        finally:
            with self._lock:
                e.readers -= 1
