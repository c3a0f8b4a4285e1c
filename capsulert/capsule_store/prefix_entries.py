"""PrefixEntries: the store's side of automatic prefix reuse (the engine's side is engine/prefix_reuse.py).

An anonymous prefix entry is a grid checkpoint kept without a name: the blocks of its prefix (shared with
every capsule of that prefix) and its state at the grid point. It lives in the fastest usable memory tier
(never on disk, never demoted: under pressure it is dropped), is never listed nor saved, and is evicted
before any named capsule; the bytes anonymous entries hold alone are capped (`prefix_bytes`) and within
the cap admission is cost-aware (policies/prefix.py). `match_prefix` finds the deepest checkpoint, named
or anonymous, on a prompt's path (prefix_index.py); `reading_prefix` reads it like a restore reads a
capsule. Keys carry the namespace, so one namespace's entries never match another's prompt.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, Mapping

import torch

from capsulert.capsule_store.access import EntryAccess
from capsulert.capsule_store.blocks import Parts, chain_seed, split
from capsulert.capsule_store.capsule import CapsuleMeta, tensor_nbytes
from capsulert.capsule_store.moves import Mover
from capsulert.capsule_store.plan import ANON, Entry
from capsulert.capsule_store.prefix_index import PrefixMatch
from capsulert.capsule_store.tiers import MEMORY_TIERS, RANK, TierBook, pkey
from capsulert.errors import BudgetExceededError, UnknownCapsuleError
from capsulert.policies.prefix import admit


class PrefixEntries:
    def __init__(self, tiers: TierBook, mover: Mover, access: EntryAccess, lock: threading.RLock, *,
                 layout_version: int, prefix_bytes: int | None = 0):
        self._tiers, self._mover, self._access, self._lock = tiers, mover, access, lock
        self._layout, self._layout_version = tiers.layout, layout_version
        self._prefix_cap = prefix_bytes

    @property
    def block_origin(self) -> str | None:
        """The numerics whose capsules the store cuts into blocks and indexes (None: it cuts none)."""
        return self._layout.origin if self._layout is not None else None

    @property
    def prefix_enabled(self) -> bool:
        return self._layout is not None and self._prefix_cap != 0

    # -- lookups ----------------------------------------------------------------------------------
    def match_prefix(self, namespace: str, fingerprint: str, tokens: list[int], rows: int, *,
                     after: int = 0, count: bool = True) -> PrefixMatch:
        """The deepest grid checkpoint past `after` tokens on the path of `tokens` in `namespace` under
        model `fingerprint` and prefill chunk `rows` (one ending exactly at len(tokens) must be complete),
        and how far the store's blocks follow the path. count=False: not a prompt's lookup (a replay
        snapshot looking for a shared state), kept out of the prefix cache's counters."""
        if self._layout is None:
            return PrefixMatch()
        keys = self._tiers.chains.keys(chain_seed(namespace, fingerprint, self._layout_version, rows,
                                                  self._layout.origin), tokens, rows)
        tiers = self._tiers
        with self._lock:
            tiers.check_open()
            tiers.prefix_counters["lookups"] += count
            held, at = tiers.index.walk(keys)
            best = None
            for depth in sorted(at, reverse=True):
                grid = depth * rows
                if grid <= after:
                    break
                ok = [k for k in at[depth] if grid < len(tokens) or tiers.index.complete(tiers.entries[k])]
                if ok:
                    best = grid, min(ok, key=lambda k: (RANK[tiers.entries[k].tier], k))
                    break
            return PrefixMatch(grid=best[0] if best else 0, key=best[1] if best else None, shared=held * rows,
                               checkpoints=frozenset(d * rows for d in at))

    @contextmanager
    def reading_prefix(self, match: PrefixMatch, start: int = 0, count: bool = True) -> Iterator[tuple[CapsuleMeta, Parts]]:
        """The checkpoint `match` found, on the device, with a read reference held (as `reading_parts`);
        UnknownCapsuleError when it left the store since the match. `start`: tokens the reader holds
        already (counted out of the hit's tokens)."""
        def resolve():
            e = self._tiers.entries.get(match.key) if match.key is not None else None  # type: ignore[arg-type]
            if e is None:
                raise UnknownCapsuleError("the prefix checkpoint left the store since it was matched")
            if count:
                self._tiers.prefix_counters["hits"] += 1
                self._tiers.prefix_counters["hit_tokens"] += match.grid - start
            return match.key, e

        with self._access.reading(resolve) as (e, parts, _):
            yield e.meta, parts

    # -- keeping ----------------------------------------------------------------------------------
    def keep_prefix(self, meta: CapsuleMeta, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Keep a grid checkpoint of the store's own origin as an anonymous entry (meta.boundary ==
        meta.grid_pos; the tensors as a capsule's); whether it was kept. Refused when the prefix cache is
        off, the checkpoint exists, the admission policy declines it, or no room can be made without
        touching named capsules."""
        tier = next((t for t in MEMORY_TIERS if self._tiers.usable(t)), None)
        if not self.prefix_enabled or tier is None:
            return False
        parts = split(meta, tensors, self._layout, self.block_origin, self._tiers.chains)
        if parts.refs is None or not parts.refs.keys or parts.refs.grid != meta.boundary:
            return False
        key = (meta.namespace, ANON + parts.refs.keys[-1])
        own = tensor_nbytes(parts.own)
        with self._lock:
            self._tiers.check_open()
            if key in self._tiers.entries or self._tiers.index.has_checkpoint(parts.refs.keys[-1]):
                return False
            new = self._tiers.new_plan().added(tier, own, parts.refs)
            room = None if self._prefix_cap is None else self._prefix_cap - self._tiers.anon_nbytes()
            displaced = self._tiers.anon_policy.choose_victims(tier, new - room) if room is not None and new > room else []
            if not admit(self._tiers.anon_policy, new, meta.recompute_cost_s, room, displaced) \
                    or not self._cap_room(tier, own, parts):
                self._tiers.prefix_counters["refused"] += 1
                return False
            try:
                self._access.put(key, meta, tensors, tier, False, self.block_origin, anonymous=True)
            except BudgetExceededError:
                self._tiers.prefix_counters["refused"] += 1
                return False
            self._tiers.prefix_counters["kept"] += 1
            return True

    def _cap_room(self, tier: str, own: int, parts: Parts) -> bool:
        """Drop anonymous entries (the policy's victims) until the candidate fits the cap; whether it does."""
        if self._prefix_cap is None:
            return True
        seen: set[str] = set()
        while self._tiers.anon_nbytes() + self._tiers.new_plan().added(tier, own, parts.refs) > self._prefix_cap:
            need = self._tiers.anon_nbytes() + self._tiers.new_plan().added(tier, own, parts.refs) - self._prefix_cap
            victims = [pk for pk in self._tiers.anon_policy.choose_victims(tier, need) if pk not in seen]
            key = next((k for k in (tuple(pk.split("/", 1)) for pk in victims)
                        if k in self._tiers.entries and not self._tiers.entries[k].readers), None)  # type: ignore[misc]
            if key is None:
                return False
            seen.add(pkey(key))  # type: ignore[arg-type]
            self._mover.drop(key, self._tiers.entries[key])  # type: ignore[index]
            self._mover.collect()
        return True

    def stats(self) -> dict:
        anon = [e for e in self._tiers.entries.values() if e.anonymous]
        return {"entries": len(anon), "bytes": self._tiers.anon_nbytes() if anon else 0, "cap": self._prefix_cap,
                **self._tiers.prefix_counters}

    def anonymous_entries(self) -> list[Entry]:
        """The anonymous entries (for tests and the benchmark: read-only)."""
        with self._lock:
            return [e for e in self._tiers.entries.values() if e.anonymous]
