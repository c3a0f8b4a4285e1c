"""From a validated request body to a Plan: prompts tokenized here, the chat template rendered, limits
checked, sampling parameters validated before any worker is asked for anything."""
from __future__ import annotations

from dataclasses import dataclass

from capsulert.capsule_store import validate_name
from capsulert.chat.formats import format_constraint
from capsulert.chat.prompt import ChatRenderer
from capsulert.chat.turn import ChatTurn
from capsulert.errors import InvalidRequestError, UnknownCapsuleError
from capsulert.protocol.sampling import DEFAULT_MAX_TOKENS
from capsulert.serve.generation import RESERVED_PREFIX, Plan, check_client_name
from capsulert.serve.http_errors import MODEL_NOT_FOUND, ApiError
from capsulert.serve.bodies import ChatCompletionRequest, CompletionRequest, _GenerationRequest
from capsulert.serve.token_text import TokenText


@dataclass(frozen=True)
class Limits:
    model_name: str
    max_seq: int
    largest_n: int
    max_tokens: int = DEFAULT_MAX_TOKENS  # a reply's generated tokens: the default, and the most a request may ask

    def token_limit(self, asked: int | None) -> int:
        """A request's max_tokens: `asked`, else the server's; more than the server's is a 400."""
        if asked is not None and asked > self.max_tokens:
            raise InvalidRequestError(f"max_tokens = {asked} is more than this server's limit of {self.max_tokens} "
                                      "(capsulert serve --max-tokens)")
        return self.max_tokens if asked is None else asked


def model_card(limits: Limits) -> dict:
    """The served model as /v1/models lists it, with the server's bounds: `max_model_len` (tokens a session
    holds, prompt and reply: engine.max_seq) and `max_tokens` (a reply's generated tokens: the default and
    the cap, `capsulert serve --max-tokens`)."""
    return {"id": limits.model_name, "object": "model", "created": 0, "owned_by": "capsulert",
            "max_model_len": limits.max_seq, "max_tokens": limits.max_tokens}


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
    max_tokens = limits.token_limit(body.max_tokens)  # not given: OpenAI's 16 (bodies.py); null: the server's
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
                         template_vars=body.chat_template_kwargs, call_format=chat.call_format)
    prompt = chat.encode(turn.prompt)
    max_tokens = limits.token_limit(body.token_limit)
    return _plan(body, [prompt], max_tokens, (body.top_logprobs or 0) if body.logprobs else 0,
                 turn.sampling.constraint, turn.parse_tools)


def completion_logprobs(body: CompletionRequest) -> int | None:
    return body.logprobs


def chat_logprobs(body: ChatCompletionRequest) -> int | None:
    return (body.top_logprobs or 0) if body.logprobs else None
