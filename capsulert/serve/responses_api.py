"""POST /v1/responses (OpenAI's Responses API) on the chat completions' generation path: the input items
become chat messages (responses_bodies.py), planned by the same ChatTurn (tools, tool_choice, text.format
as response_format), run by the same Run, answered as a `response` object or as its stream of events.
Streamed, a function call comes whole once its block closes (a call cut by max_output_tokens is dropped), or,
with `stream_options.tool_arguments` "incremental", as an item added once its name is written and argument
deltas as they are generated (chat/tool_call_deltas.py; cut, the response ends incomplete with that item
incomplete).

A stored response is a capsule. With `store` (the default) the response's end state (its rendered input and
its reply as generated) is snapshotted as a capsule of the caller's namespace, under a server-reserved name,
and the response is remembered (its conversation's items and the capsule's tokens). A request naming it as
`previous_response_id` renders the whole conversation (the stored items, then its own input, after its own
`instructions`: those of the earlier response are not carried over, as OpenAI's are not) and, where the
capsule's tokens begin that rendering, restores the capsule and appends only the rest: `usage.input_tokens`
counts the whole conversation and `input_tokens_details.cached_tokens` the tokens restored, so the prefill
is the difference. The same conversation sent whole, without previous_response_id, renders the same tokens,
so it generates the same reply. Where the capsule is gone (evicted under the capsule store's budgets, like
any unpinned capsule) or does not begin the rendering (other instructions), the conversation is prefilled
whole: the answer is the same, only slower. The server remembers the newest RESPONSES_KEPT responses; an
older id, or one of another namespace, is a 404.
"""
from __future__ import annotations

import time
import uuid
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from capsulert.chat.prompt import ChatRenderer
from capsulert.errors import InvalidRequestError
from capsulert.chat.tool_call_deltas import CallDelta, ToolCallDeltas
from capsulert.chat.tool_calls import ToolCall, ToolCallStream
from capsulert.chat.turn import ChatTurn, cut_off, finish_reason, read_reply
from capsulert.serve.generation import RESERVED_PREFIX, Choice, Chunk, Made, Plan, Usage
from capsulert.serve.http_errors import MODEL_NOT_FOUND, ApiError, ErrorKind
from capsulert.serve.plans import Limits
from capsulert.serve.responses_bodies import (FunctionCallItem, InputItem, MessageItem, ResponsesRequest,
                                                chat_messages)
from capsulert.serve.streaming import sse

if TYPE_CHECKING:
    from capsulert.serve.token_text import TokenText

RESPONSES_KEPT = 4096
CAPSULE_PREFIX = RESERVED_PREFIX + "response:"
NOT_FOUND = ErrorKind(404, "not_found_error", "previous_response_not_found")


@dataclass(frozen=True)
class StoredResponse:
    namespace: str
    items: tuple[InputItem, ...]  # the conversation up to and with the response's output, as input items
    tokens: array  # the capsule's (uint32: 4 bytes a token): the rendered input, then the reply's tokens
    capsule: str


class StoredResponses:
    """The responses kept for previous_response_id, the newest `limit` (one owner: the server's state)."""

    def __init__(self, limit: int = RESPONSES_KEPT):
        self.limit = limit
        self._by_id: OrderedDict[str, StoredResponse] = OrderedDict()
        self._gone: list[StoredResponse] = []

    def get(self, response_id: str, namespace: str) -> StoredResponse:
        found = self._by_id.get(response_id)
        if found is None or found.namespace != namespace:
            raise ApiError(NOT_FOUND, f"no stored response {response_id!r} in this namespace (never stored, or "
                                      f"older than the newest {self.limit})", "previous_response_id")
        self._by_id.move_to_end(response_id)
        return found

    def put(self, response_id: str, response: StoredResponse) -> None:
        """Keep `response`; the oldest one past the limit is forgotten, and its capsule left to `forgotten`."""
        self._by_id[response_id] = response
        while len(self._by_id) > self.limit:
            self._gone.append(self._by_id.popitem(last=False)[1])

    def forgotten(self) -> list[StoredResponse]:
        """The responses forgotten since the last call (their capsules are the caller's to delete)."""
        gone, self._gone = self._gone, []
        return gone


@dataclass(frozen=True)
class ResponsePlan:
    plan: Plan
    rendered: tuple[int, ...]  # the whole conversation's tokens (the capsule's and the appended ones)
    items: tuple[InputItem, ...]  # the conversation's items (before the reply)
    parse_tools: bool


def response_plan(body: ResponsesRequest, limits: Limits, tokens: "TokenText", chat: ChatRenderer,
                  previous: StoredResponse | None, response_id: str, use_capsule: bool = True) -> ResponsePlan:
    if body.model != limits.model_name:
        raise ApiError(MODEL_NOT_FOUND,
                       f"model {body.model!r} is not served here; this server serves {limits.model_name!r}", "model")
    items = (previous.items if previous is not None else ()) + tuple(body.items)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + chat_messages(items)
    if not messages:
        raise InvalidRequestError("input: no message to answer (only reasoning items)")
    turn = ChatTurn.plan(messages, tools=body.chat_tools, tool_choice=body.chat_tool_choice,
                         response_format=body.response_format, parallel_tool_calls=body.parallel_tool_calls,
                         call_format=chat.call_format)
    rendered = tuple(chat.encode(turn.prompt))
    capsule, prompt = None, rendered
    if use_capsule and previous is not None and len(rendered) > len(previous.tokens) \
            and array("I", rendered[:len(previous.tokens)]) == previous.tokens:
        capsule, prompt = previous.capsule, rendered[len(previous.tokens):]
    sampling = dict(temperature=1.0 if body.temperature is None else body.temperature,
                    top_p=1.0 if body.top_p is None else body.top_p, stop=body.stops,
                    constraint=turn.sampling.constraint)
    plan = Plan.of((prompt,), 1, limits.token_limit(body.max_output_tokens), sampling, body.seed, capsule=capsule,
                   snapshot_as=CAPSULE_PREFIX + response_id if body.store else None, parse_tools=turn.parse_tools)
    return ResponsePlan(plan, rendered, items, turn.parse_tools)


def usage_body(u: Usage) -> dict:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _message(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or "msg_" + uuid.uuid4().hex, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _function_call(call: ToolCall, status: str = "completed") -> dict:
    return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": status}


def _as_input(item: dict) -> InputItem:
    if item["type"] == "message":
        return MessageItem(role="assistant", content=item["content"][0]["text"])
    return FunctionCallItem(type="function_call", call_id=item["call_id"], name=item["name"],
                            arguments=item["arguments"])


@dataclass
class ResponseShape:
    """A response's body, or its stream of events, in the Responses API's shapes (the interface of
    responses.Shape, so the chat completions' _respond serves it); it keeps the response once made."""
    id: str
    body_in: ResponsesRequest
    planned: ResponsePlan
    stored: StoredResponses
    namespace: str
    created: int = field(default_factory=lambda: int(time.time()))
    # the stream's state
    _seq: int = 0
    _output: list = field(default_factory=list)
    _open_message: dict | None = None
    _open_call: dict | None = None  # incremental arguments: the function call item being written
    _calls: ToolCallStream | ToolCallDeltas = field(default_factory=ToolCallStream)
    _final: Choice | None = None

    def __post_init__(self):
        if self.body_in.tool_arguments_incremental:
            self._calls = ToolCallDeltas()

    def _object(self, status: str, output: list, usage: Usage | None, incomplete: bool = False) -> dict:
        b = self.body_in
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": b.model,
                "output": output, "parallel_tool_calls": b.parallel_tool_calls,
                "previous_response_id": b.previous_response_id, "store": b.store,
                "temperature": 1.0 if b.temperature is None else b.temperature,
                "top_p": 1.0 if b.top_p is None else b.top_p, "tool_choice": _dump(b.tool_choice) or "auto",
                "tools": [t.model_dump(exclude_none=True) for t in b.tools or ()],
                "text": {"format": _dump(b.text.format) if b.text and b.text.format else {"type": "text"}},
                "truncation": "disabled", "metadata": b.metadata or {},
                "usage": None if usage is None else usage_body(usage)}

    def _keep(self, output: list, choice: Choice, made: Made | None) -> None:
        if made is None:
            return
        # a call cut by max_output_tokens is no input (its arguments are not JSON): a conversation that goes
        # on from this response renders without it, so it is prefilled whole rather than from the capsule
        items = self.planned.items + tuple(_as_input(item) for item in output if item["status"] == "completed")
        tokens = array("I", self.planned.rendered + tuple(choice.tokens))
        record = StoredResponse(self.namespace, items, tokens, made.ref.name)
        self.stored.put(self.id, record)

    # ------------------------------------------------------------------ whole
    def body(self, choices: Sequence[Choice], usage: Usage, capsule: Made | None) -> dict:
        c, = choices
        if self.planned.parse_tools:
            content, calls, finish = read_reply(c.text, c.stop_reason)
        else:
            content, calls, finish = c.text, [], finish_reason(c.stop_reason, 0, False)
        output = ([_message(content)] if content else []) + [_function_call(call) for call in calls]
        self._keep(output, c, capsule)
        incomplete = finish == "length"
        return self._object("incomplete" if incomplete else "completed", output, usage, incomplete)

    # ------------------------------------------------------------------ stream
    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse(event)

    def chunk_event(self, ch: Chunk, first: bool, offset: int) -> bytes:
        out = []
        if first:
            out.append(self._event("response.created", response=self._object("in_progress", [], None)))
            out.append(self._event("response.in_progress", response=self._object("in_progress", [], None)))
        if self.planned.parse_tools:
            pieces = self._calls.push(ch.text)
            if ch.final is not None:
                pieces += self._calls.finish(cut_off(ch.final.stop_reason))
        else:
            pieces = [ch.text] if ch.text else []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                out += self._call_events(piece)
            elif isinstance(piece, CallDelta):
                out += self._call_delta_events(piece)
            elif piece and not (self._calls.calls and piece.isspace()):
                out += self._close_call()
                out += self._text_events(piece)
        if ch.final is not None:
            out += self._close_call("incomplete" if self._calls.partial else "completed")
            out += self._close_message()
            self._final = ch.final
        elif self._open_call is not None and not self._calls.in_call:  # its block closed: its arguments are whole
            out += self._close_call()
        return b"".join(out)

    def _text_events(self, text: str) -> list[bytes]:
        out = []
        if self._open_message is None:
            self._open_message = _message("", "in_progress")
            self._output.append(self._open_message)
            out.append(self._event("response.output_item.added", output_index=len(self._output) - 1,
                                   item={**self._open_message, "content": []}))
            out.append(self._event("response.content_part.added", item_id=self._open_message["id"],
                                   output_index=len(self._output) - 1, content_index=0,
                                   part={"type": "output_text", "text": "", "annotations": []}))
        self._open_message["content"][0]["text"] += text
        out.append(self._event("response.output_text.delta", item_id=self._open_message["id"],
                               output_index=len(self._output) - 1, content_index=0, delta=text, logprobs=[]))
        return out

    def _close_message(self) -> list[bytes]:
        msg, self._open_message = self._open_message, None
        if msg is None:
            return []
        msg["status"] = "completed"
        index, part = self._output.index(msg), msg["content"][0]
        return [self._event("response.output_text.done", item_id=msg["id"], output_index=index, content_index=0,
                            text=part["text"], logprobs=[]),
                self._event("response.content_part.done", item_id=msg["id"], output_index=index, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=index, item=msg)]

    def _call_events(self, call: ToolCall) -> list[bytes]:
        """A whole call: its item added, its arguments in one delta, done."""
        return self._call_delta_events(CallDelta(0, call.arguments, call.name, call.id)) + self._close_call()

    def _call_delta_events(self, d: CallDelta) -> list[bytes]:
        """A piece of a call whose arguments go out as they are generated: the first adds its item."""
        out = []
        if d.name is not None:
            out += self._close_call() + self._close_message()
            self._open_call = _function_call(ToolCall(d.name, "", d.id), "in_progress")
            self._output.append(self._open_call)
            out.append(self._event("response.output_item.added", output_index=len(self._output) - 1,
                                   item=dict(self._open_call)))
        if d.arguments:
            item = self._open_call
            item["arguments"] += d.arguments
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=len(self._output) - 1, delta=d.arguments))
        return out

    def _close_call(self, status: str = "completed") -> list[bytes]:
        item, self._open_call = self._open_call, None
        if item is None:
            return []
        item["status"] = status
        index = self._output.index(item)
        return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def tail_chunk(self, usage: Usage | None, capsule: Made | None) -> dict:
        """The last event: response.completed (or .incomplete, cut by max_output_tokens) with the usage."""
        final = self._final
        cut = self._calls.dropped or self._calls.partial
        incomplete = final is not None and finish_reason(final.stop_reason, self._calls.calls, cut) == "length"
        if final is not None:
            self._keep(self._output, final, capsule)
        status = "incomplete" if incomplete else "completed"
        event = {"type": "response." + status, "sequence_number": self._seq,
                 "response": self._object(status, self._output, usage, incomplete)}
        self._seq += 1
        return event


def _dump(value: Any) -> Any:
    return value.model_dump(exclude_none=True, by_alias=True) if hasattr(value, "model_dump") else value
