"""From a validated request body to a Plan: prompts tokenized here, the chat template rendered, limits
checked, sampling parameters validated before any worker is asked for anything."""
from __future__ import annotations

from dataclasses import dataclass

from capsulert.capsule_store import validate_name
from capsulert.chat.formats import format_constraint
from capsulert.chat.prompt import ChatRenderer
from capsulert.chat.turn import ChatTurn
from capsulert.errors import InvalidRequestError, UnknownCapsuleError
from capsulert.serve.generation import RESERVED_PREFIX, Plan, check_client_name
from capsulert.serve.http_errors import MODEL_NOT_FOUND, ApiError
from capsulert.serve.protocol import ChatCompletionRequest, CompletionRequest, _GenerationRequest
from capsulert.serve.token_text import TokenText


@dataclass(frozen=True)
class Limits:
    model_name: str
    max_seq: int
    largest_n: int


def _check(body: _GenerationRequest, limits: Limits) -> None:
    if body.model != limits.model_name:
        raise ApiError(MODEL_NOT_FOUND,
                       f"model {body.model!r} is not served here; this server serves {limits.model_name!r}", "model")
    if body.n > limits.largest_n:
        raise InvalidRequestError(f"n = {body.n} is more than this server's limit of {limits.largest_n}")
    if body.capsule is not None:
        validate_name(body.capsule)
        if body.capsule.startswith(RESERVED_PREFIX):  # the server's own capsules are invisible
            raise UnknownCapsuleError(f"no capsule {body.capsule!r} in this namespace")
    if body.snapshot_as is not None:
        validate_name(body.snapshot_as)
        check_client_name(body.snapshot_as, "snapshot_as")


def _plan(body: _GenerationRequest, prompts: list[list[int]], max_tokens: int, logprobs: int,
          constraint=None, parse_tools: bool = False) -> Plan:
    if body.capsule is None and any(not p for p in prompts):
        raise InvalidRequestError("the prompt is empty (an empty prompt continues a `capsule`)")
    sampling = body.sampling(logprobs)
    if constraint is not None:
        sampling["constraint"] = constraint
    # SamplingParams refuses bad values now, as a 400
    return Plan.of(tuple(tuple(p) for p in prompts), body.n, max_tokens, sampling, body.seed, capsule=body.capsule,
                   snapshot_as=body.snapshot_as, pin=body.pin, parse_tools=parse_tools)


def completion_plan(body: CompletionRequest, limits: Limits, tokens: TokenText) -> Plan:
    _check(body, limits)
    prompts = [tokens.encode(p) if isinstance(p, str) and p else
               [] if isinstance(p, str) else tokens.check_ids(list(p)) for p in body.prompts]
    if body.snapshot_as is not None and len(prompts) > 1:
        raise InvalidRequestError("snapshot_as keeps the end state of one choice: send one prompt")
    max_tokens = limits.max_seq if body.max_tokens is None else body.max_tokens
    return _plan(body, prompts, max_tokens, body.logprobs or 0, format_constraint(None, body.structured_outputs))


def chat_plan(body: ChatCompletionRequest, limits: Limits, tokens: TokenText, chat: ChatRenderer) -> Plan:
    """The conversation rendered by the checkpoint's template and its tool_choice / response_format
    constraint, planned by the same ChatTurn the Python chat API uses."""
    _check(body, limits)
    if tokens.tokenizer is None:
        raise InvalidRequestError("the served model has no tokenizer: use /v1/completions with token ids")
    turn = ChatTurn.plan(body.messages, tools=body.tools,
                         tool_choice=body.tool_choice or ("auto" if body.tools else "none"),
                         response_format=body.response_format, parallel_tool_calls=body.parallel_tool_calls,
                         structured_outputs=body.structured_outputs, add_generation_prompt=body.add_generation_prompt,
                         template_vars=body.chat_template_kwargs)
    prompt = chat.encode(turn.prompt)
    limit = body.token_limit
    max_tokens = limits.max_seq if limit is None else limit  # no limit: until EOS or max_seq
    return _plan(body, [prompt], max_tokens, (body.top_logprobs or 0) if body.logprobs else 0,
                 turn.sampling.constraint, turn.parse_tools)


def completion_logprobs(body: CompletionRequest) -> int | None:
    return body.logprobs


def chat_logprobs(body: ChatCompletionRequest) -> int | None:
    return (body.top_logprobs or 0) if body.logprobs else None
