"""The drafter seam: a speculating generate asks a Drafter for the tokens that may follow the one it just
sampled; verification (engine/decoding.py, ModelRunner.verify) decides which of them plain decode would have
produced. Drafts only ever decide how many tokens a step commits, never which: a bad drafter costs speed,
never exactness.

Invariants every drafter keeps (tested for each shipped one):
- `propose` returns one list per request, in order, of at most `request.k` token ids, each in
  [0, vocab_size); fewer (or none) is allowed: the step then verifies fewer.
- It leaves no trace in state a session commits: it may read the runner's state set, never write the slots'
  buffers (an MTP head drafts from scratch state the runner keeps for that).
- It holds no per-session state that a restore, fork or rollback would have to move: what it needs comes in
  the request (the session's tokens, its slot).

Drafters are registered by name (`register_drafter`), the way policies are; an engine makes one instance per
name on first use (`Drafters`), and a caller may install a configured instance under its name (the oracle of
tests and benchmarks, given the streams it proposes).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from capsulert.errors import InvalidRequestError


class DraftSource(Protocol):
    """What a drafter may read of the runner (ModelRunner is one)."""
    model_cfg: object

    @property
    def has_mtp(self) -> bool: ...

    def mtp_draft(self, slots: Sequence[int], tokens: Sequence[int], k: int) -> Any: ...


@dataclass(frozen=True)
class DraftRequest:
    """One session's draft: its slot, its tokens up to and including the token sampled last (not yet fed to
    the model), and the most drafts the step can verify."""
    slot: int
    tokens: Sequence[int]
    k: int


class Drafter(ABC):
    name: str = "abstract"

    def check(self, runner: DraftSource) -> None:
        """Refuse (InvalidRequestError) a generate this drafter cannot serve on this runner, before it starts."""

    @abstractmethod
    def propose(self, runner: DraftSource, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """For each request, the tokens that may follow `request.tokens` (at most request.k)."""


_REGISTRY: dict[str, Callable[[], Drafter]] = {}


def register_drafter(name: str) -> Callable[[type[Drafter]], type[Drafter]]:
    def deco(cls: type[Drafter]) -> type[Drafter]:
        if name in _REGISTRY:
            raise ValueError(f"drafter {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def registered_drafters() -> list[str]:
    return sorted(_REGISTRY)


def make_drafter(name: str) -> Drafter:
    """A drafter by registry name; InvalidRequestError for an unknown one (a request names it)."""
    if name not in _REGISTRY:
        raise InvalidRequestError(f"unknown speculate_drafter {name!r}; registered: {registered_drafters()}")
    return _REGISTRY[name]()


class Drafters:
    """An engine's drafter instances, one per name, made on first use; `install` puts a configured one in
    place of its name's."""

    def __init__(self) -> None:
        self._made: dict[str, Drafter] = {}

    def get(self, name: str) -> Drafter:
        if name not in self._made:
            self._made[name] = make_drafter(name)
        return self._made[name]

    def install(self, drafter: Drafter) -> None:
        if not isinstance(drafter, Drafter) or drafter.name not in _REGISTRY:
            raise InvalidRequestError(f"install takes an instance of a registered drafter; registered: "
                                      f"{registered_drafters()}")
        self._made[drafter.name] = drafter
