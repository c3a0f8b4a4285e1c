"""The policy seam: the store asks a CapsulePolicy what to demote, drop or promote; it never decides itself.

Invariants every policy keeps (tested for each shipped policy):
- Pure Python and deterministic: the same sequence of calls gives the same decisions. No tensors, no I/O,
  no clocks (time is a logical counter advanced by the calls).
- The store tells the policy every fact it may decide on, through on_insert / on_access / on_move /
  on_remove / pin / unpin. The policy keeps its own bookkeeping of those facts and nothing else.
- choose_victims(tier, nbytes_needed) names only capsules that are currently in `tier`, each once, in the
  order the store should move them out; the store takes a prefix of that list until enough bytes are
  free. A policy that honours pins never names a pinned capsule. If even all candidates do not free
  enough, the policy returns them all and the store refuses (BudgetExceededError) without moving any.
- should_promote(name) is asked on access; it returns a faster tier to move the capsule to, or None.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

TIERS: tuple[str, ...] = ("device", "host", "disk")


class CapsulePolicy(ABC):
    name: str = "abstract"

    @abstractmethod
    def on_insert(self, name: str, tier: str, nbytes: int, cost: float, pinned: bool) -> None:
        """A capsule of nbytes entered `tier`; cost is its estimated recompute time in seconds."""

    @abstractmethod
    def on_access(self, name: str) -> None:
        """The capsule was read (restore, fork)."""

    @abstractmethod
    def on_move(self, name: str, tier: str) -> None:
        """The store moved the capsule to `tier` (promotion or demotion)."""

    @abstractmethod
    def on_remove(self, name: str) -> None:
        """The capsule left the store (deleted or dropped)."""

    @abstractmethod
    def pin(self, name: str) -> None: ...

    @abstractmethod
    def unpin(self, name: str) -> None: ...

    @abstractmethod
    def choose_victims(self, tier: str, nbytes_needed: int) -> list[str]:
        """Capsules to move out of `tier`, in order, to free at least nbytes_needed."""

    @abstractmethod
    def should_promote(self, name: str) -> str | None:
        """On access: the tier to promote the capsule to, or None to leave it where it is."""


_REGISTRY: dict[str, Callable[[], CapsulePolicy]] = {}


def register_policy(name: str) -> Callable[[type[CapsulePolicy]], type[CapsulePolicy]]:
    def deco(cls: type[CapsulePolicy]) -> type[CapsulePolicy]:
        if name in _REGISTRY:
            raise ValueError(f"policy {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def make_policy(policy: str | CapsulePolicy) -> CapsulePolicy:
    """A policy by registry name, or the user's own object passed through."""
    from capsulert.errors import ConfigError

    if isinstance(policy, CapsulePolicy):
        return policy
    if policy not in _REGISTRY:
        raise ConfigError(f"unknown policy {policy!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[policy]()


def registered_policies() -> list[str]:
    return sorted(_REGISTRY)
