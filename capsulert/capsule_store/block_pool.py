"""The blocks one tier holds, each once, with a count of the capsules in that tier that reference it.

A memory tier (gpu, host) holds a block's tensors; the disk tier holds its file (once renamed into place).
A capsule in a tier holds one reference to each of its blocks there, so a block lives in a tier exactly as
long as some capsule of that tier needs it: a pinned capsule pins its blocks. When the last reference
goes, the block is released at the end of the store verb (collect()), not at once: a plan of moves may
drop one capsule and, later in the same plan, bring in another that references the same block, which
then finds it still there (for the disk tier: a file another capsule file may depend on is never
unlinked early).

Bytes: a block counts in its tier's bytes while it has references. `anon_refs` counts the references of
anonymous prefix entries, so the bytes anonymous entries hold alone are known (their cap).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from capsulert.capsule_store.blocks import SlabRow


@dataclass(eq=False)  # mutable on purpose: counted up and down under the store's lock
class BlockRecord:
    nbytes: int
    tensors: dict[str, torch.Tensor] | None = None  # memory tiers
    event: Any = None  # CUDA event of the copy that filled `tensors`
    path: Path | None = None  # disk tier: the block file, once renamed into place
    refs: int = 0
    anon_refs: int = 0
    slab: SlabRow | None = None  # memory tiers: where the block lives (a restore copies slab runs, not blocks)

    def block_tensors(self) -> dict[str, torch.Tensor] | None:
        """The block's tensors in a memory tier; for a block in a slab, views of its row made when first asked
        for (a snapshot makes none: a restore copies slab runs, and most blocks are never read one by one)."""
        if self.tensors is None and self.slab is not None:
            self.tensors = {n: t[self.slab.index] for n, t in self.slab.slabs.items()}
        return self.tensors


class BlockPool:
    """The blocks of one tier."""

    def __init__(self, tier: str):
        self.tier = tier
        self.records: dict[str, BlockRecord] = {}
        self.external: Counter[str] = Counter()  # disk: references from capsule files not indexed (yet)

    def get(self, key: str) -> BlockRecord | None:
        return self.records.get(key)

    def add(self, key: str, rec: BlockRecord) -> BlockRecord:
        """Hold a new block (no references yet); an existing record wins."""
        return self.records.setdefault(key, rec)

    def add_many(self, items: Iterable[tuple[str, BlockRecord]]) -> None:
        """`add` of each (key, record): a 16k capsule's snapshot adds 256 blocks."""
        add = self.records.setdefault
        for key, rec in items:
            add(key, rec)

    def missing(self, keys: Sequence[str]) -> list[int]:
        """The indices of the keys the pool holds no block for, in order."""
        records = self.records
        return [i for i, k in enumerate(keys) if k not in records]

    def ref(self, keys: Iterable[str], anon: bool) -> int:
        """Reference blocks the pool holds, once each; the bytes this adds to the tier. One loop with no call
        per block: a 16k capsule has 256 of them, referenced on every snapshot."""
        records, added = self.records, 0
        for key in keys:
            rec = records[key]
            rec.refs += 1
            rec.anon_refs += anon
            if rec.refs == 1:
                added += rec.nbytes
        return added

    def unref(self, keys: Iterable[str], anon: bool) -> int:
        """Drop a reference to each block; the bytes this frees in the tier (released at collect())."""
        records, freed = self.records, 0
        for key in keys:
            rec = records[key]
            rec.refs -= 1
            rec.anon_refs -= anon
            if rec.refs == 0:
                freed += rec.nbytes
        return freed

    def anon_only_nbytes(self) -> int:
        """Bytes of the blocks only anonymous entries reference."""
        return sum(r.nbytes for r in self.records.values() if r.refs and r.refs == r.anon_refs)

    def unreferenced(self) -> list[tuple[str, BlockRecord]]:
        return [(k, r) for k, r in self.records.items() if r.refs == 0]

    def collect(self) -> list[tuple[str, BlockRecord]]:
        """Forget the blocks nothing references; returns them (the disk tier unlinks their files, unless a
        capsule file not indexed yet references them)."""
        gone = [(k, r) for k, r in self.records.items() if r.refs == 0]
        for k, _ in gone:
            del self.records[k]
        return [(k, r) for k, r in gone if not self.external[k]]

    def clear(self) -> None:
        self.records.clear()
