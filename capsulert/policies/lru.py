"""`lru`: least recently used per tier, among unpinned capsules; plus the bookkeeping base shared by
every shipped policy.

Recency is a logical clock (no wall time), advanced by on_insert, on_access and on_move: a capsule
that was just stored, read, promoted or demoted is the most recently used one of its tier. Pins do
not touch the clock in `lru`: pinning only takes a capsule out of the candidates (the store never
drops or demotes a pinned capsule; data loss is never a policy choice), so a capsule that sat pinned
and idle for a long time is the first victim of its tier once unpinned. `pinned_lru` differs there.

On access, a capsule that is not on the device tier is promoted to it (should_promote -> "device").
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from capsulert.policies.base import TIERS, CapsulePolicy, register_policy


@dataclass
class _Entry:
    """What a policy knows of one capsule: only facts the store told it, plus its own ranking."""

    tier: str
    nbytes: int
    cost: float
    pinned: bool
    last_used: int  # logical clock value of the last insert / access / move (/ pin in pinned_lru)
    h: float = 0.0  # GreedyDual-Size value; used by cost_aware only


def _check_tier(tier: str) -> None:
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; tiers are {TIERS}")


class _TrackingPolicy(CapsulePolicy):
    """Keeps name -> _Entry and a logical clock; subclasses rank victims via _victim_key and react to
    events through the _inserted/_accessed/_moved/_removed/_chose hooks (all no-ops here)."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._clock = 0

    # -- bookkeeping --------------------------------------------------------------------------
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _get(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(
                f"policy {self.name!r} does not know capsule {name!r}: the store must call "
                f"on_insert before any other call about it (and not after on_remove)"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    # -- CapsulePolicy ------------------------------------------------------------------------
    def on_insert(self, name: str, tier: str, nbytes: int, cost: float, pinned: bool) -> None:
        _check_tier(tier)
        if name in self._entries:
            raise ValueError(f"policy {self.name!r}: capsule {name!r} was already inserted")
        if nbytes < 0:
            raise ValueError(f"capsule {name!r}: nbytes must be >= 0, got {nbytes}")
        if not (math.isfinite(cost) and cost >= 0):
            raise ValueError(f"capsule {name!r}: cost must be a finite number >= 0, got {cost}")
        entry = _Entry(tier, int(nbytes), float(cost), bool(pinned), self._tick())
        self._entries[name] = entry
        self._inserted(name, entry)

    def on_access(self, name: str) -> None:
        entry = self._get(name)
        entry.last_used = self._tick()
        self._accessed(name, entry)

    def on_move(self, name: str, tier: str) -> None:
        _check_tier(tier)
        entry = self._get(name)
        old, entry.tier = entry.tier, tier
        entry.last_used = self._tick()
        self._moved(name, entry, old)

    def on_remove(self, name: str) -> None:
        entry = self._get(name)
        self._removed(name, entry)
        del self._entries[name]

    def pin(self, name: str) -> None:
        self._get(name).pinned = True

    def unpin(self, name: str) -> None:
        self._get(name).pinned = False

    def choose_victims(self, tier: str, nbytes_needed: int) -> list[str]:
        _check_tier(tier)
        if nbytes_needed <= 0:
            return []
        candidates = sorted(
            (n for n, e in self._entries.items() if e.tier == tier and not e.pinned),
            key=lambda n: self._victim_key(n, self._entries[n]),
        )
        victims: list[str] = []
        freed = 0
        for n in candidates:
            victims.append(n)
            freed += self._entries[n].nbytes
            if freed >= nbytes_needed:
                break
        self._chose(tier, victims)
        return victims

    def should_promote(self, name: str) -> str | None:
        return None if self._get(name).tier == "device" else "device"

    # -- hooks ----------------------------------------------------------------------------------
    def _victim_key(self, name: str, entry: _Entry) -> tuple:
        return (entry.last_used, name)

    def _inserted(self, name: str, entry: _Entry) -> None: ...

    def _accessed(self, name: str, entry: _Entry) -> None: ...

    def _moved(self, name: str, entry: _Entry, old_tier: str) -> None: ...

    def _removed(self, name: str, entry: _Entry) -> None: ...

    def _chose(self, tier: str, victims: list[str]) -> None: ...


@register_policy("lru")
class LRUPolicy(_TrackingPolicy):
    """Plain LRU per tier among unpinned capsules; pins do not affect recency."""
