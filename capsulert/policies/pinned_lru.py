"""`pinned_lru` (the default policy): LRU per tier among unpinned capsules, with pins as part of the
ranking, not only a filter.

Like `lru`, a pinned capsule is never named as a victim, and on access a capsule not on gpu is
promoted to gpu. The difference: here pin() and unpin() count as a use (they advance the logical
clock and refresh the capsule's recency). Under plain `lru` a capsule that sat pinned and idle for a
long time is, the moment it is unpinned, the oldest of its tier and the first to be dropped or
demoted; under `pinned_lru` it leaves its pin as the most recently used capsule of its tier, and so
gets a full LRU lifetime before it can become a victim. That suits the intended use of pins (a system
prompt or a shared prefix held for a job): releasing one should not evict it straight away.
"""
from __future__ import annotations

from capsulert.policies.base import register_policy
from capsulert.policies.lru import _TrackingPolicy


@register_policy("pinned_lru")
class PinnedLRUPolicy(_TrackingPolicy):
    """LRU among unpinned capsules; pin() and unpin() refresh recency."""

    def pin(self, name: str) -> None:
        entry = self._get(name)
        entry.pinned = True
        entry.last_used = self._tick()

    def unpin(self, name: str) -> None:
        entry = self._get(name)
        entry.pinned = False
        entry.last_used = self._tick()
