"""What the verbs return (protocol/requests.py): plain data every layer passes on as it is."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STOP_REASONS = ("eos", "stop_token", "stop_string", "length", "max_seq", "interrupted", "grammar_end",
                "weights_updated")


@dataclass(frozen=True)
class CapsuleExport:
    """A capsule in transit between workers (ExportCapsule's reply, ImportCapsule's payload): its metadata
    JSON, the checksum of its tensors, the tensors as safetensors bytes, and its block origin: the numerics
    that computed a canonical capsule (None for one that is not), so a worker of the same origin can share
    its KV blocks with its own capsules of the same prefix."""
    meta_json: str
    checksum: str
    blob: bytes
    origin: str | None = None


@dataclass(frozen=True)
class SessionInfo:
    """A session's id and length after a request; `logits`: its next-token logits (a float32 numpy array)
    when the request asked for them (Append(logits=True)); `restored_from`: after a Restore or Fork, the
    tier the capsule was read from (see GenerateResult)."""
    session: int
    length: int
    logits: Any = field(default=None, compare=False)
    restored_from: str | None = None


class GenerateResult(list):
    """What a generate produced: the list of generated token ids itself (so it compares, slices and
    iterates as one), with

    - `logprobs[i]`: the raw model's log-probability of token i (log_softmax of the logits, before
      temperature / top-k / top-p), and `top_logprobs[i]`: the top-k (token, logprob) pairs when
      SamplingParams.logprobs = k;
    - `stop_reason`: eos, stop_token, stop_string, length, max_seq, interrupted, grammar_end (the
      output completed its SamplingParams.constraint, which can take no more tokens), or weights_updated
      (an update_weights landed between two of its steps: it ended there, its session stale);
    - `text`: the detokenized output, cut before a matched stop string (None without a tokenizer);
    - `length`: the session length afterwards; `session`: its id (scheduler / worker APIs);
    - `weights_version`: the weights version every one of its tokens was sampled under (a generate never
      spans an update_weights: it ends with stop reason weights_updated instead);
    - `cached_tokens`: prompt tokens the request restored from the prefix cache instead of prefilling
      (EngineConfig.prefix_cache);
    - `restored_from`: when the request restored a capsule (a Turn with `restore`), the tier it was read
      from: "device" (the engine device's memory), "host" or "disk", where the restore found it (before the promotion the
      read may make); None when it restored nothing; `restore_s`: the seconds the worker spent on that
      restore (None without one);
    - `drafted`, `accepted`: with SamplingParams.speculate, the drafted tokens its steps verified and how many
      of them it committed (accepted / drafted is the drafter's acceptance rate); 0 without."""

    def __init__(self, tokens=(), logprobs=None, top_logprobs=None, stop_reason: str | None = None,
                 text: str | None = None, length: int = 0, session: int | None = None, weights_version: int = 0,
                 restored_from: str | None = None, cached_tokens: int = 0, restore_s: float | None = None,
                 drafted: int = 0, accepted: int = 0):
        super().__init__(tokens)
        self.logprobs: list[float] = list(logprobs or [])
        self.top_logprobs: list[list[tuple[int, float]]] = list(top_logprobs or [])
        self.stop_reason = stop_reason
        self.text = text
        self.length = length
        self.session = session
        self.weights_version = weights_version
        self.restored_from = restored_from
        self.cached_tokens = cached_tokens
        self.restore_s = restore_s
        self.drafted = drafted
        self.accepted = accepted

    @property
    def tokens(self) -> list[int]:
        return self

    def __repr__(self) -> str:
        return (f"GenerateResult(tokens={list(self)!r}, stop_reason={self.stop_reason!r}, length={self.length}, "
                f"text={self.text!r})")


@dataclass(frozen=True)
class TokenEvent:
    """One produced token of a stream; `top_logprobs`: the top-k (token, logprob) pairs of its position
    when SamplingParams.logprobs = k, best first (the same row as GenerateResult.top_logprobs[index]).
    The texts of a stream's events add up to its GenerateResult.text: a character a token leaves
    incomplete, and text that may be the start of a stop string, are held back until decided; nothing of
    a matched stop string is shown; the last event releases whatever is held (an incomplete character as
    U+FFFD, the decoder's mark for it, when the output ends inside one)."""
    token: int
    logprob: float
    text: str | None  # the text this token completes (may be "" mid-character); None without a tokenizer
    index: int
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class FinalEvent:
    result: GenerateResult
