"""The request body of POST /v1/responses (OpenAI's Responses API), validated at the edge, and its input
items read as the chat messages the checkpoint's template renders.

Input: a string (one user message) or a list of items: messages ({"role", "content"} with or without
"type": "message"; content a string or input_text / output_text parts), `function_call` items (a call the
model made: call_id, name, arguments) and `function_call_output` items (its result). `reasoning` items are
accepted and left out (the template is given no reasoning). `instructions` become the first, system message.
Tools are function tools ({"type": "function", "name", "parameters", ...}); `tool_choice` is "auto", "none",
"required" or {"type": "function", "name"}; `text.format` is text, json_object or json_schema, as
response_format is for chat completions. Extensions (as chat completions take them): `seed`, `stop`. Fields
the API has that capsulert does not use (`metadata`, `include`, `truncation`, `reasoning`, `user`, ...) are
accepted and ignored, as chat completions' are.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from capsulert.serve.bodies import MAX_STOPS, warn_unknown_fields

_EXTRA = ConfigDict(extra="allow", strict=True, frozen=True)


class TextContent(BaseModel):
    model_config = _EXTRA
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(BaseModel):
    model_config = _EXTRA
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextContent]

    @property
    def text(self) -> str:
        return _joined(self.content)


class FunctionCallItem(BaseModel):
    model_config = _EXTRA
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = _EXTRA
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextContent]

    @property
    def text(self) -> str:
        return _joined(self.output)


def _joined(content: str | list[TextContent]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class ReasoningItem(BaseModel):
    model_config = _EXTRA
    type: Literal["reasoning"]


InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> dict:
        function = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """text.format: {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema", "name", "schema",
    "strict"} (flat, where chat completions nest it under json_schema)."""
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def as_response_format(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name or "response", "schema": self.schema_ or {}}
        return {"type": "json_schema", "json_schema": spec}


class TextOptions(BaseModel):
    model_config = _EXTRA
    format: TextFormat | None = None


class ResponsesStreamOptions(BaseModel):
    """`tool_arguments` (an extension, as chat completions take it): "whole" (the default) sends each function
    call's arguments in one delta once the call is complete, and drops a call cut by max_output_tokens;
    "incremental" adds the call's item as soon as its name is written and sends its arguments in pieces as
    they are generated (chat/tool_call_deltas.py), so a response cut by max_output_tokens may end with a
    function call item of status "incomplete"."""
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    tool_arguments: Literal["whole", "incremental"] = "whole"


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # extensions, as chat completions take them
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool = True
    text: TextOptions | None = None
    metadata: dict[str, str] | None = None

    @model_validator(mode="after")
    def _known(self):
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must not be an empty list")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream = true")
        if self.model_extra:
            warn_unknown_fields(self.model_extra)
        return self

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ValueError(f"stop takes at most {MAX_STOPS} non-empty strings")
        return v

    @property
    def tool_arguments_incremental(self) -> bool:
        return self.stream_options is not None and self.stream_options.tool_arguments == "incremental"

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def items(self) -> list[InputItem]:
        return [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else list(self.input)

    @property
    def chat_tools(self) -> list[dict] | None:
        return None if not self.tools else [t.as_chat_tool() for t in self.tools]

    @property
    def chat_tool_choice(self) -> Any:
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            return {"type": "function", "function": {"name": choice.name}}
        return choice or ("auto" if self.tools else "none")

    @property
    def response_format(self) -> dict | None:
        """text.format as a chat response_format; none where tool_choice forces a call: the reply is calls,
        no text to format (an agent with an output type sends both on its tool turns)."""
        if self.text is None or self.text.format is None or self.tool_choice in ("required",) \
                or isinstance(self.tool_choice, NamedFunction):
            return None
        return self.text.format.as_response_format()


def chat_messages(items: list[InputItem]) -> list[dict]:
    """Input items as chat messages (OpenAI chat shapes): consecutive function calls join one assistant
    message (with the text of an assistant message just before them), outputs are tool messages."""
    out: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    return out
