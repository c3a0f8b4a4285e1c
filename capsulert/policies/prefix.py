"""Admission of anonymous prefix entries (the prefix cache): keep a grid checkpoint, or not.

The store keeps anonymous entries within their byte cap, in the order of a CapsulePolicy (the engine's
`prefix_policy`, `cost_aware` by default: GreedyDual-Size over recompute cost per byte). A candidate that
fits the room left is kept. One that does not is kept only when the policy values it above every entry it
would displace: for `cost_aware` its value is L + recompute_s / new_bytes (L: the policy's inflation), so
a long prefix that adds few bytes (its blocks are shared already) wins over short, private ones, and a
cheap one never evicts what is expensive to recompute. A policy without values (`lru`) keeps the newest.
"""
from __future__ import annotations

from typing import Sequence

from capsulert.policies.base import CapsulePolicy


def admit(policy: CapsulePolicy, new_bytes: int, recompute_s: float, room: int | None,
          displaced: Sequence[str]) -> bool:
    """Whether to keep a candidate adding `new_bytes` that saves `recompute_s` per hit, given the `room` left
    under the cap (None: no cap) and the entries (policy names) it would displace."""
    if room is None or new_bytes <= room:
        return True
    value = getattr(policy, "value", None)
    if value is None:
        return True
    mine = getattr(policy, "inflation", 0.0) + recompute_s / max(new_bytes, 1)
    return all(mine > value(name) for name in displaced)
