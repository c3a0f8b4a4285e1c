"""The store's bookkeeping records: one Entry per capsule, and the Plan that simulates moves before any
is made (so a refusal changes nothing)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from capsulert.capsule_store.block_pool import BlockRecord
from capsulert.capsule_store.blocks import BlockRefs
from capsulert.capsule_store.capsule import CapsuleMeta, TensorSpec
from capsulert.capsule_store.writer import DiskJob

Key = tuple[str, str]  # (namespace, name); an anonymous prefix entry's name starts with ANON (never a valid name)
ANON = "#"
# a plan action's destination that removes a capsule's disk copy (Entry.disk_copy) and leaves it where it is
DROP_DISK_COPY = "drop disk copy"


@dataclass(eq=False)  # mutable on purpose: the store updates it in place under its lock as the capsule moves
class Entry:
    meta: CapsuleMeta
    tier: str
    tensors: dict[str, torch.Tensor] | None  # own tensors; None only when the bytes live in `path` alone
    path: Path | None  # the capsule file, once renamed into disk_dir
    pinned: bool
    last_used: float
    specs: Mapping[str, TensorSpec]  # shapes and dtypes of the whole tensors, for checks that must not move bytes
    readers: int = 0
    event: Any = None  # CUDA event of the last copy into `tensors`
    pending: DiskJob | None = None  # an async write to disk in flight; `tensors` serve reads until it is durable
    blocks: BlockRefs | None = None  # the prefix blocks it references (None: held whole in `tensors`)
    anonymous: bool = False  # a prefix-cache entry (no name a caller can use; never listed)
    held: dict[str, Any] | None = None  # key -> (tensors, event) of its blocks while its disk write is pending
    # in a memory tier, its file in disk_dir kept (a promotion out of disk copies, never moves): `path` and
    # its disk block references stay, counted in the disk tier, until a delete or a drop removes them
    disk_copy: bool = False

    @property
    def own_nbytes(self) -> int:
        """Bytes it holds alone (the state it does not share, KV rows past its blocks)."""
        return self.meta.nbytes - (self.blocks.nbytes if self.blocks is not None else 0)

    @property
    def block_keys(self) -> tuple[str, ...]:
        """Every block it references: KV blocks and its grid-state block."""
        return self.blocks.all_keys if self.blocks is not None else ()


class Plan:
    """A simulation of moves: where each touched capsule would be, bytes per tier, block references per
    tier (a block costs its bytes once per tier, however many capsules there reference it), and the
    ordered actions."""

    def __init__(self, used: dict[str, int], records: Callable[[str], Mapping[str, BlockRecord]]):
        self.where: dict[Key, str | None] = {}
        self.used = dict(used)
        self.actions: list[tuple[Key, str | None]] = []
        self._records = records  # a tier's blocks, each with the count of the references it has now
        self._refs: dict[tuple[str, str], int] = {}  # (tier, block key) -> references after the plan

    # enter, leave and added run once per block of a capsule (256 for a 16k one, on every snapshot): their
    # loops read the counts from one generator, without a method call per block
    def enter(self, tier: str, own: int, blocks: BlockRefs | None) -> int:
        """A capsule holding `own` bytes and referencing `blocks` would be in `tier`; the bytes that adds there
        (what `added` gave before)."""
        added = own + self._step(tier, blocks, 1)
        self.used[tier] += added
        return added

    def leave(self, tier: str, own: int, blocks: BlockRefs | None) -> None:
        self.used[tier] -= own + self._step(tier, blocks, -1)

    def _step(self, tier: str, blocks: BlockRefs | None, by: int) -> int:
        """Move each block's references in `tier` by `by`; the bytes of the blocks that gain their first
        reference (by 1) or lose their last (by -1)."""
        if blocks is None:
            return 0
        refs, edge = self._refs, 0 if by > 0 else 1
        moved = 0
        for k, n in self._counts(tier, blocks):
            refs[(tier, k)] = n + by
            if n == edge:
                moved += blocks.nbytes_of(k)
        return moved

    def added(self, tier: str, own: int, blocks: BlockRefs | None) -> int:
        """The bytes entering `tier` would add there now (blocks it already holds are free)."""
        if blocks is None:
            return own
        return own + sum(blocks.nbytes_of(k) for k, n in self._counts(tier, blocks) if n == 0)

    def _counts(self, tier: str, blocks: BlockRefs) -> Iterator[tuple[str, int]]:
        """Each block key with its references in `tier` as the plan has them (the pool's count where the plan
        has not touched it yet), read as the caller's loop reaches it."""
        refs, records = self._refs, self._records(tier)
        for k in blocks.all_keys:
            n = refs.get((tier, k))
            if n is None:
                rec = records.get(k)
                n = 0 if rec is None else rec.refs
            yield k, n

    def snapshot(self) -> tuple:
        return dict(self.where), dict(self.used), len(self.actions), dict(self._refs)

    def restore(self, snap: tuple) -> None:
        self.where, self.used, n, self._refs = dict(snap[0]), dict(snap[1]), snap[2], dict(snap[3])
        del self.actions[n:]
