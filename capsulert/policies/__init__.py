"""Pluggable pinning, promotion and eviction policies for the capsule store (ABC + registry)."""
from capsulert.policies import cost_aware, lru, pinned_lru  # noqa: F401  (import registers them)
from capsulert.policies.base import (
    TIERS,
    CapsulePolicy,
    make_policy,
    register_policy,
    registered_policies,
)
from capsulert.policies.cost_aware import CostAwarePolicy
from capsulert.policies.lru import LRUPolicy
from capsulert.policies.pinned_lru import PinnedLRUPolicy

__all__ = [
    "TIERS",
    "CapsulePolicy",
    "CostAwarePolicy",
    "LRUPolicy",
    "PinnedLRUPolicy",
    "make_policy",
    "register_policy",
    "registered_policies",
]
