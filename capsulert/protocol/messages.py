"""What a conversation and its tools are, checked at the edge (pydantic): the HTTP request bodies and the
Python chat API take the same shapes, OpenAI's."""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from capsulert.errors import InvalidRequestError
from capsulert.protocol.schema_shape import check_schema

FUNCTION_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # extra fields (tool_calls, tool_call_id, reasoning_content, ...) pass through to the chat template,
    # which decides what to write of them
    model_config = ConfigDict(extra="allow", strict=True, frozen=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as a template sees it: content always a string (text parts joined)."""
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "".join(part.text for part in self.content)
        d.setdefault("content", "")
        return d


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; None: no arguments
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        """Arguments are an object: a call forced by tool_choice with a string or array schema was dropped by
        the parser (no tool_calls, its markup left in the content)."""
        if schema is None:
            return None
        check_schema(schema, "the tool's parameters")
        if schema.get("type", "object") != "object":
            raise ValueError(f"a tool's parameters must be a JSON schema of an object (type 'object'), "
                             f"got type {schema['type']!r}")
        return schema

    @property
    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class ToolSpec(BaseModel):
    """One tool, as OpenAI's `tools` lists it: {"type": "function", "function": {...}}."""
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    name: str


class NamedToolChoice(BaseModel):
    """tool_choice naming one function: the reply is exactly one call of it."""
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    type: Literal["function"]
    function: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


def messages_arg(messages: Any) -> list[ChatMessage]:
    """A conversation given to the Python API (dicts or ChatMessage), checked; InvalidRequestError else."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    try:
        return [m if isinstance(m, ChatMessage) else ChatMessage.model_validate(m) for m in messages]
    except ValidationError as e:
        raise InvalidRequestError(f"invalid messages: {_first(e)}") from None


def tools_arg(tools: Any) -> list[ToolSpec] | None:
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise InvalidRequestError("tools must be a list of {'type': 'function', 'function': {...}} dicts")
    try:
        specs = [t if isinstance(t, ToolSpec) else ToolSpec.model_validate(t) for t in tools]
    except ValidationError as e:
        raise InvalidRequestError(f"invalid tools: {_first(e)}") from None
    names = [t.function.name for t in specs]
    if len(set(names)) != len(names):
        raise InvalidRequestError(f"tools: function names must be unique, got {names}")
    return specs or None


def tool_choice_arg(choice: Any) -> ToolChoice:
    if choice in ("none", "auto", "required") or isinstance(choice, NamedToolChoice):
        return choice
    try:
        return NamedToolChoice.model_validate(choice)
    except ValidationError:
        raise InvalidRequestError("tool_choice must be 'none', 'auto', 'required' or "
                                  "{'type': 'function', 'function': {'name': ...}}") from None


def _first(e: ValidationError) -> str:
    err = e.errors()[0]
    return f"{'.'.join(map(str, err['loc'])) or 'value'}: {err['msg']}"
