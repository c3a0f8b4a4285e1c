"""The Python chat API's OpenAI arguments (`engine.chat(messages, max_tokens, temperature=0.7, ...)`), checked
once: each is honoured, or refused with an InvalidRequestError naming it. An argument the API does not know
is refused too (chat-template variables go in `template_vars`, never among these).

Defaults, and where they differ from the HTTP server's:
- max_tokens: DEFAULT_MAX_TOKENS, the same as `capsulert serve`'s `--max-tokens` default;
- temperature: 0 (greedy) here, 1 over HTTP. The HTTP default is OpenAI's, which clients assume; the Python
  API is the library's, whose callers (RL loops, tests, evaluations) want a reply they can reproduce unless
  they ask for sampling. Every other field has OpenAI's default in both.
- n: 1 only here (one session, one reply: fork a session for branches, or use the server's `n`).
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from capsulert.errors import InvalidRequestError
from capsulert.protocol.checks import sampling_params
from capsulert.protocol.sampling import DEFAULT_MAX_TOKENS, SamplingParams

# the SamplingParams fields the OpenAI arguments set (refused next to a whole `sampling`)
_SAMPLING_FIELDS = ("temperature", "top_p", "seed", "stop", "logprobs", "top_logprobs")


class ChatOptions(BaseModel):
    """The OpenAI arguments of one Python chat turn (besides messages, tools and the formats)."""
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    max_tokens: StrictInt | None = Field(None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    n: StrictInt = Field(1, ge=1, le=1, description="one reply per call: fork a session for more")
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    sampling: Any = None  # SamplingParams, a dict of its fields, or None (checked by sampling_params)

    @classmethod
    def of(cls, **given: Any) -> "ChatOptions":
        try:
            return cls(**given)
        except ValidationError as e:
            raise InvalidRequestError(_message(e)) from None

    @property
    def token_limit(self) -> int:
        return DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens

    def sampling_params(self) -> SamplingParams:
        """`sampling` (SamplingParams or a dict of its fields), or the one the OpenAI fields describe; both
        given: refused, naming the fields."""
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=True")
        fields = {k: getattr(self, k) for k in _SAMPLING_FIELDS
                  if getattr(self, k) not in (None, False)}
        if self.sampling is not None:
            if fields:
                raise InvalidRequestError(f"give sampling or {sorted(fields)}, not both")
            return sampling_params(self.sampling)
        stop = fields.get("stop")
        return SamplingParams(temperature=0.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed,
                              stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
                              logprobs=self.top_logprobs or 0)


def _message(e: ValidationError) -> str:
    problems = []
    for err in e.errors(include_url=False):
        name = ".".join(map(str, err["loc"])) or "value"
        if err["type"] == "extra_forbidden":
            problems.append(f"unknown chat argument {name!r} (chat-template variables go in template_vars=)")
        elif name == "n":
            problems.append("n: the Python chat API makes one reply per call (n=1); fork a session for more")
        else:
            problems.append(f"{name}: {err['msg']}")
    return "; ".join(problems)
