"""The request bodies of the OpenAI-compatible API (pydantic, validated at the edge: a bad body is a 400
naming the field).

Fields of the OpenAI API that capsulert does not implement are accepted only at their neutral value
(`presence_penalty: 0`, `echo: false`, ...), so a client that sends its defaults works and one that asks
for the feature gets a clear 400 instead of silently different output. A field the API does not know at
all (`store`, `metadata`, a newer client's field) is accepted and ignored, with one warning per field name
per process (as vLLM does), so agent frameworks that send them are served.

Chat requests take `tools`, `tool_choice` (auto, none, required, or a named function: the last two
enforced by a grammar), `parallel_tool_calls` and `response_format` (text, json_object, json_schema);
see capsulert/chat.

Extensions (the openai client sends them through `extra_body`):
- `capsule`: start from this capsule of the caller's namespace; the prompt (or the rendered messages) is
  appended to its tokens (an empty prompt continues from the capsule as it is);
- `snapshot_as`, `pin`: keep the end state (prompt + completion) as a capsule of that name (n = 1);
- `return_token_ids`: each choice also carries `token_ids`, the generated token ids;
- `top_k`, `ignore_eos`, `stop_token_ids`: as in capsulert's SamplingParams;
- `speculate` (0..3), `speculate_drafter` ("ngram", "mtp"): speculative decode as in capsulert's
  SamplingParams; the output is bitwise the same as without (not with structured outputs, tools or a
  response_format: a 400);
- `structured_outputs` (as vLLM names it): exactly one of {"json": schema, "regex": ..., "grammar": Lark
  grammar (llguidance's dialect), "choice": [strings]}; the output follows it by construction.
"""
from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from capsulert.chat.formats import ResponseFormat, StructuredOutputs
from capsulert.protocol.conversation import RESERVED_TEMPLATE_VARIABLES
from capsulert.protocol.messages import ChatMessage, ToolChoice, ToolSpec
from capsulert.protocol.sampling import DEFAULT_DRAFTER, MAX_SPECULATE

log = logging.getLogger(__name__)

MAX_STOPS = 16
MAX_LOGPROBS = 20  # SamplingParams.logprobs' bound
_warned: set[str] = set()  # unknown field names already logged by this process


def warn_unknown_fields(names) -> None:
    """One warning per unknown field name per process: a client sends the same fields with every request."""
    for name in names:
        if name not in _warned:
            _warned.add(name)
            log.warning("ignoring request field %r: capsulert does not know it (logged once)", name)


class StreamOptions(BaseModel):
    """`tool_arguments` (an extension; chat completions with tools): "whole" (the default) sends each tool
    call in one delta once it is complete, and drops a call cut by max_tokens; "incremental" sends a call's
    name as soon as it is written and its arguments in pieces as they are generated (chat/tool_call_deltas.py),
    so a reply cut by max_tokens ends with finish_reason "length" and its last call may be partial."""
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False
    tool_arguments: Literal["whole", "incremental"] = "whole"


class _GenerationRequest(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)  # unknown fields: warned once, ignored

    model: str
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    user: str | None = None  # accepted and ignored: capsulert keeps no per-user records
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # extensions
    top_k: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    capsule: str | None = None
    snapshot_as: str | None = None
    pin: bool = False
    return_token_ids: bool = False
    structured_outputs: StructuredOutputs | None = None
    speculate: int = Field(0, ge=0, le=MAX_SPECULATE)
    speculate_drafter: str = DEFAULT_DRAFTER

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float, info) -> float:
        if v != 0.0:
            raise ValueError(f"{info.field_name} is not supported (only 0)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    @model_validator(mode="after")
    def _one_snapshot(self):
        if self.pin and self.snapshot_as is None:
            raise ValueError("pin applies to the capsule snapshot_as names; give snapshot_as")
        if self.snapshot_as is not None and self.n != 1:
            raise ValueError("snapshot_as keeps the end state of one choice: use n = 1")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream = true")
        if self.model_extra:
            warn_unknown_fields(self.model_extra)
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def tool_arguments_incremental(self) -> bool:
        return self.stream_options is not None and self.stream_options.tool_arguments == "incremental"

    def sampling(self, logprobs: int) -> dict[str, Any]:
        """SamplingParams fields (without seed: each choice gets its own); OpenAI's default temperature is 1."""
        return dict(temperature=1.0 if self.temperature is None else self.temperature,
                    top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k, stop=self.stops,
                    stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos, logprobs=logprobs,
                    speculate=self.speculate, speculate_drafter=self.speculate_drafter)


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _neutral(self):
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (only best_of = n)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be an empty list")
        if self.tool_arguments_incremental:
            raise ValueError("stream_options.tool_arguments applies to chat completions (completions have no tools)")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of a batch request, one or more; each is text or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool = True
    # extensions (as vLLM names them)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _neutral(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs = true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree")
        reserved = RESERVED_TEMPLATE_VARIABLES & set(self.chat_template_kwargs or {})
        if reserved:
            raise ValueError(f"chat_template_kwargs cannot set {sorted(reserved)}")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
