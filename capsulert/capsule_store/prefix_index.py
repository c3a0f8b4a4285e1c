"""The prefix index: a trie over block keys, kept beside the store's entries.

A block key names the whole token prefix up to its block's end (blocks.py chains them), so a key is a trie
node and the trie needs no pointers: a lookup hashes a new prompt block by block and probes the map,
stopping at the first key nobody holds (every capsule holding block i also holds blocks 0..i-1). At a node
the index lists the entries that carry a grid checkpoint there: the recurrent and conv state at the node's
grid point G, with the blocks [0, G) the KV rows. Those are the entries whose last block ends at their grid
point: named capsules (on or off the grid) and anonymous prefix entries. Only entries of the store's own
origin (the numerics of its engine) are indexed: their state is canonical, a pure function of the tokens,
so a checkpoint found by key is bitwise what a cold prefill of the prefix computes.

A checkpoint is *complete* when it also holds the last hidden state at G (an on-grid capsule that has the
layout's `complete` tensor); only a complete one can serve a prompt that ends exactly at G (its next-token
logits come from that state). Any checkpoint serves a longer prompt (the prefill that follows rewrites it).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from capsulert.capsule_store.blocks import BlockLayout
from capsulert.capsule_store.plan import Entry, Key


@dataclass(frozen=True)
class PrefixMatch:
    """The longest checkpoint on a prompt's path, and how far the store's blocks follow that path."""

    grid: int = 0  # tokens the chosen checkpoint covers (0: none)
    key: Key | None = None  # the entry holding it
    shared: int = 0  # tokens covered by blocks the store holds along the path (>= grid)
    checkpoints: frozenset[int] = frozenset()  # every grid point on the path that has a checkpoint


class PrefixIndex:
    def __init__(self, layout: BlockLayout | None):
        self._layout = layout
        self._at: dict[str, set[Key]] = {}  # block key -> entries with a checkpoint at its end
        self._blocks: Counter[str] = Counter()  # block key -> indexed entries referencing it

    def indexed(self, e: Entry) -> bool:
        return self._layout is not None and e.blocks is not None and bool(e.blocks.keys) \
            and e.blocks.origin == self._layout.origin

    def complete(self, e: Entry) -> bool:
        return e.blocks is not None and e.meta.boundary == e.blocks.grid and \
            self._layout is not None and self._layout.complete in e.specs

    def add(self, key: Key, e: Entry) -> None:
        if self.indexed(e):
            self._blocks.update(e.blocks.keys)  # type: ignore[union-attr]
            self._at.setdefault(e.blocks.keys[-1], set()).add(key)  # type: ignore[union-attr]

    def remove(self, key: Key, e: Entry) -> None:
        if not self.indexed(e):
            return
        self._blocks.subtract(e.blocks.keys)  # type: ignore[union-attr]
        for k in e.blocks.keys:  # type: ignore[union-attr]
            if self._blocks[k] <= 0:
                del self._blocks[k]
        at = self._at.get(e.blocks.keys[-1])  # type: ignore[union-attr]
        if at is not None:
            at.discard(key)
            if not at:
                del self._at[e.blocks.keys[-1]]  # type: ignore[union-attr]

    def walk(self, keys: list[str]) -> tuple[int, dict[int, set[Key]]]:
        """How many of `keys` (a prompt's block keys, in order) the index holds, and the checkpoints at
        each depth (depth d: after d blocks)."""
        held, at = 0, {}
        for d, k in enumerate(keys, 1):
            if not self._blocks[k]:
                break
            held = d
            if self._at.get(k):
                at[d] = set(self._at[k])
        return held, at

    def has_checkpoint(self, last_key: str) -> bool:
        return bool(self._at.get(last_key))

    def clear(self) -> None:
        self._at.clear()
        self._blocks.clear()
