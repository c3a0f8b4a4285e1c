"""`cost_aware`: GreedyDual-Size. Keep what is expensive to recompute per byte.

Each capsule has a value H = L + cost / nbytes (cost: the store's recompute-time estimate, which
grows with the prefix length P; nbytes counted as at least 1). L is the policy's inflation value.
On insert and on access H is set to L + cost / nbytes. Victims of a tier are the unpinned capsules of
that tier in order of lowest H, ties broken by older logical time, then by name (deterministic).

Aging: when a capsule that choose_victims named actually leaves that tier (the store demotes it to a
slower tier or drops it), L rises to that capsule's H (L never decreases; one L for all tiers). New and
re-accessed capsules are then valued above L, so a capsule that is expensive per byte but never used
again is eventually overtaken and becomes a victim. A plain delete of a capsule that was not named as
a victim, and a promotion, do not change L.

Pinned capsules are never victims; on access a capsule not on gpu is promoted to gpu.
"""
from __future__ import annotations

from capsulert.policies.base import TIERS, register_policy
from capsulert.policies.lru import _Entry, _TrackingPolicy


@register_policy("cost_aware")
class CostAwarePolicy(_TrackingPolicy):
    """GreedyDual-Size over recompute cost per byte."""

    def __init__(self) -> None:
        super().__init__()
        self._inflation = 0.0
        # per tier: the names the last choose_victims(tier, ...) returned and that have not left yet
        self._pending: dict[str, set[str]] = {t: set() for t in TIERS}

    @property
    def inflation(self) -> float:
        """The current L."""
        return self._inflation

    def value(self, name: str) -> float:
        """The capsule's current H."""
        return self._get(name).h

    def _refresh(self, entry: _Entry) -> None:
        entry.h = self._inflation + entry.cost / max(entry.nbytes, 1)

    def _evicted(self, name: str, entry: _Entry, tier: str) -> None:
        self._pending[tier].discard(name)
        self._inflation = max(self._inflation, entry.h)

    def _victim_key(self, name: str, entry: _Entry) -> tuple:
        return (entry.h, entry.last_used, name)

    def _inserted(self, name: str, entry: _Entry) -> None:
        self._refresh(entry)

    def _accessed(self, name: str, entry: _Entry) -> None:
        self._refresh(entry)

    def _moved(self, name: str, entry: _Entry, old_tier: str) -> None:
        if name in self._pending[old_tier]:
            if TIERS.index(entry.tier) > TIERS.index(old_tier):
                self._evicted(name, entry, old_tier)
            else:
                self._pending[old_tier].discard(name)

    def _removed(self, name: str, entry: _Entry) -> None:
        if name in self._pending[entry.tier]:
            self._evicted(name, entry, entry.tier)

    def _chose(self, tier: str, victims: list[str]) -> None:
        self._pending[tier] = set(victims)
