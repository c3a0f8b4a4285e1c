"""The verbs of a worker as typed requests, and what they return, defined once.

The step scheduler executes these; the in-process async engine builds them from method calls, and the
Ray worker receives them as they are (plain frozen dataclasses pickle by value: no dispatch by method-name
strings). Sessions are named by integer ids the scheduler hands out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from capsulert.worker.sampler import SamplingParams

Tokens = Union[str, Sequence[int]]

STOP_REASONS = ("eos", "stop_token", "stop_string", "length", "max_seq", "interrupted")


# ---------------------------------------------------------------------- requests
@dataclass(frozen=True)
class Open:
    """A new session, optionally prefilled with `prompt`."""
    prompt: Tokens | None = None


@dataclass(frozen=True)
class Append:
    session: int
    tokens: Tokens


@dataclass(frozen=True)
class Generate:
    session: int
    max_new_tokens: int
    sampling: SamplingParams | None = None


@dataclass(frozen=True)
class Snapshot:
    session: int
    name: str
    tier: str = "device"
    pin: bool = False
    namespace: str = "default"


@dataclass(frozen=True)
class Restore:
    """Restore capsule `name` into a new session, or into `into` in place (rollback, episode reset)."""
    name: str
    namespace: str = "default"
    into: int | None = None


@dataclass(frozen=True)
class Fork:
    name: str
    n: int
    namespace: str = "default"


@dataclass(frozen=True)
class Close:
    session: int


@dataclass(frozen=True)
class Turn:
    """A chained turn in one round trip: [restore `restore` (into `session`, or a new session)], append
    `suffix`, generate; `close` closes the session afterwards."""
    session: int | None = None
    restore: str | None = None
    suffix: Tokens | None = None
    max_new_tokens: int = 0
    sampling: SamplingParams | None = None
    namespace: str = "default"
    close: bool = False


Request = Union[Open, Append, Generate, Snapshot, Restore, Fork, Close, Turn]


# ---------------------------------------------------------------------- results
@dataclass(frozen=True)
class SessionInfo:
    session: int
    length: int


class GenerateResult(list):
    """What a generate produced: the list of generated token ids itself (so it compares, slices and
    iterates as one), with

    - `logprobs[i]`: the raw model's log-probability of token i (log_softmax of the logits, before
      temperature / top-k / top-p), and `top_logprobs[i]`: the top-k (token, logprob) pairs when
      SamplingParams.logprobs = k;
    - `stop_reason`: eos, stop_token, stop_string, length, max_seq or interrupted;
    - `text`: the detokenized output, cut before a matched stop string (None without a tokenizer);
    - `length`: the session length afterwards; `session`: its id (scheduler / worker APIs);
    - `weights_version`: the engine's weights version the tokens were sampled under (update_weights)."""

    def __init__(self, tokens=(), logprobs=None, top_logprobs=None, stop_reason: str | None = None,
                 text: str | None = None, length: int = 0, session: int | None = None, weights_version: int = 0):
        super().__init__(tokens)
        self.logprobs: list[float] = list(logprobs or [])
        self.top_logprobs: list[list[tuple[int, float]]] = list(top_logprobs or [])
        self.stop_reason = stop_reason
        self.text = text
        self.length = length
        self.session = session
        self.weights_version = weights_version

    @property
    def tokens(self) -> list[int]:
        return self

    def __repr__(self) -> str:
        return (f"GenerateResult(tokens={list(self)!r}, stop_reason={self.stop_reason!r}, length={self.length}, "
                f"text={self.text!r})")


@dataclass(frozen=True)
class TokenEvent:
    """One produced token of a stream."""
    token: int
    logprob: float
    text: str | None  # the text this token completes (may be "" mid-character); None without a tokenizer
    index: int


@dataclass(frozen=True)
class FinalEvent:
    result: GenerateResult
