"""SamplingParams: how a generate draws its tokens and when it stops, checked once when made."""
from __future__ import annotations

from pydantic import (AliasChoices, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError,
                      field_validator, model_validator)

from capsulert.errors import InvalidRequestError
from capsulert.protocol.constraint import Constraint

# top_k at or above the vocabulary size keeps every token; beyond an int32 a value means nothing (refused)
MAX_TOP_K = (1 << 31) - 1
# temperatures below this are treated as greedy: dividing logits by them overflows to inf (vLLM: 1e-5)
GREEDY_BELOW = 1e-5
_MASK64 = (1 << 64) - 1
# a chat turn's (and a server request's) max_tokens when it gives none: the Python chat API's default and
# `capsulert serve --max-tokens`'s (chat/options.py, config/server.py)
DEFAULT_MAX_TOKENS = 1024
# seed -1 is "no seed" (a fresh random one), as vLLM reads it
NO_SEED = -1
# the most drafted tokens one speculative step verifies (the method's MTP chain runs K = 3)
MAX_SPECULATE = 3
# the drafter a speculating generate uses when it names none: prompt lookup needs no weights and works on any
# model; the MTP head drafts only on a checkpoint that has one
DEFAULT_DRAFTER = "ngram"


class SamplingParams(BaseModel):
    """temperature 0 (or below 1e-5) means greedy (argmax); otherwise sample from the temperature-scaled,
    top-k / top-p filtered distribution. `seed` fixes the session's random stream (None, or -1 as vLLM
    takes it: a fresh random seed per generate call).

    Stops: every EOS id of the model's config.json / generation_config.json stops a generate unless
    `ignore_eos`; so does any id in `stop_token_ids`, and any string in `stop` once it appears in the
    incrementally detokenized output (its tokens stay committed in the session; the result's text ends
    before it). `logprobs=k` adds the top-k logprobs of every position to the result. `constraint` makes
    the output follow a grammar (a JSON schema, any JSON object, a regex or a Lark grammar; see Constraint):
    tokens outside it are never drawn, and the generate stops ("grammar_end") once the grammar is complete.

    `speculate=k` (0..3; 0, the default, is plain decode) drafts up to k tokens after each sampled one with
    the drafter named by `speculate_drafter` (default "ngram": prompt lookup in the session's own tokens;
    "mtp": the model's MTP head, on a checkpoint that has one; "oracle": tests and benchmarks) and verifies
    them in one step with decode's own numerics: the output (tokens, logprobs, stop reasons, and the
    session's state after it) is bitwise what plain decode gives, only fewer steps make it. A constraint
    cannot be combined with speculation yet (refused)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    temperature: float = Field(0.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_k: StrictInt = Field(0, ge=0, le=MAX_TOP_K)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: StrictInt | None = Field(None, ge=0, lt=1 << 63)
    stop_token_ids: tuple[StrictInt, ...] = Field((), validation_alias=AliasChoices("stop_token_ids", "stop_tokens"))
    stop: tuple[str, ...] = ()
    ignore_eos: StrictBool = False
    logprobs: StrictInt = Field(0, ge=0, le=20)
    constraint: Constraint | None = None
    speculate: StrictInt = Field(0, ge=0, le=MAX_SPECULATE)
    speculate_drafter: StrictStr = Field(DEFAULT_DRAFTER, min_length=1, max_length=64, pattern=r"^[a-z0-9_.-]+$")

    def __init__(self, **data):
        for key in ("temperature", "top_p"):
            if isinstance(data.get(key), bool):
                raise InvalidRequestError(f"invalid SamplingParams: {key}: expected a number, got a bool")
        if type(data.get("seed")) is int and data["seed"] == NO_SEED:
            data = {**data, "seed": None}
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise InvalidRequestError(f"invalid SamplingParams: {_short(e)}") from None

    @field_validator("stop")
    @classmethod
    def _nonempty_stops(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(not x for x in v):
            raise ValueError("stop strings must be non-empty")
        for x in v:  # matched on decoded text, which never holds a lone surrogate: such a stop never matches
            try:
                x.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"stop string {x!r:.40} is not valid Unicode ({e.reason} at index {e.start})") from None
        return v

    @model_validator(mode="after")
    def _speculation_without_grammar(self) -> "SamplingParams":
        # a constrained row's mask depends on the grammar state after every earlier draft: verifying k drafts
        # would need the matcher rolled back with the state; refused rather than diverging from plain decode
        if self.speculate and self.constraint is not None:
            raise ValueError("speculate > 0 cannot be combined with a constraint (yet): use speculate=0")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


GREEDY = SamplingParams()


def _short(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'value'}: {err['msg']}" for err in e.errors())
