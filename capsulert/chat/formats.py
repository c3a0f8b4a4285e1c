"""tool_choice and response_format as decoding constraints (engine/grammar.py).

- tool_choice "required": the reply is one or more tool calls (one when parallel calls are off), each a
  `<tool_call>` block whose JSON body is {"name": one of the tools, "arguments": that tool's parameters
  schema}, written as the default chat template writes calls back; a named function: exactly one call of
  it. Enforced by the grammar, not hoped for. The parameters schema is closed for decoding (chat/schemas.py: an object schema without `additionalProperties` takes no
  other keys, as OpenAI's strict mode reads it), so a call ends; a schema the grammar engine cannot compile
  is an InvalidRequestError (HTTP 400).
- tool_choice "auto": no constraint; the model decides, and its markup is parsed. "none": no constraint
  and no parsing.
- response_format {"type": "json_object"}: any JSON object; {"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}: a value of that schema; {"type": "text"}: nothing.
- The extension `structured_outputs` (as vLLM names it) takes one of {"json": schema, "regex": ...,
  "grammar": Lark grammar, "choice": [strings]}.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from capsulert.protocol.messages import NamedToolChoice, ToolChoice, ToolSpec
from capsulert.chat.schemas import closed
from capsulert.chat.tool_calls import CLOSE, OPEN
from capsulert.errors import InvalidRequestError
from capsulert.protocol.constraint import Constraint, schema_text


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema goes with type 'json_schema' (and only with it)")
        return self


class StructuredOutputs(BaseModel):
    """Extension: one of json (a schema), regex, grammar (Lark, llguidance's dialect), choice."""
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    json_: dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one(self):
        if sum(v is not None for v in (self.json_, self.regex, self.grammar, self.choice)) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, grammar, choice")
        return self


def format_constraint(response_format: Any = None, structured: Any = None) -> Constraint | None:
    """The constraint of a response_format and / or structured_outputs (dicts or their models)."""
    try:
        fmt = None if response_format is None else ResponseFormat.model_validate(response_format)
        ext = None if structured is None else StructuredOutputs.model_validate(structured)
    except ValidationError as e:
        err = e.errors()[0]
        raise InvalidRequestError(f"response_format: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    wanted = fmt is not None and fmt.type != "text"
    if wanted and ext is not None:
        raise InvalidRequestError("give response_format or structured_outputs, not both")
    if wanted:
        if fmt.type == "json_object":
            return Constraint(json_object=True)
        return Constraint(json_schema=fmt.json_schema.schema_)
    if ext is None:
        return None
    if ext.json_ is not None:
        return Constraint(json_schema=ext.json_)
    if ext.regex is not None:
        return Constraint(regex=ext.regex)
    if ext.grammar is not None:
        return Constraint(grammar=ext.grammar)
    return Constraint(grammar="start: " + " | ".join(json.dumps(c) for c in ext.choice))


def tool_constraint(tools: list[ToolSpec] | None, choice: ToolChoice, parallel: bool = True,
                    call_format: str = "json") -> Constraint | None:
    """The grammar tool_choice "required" or a named function imposes; None for "auto" and "none". Calls
    are written in the checkpoint template's `call_format` (ChatTemplate.call_format)."""
    if choice in ("auto", "none"):
        return None
    if not tools:
        raise InvalidRequestError(f"tool_choice {_describe(choice)} needs tools")
    if isinstance(choice, NamedToolChoice):
        check_tool_choice(tools, choice)
        tools, parallel = [t for t in tools if t.function.name == choice.function.name], False
    bodies = " | ".join((_xml_call_body if call_format == "xml" else _call_body)(t) for t in tools)
    start = 'call ("\\n" call)*' if parallel else "call"
    call = f"{json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}"
    try:
        return Constraint(grammar=f"start: {start}\ncall: {call}\nbody: {bodies}\n")
    except InvalidRequestError as e:
        raise InvalidRequestError(f"tools: a function's parameters schema cannot be used for decoding: {e}") from None


def check_tool_choice(tools: list[ToolSpec] | None, choice: ToolChoice) -> None:
    """A named function must be among the tools (checked also when no constraint is built)."""
    if isinstance(choice, NamedToolChoice) and not any(t.function.name == choice.function.name for t in tools or ()):
        raise InvalidRequestError(f"tool_choice names {choice.function.name!r}, which is not among the tools")


def _call_body(tool: ToolSpec) -> str:
    """A call's body as the chat template writes one back (`{"name": "f", "arguments": ARGS}`), ARGS a
    value of the closed parameters schema (compact JSON): a reply's calls, rendered again in the next turn's
    prompt, are the very tokens generated, so that turn can continue the state they left."""
    head = '{"name": ' + json.dumps(tool.function.name) + ', "arguments": '
    return f"{json.dumps(head)} %json{schema_text(closed(tool.function.arguments_schema))} \"}}\""


def _xml_call_body(tool: ToolSpec) -> str:
    """A call's body as Qwen3.5's (and Qwen3-Coder's) template writes one back: `<function=NAME>` then a
    `<parameter=P>` block per argument, in the schema's order (the required ones always, the others
    optional), its value the text of a string (one line, no `<` in it) and compact JSON of anything else."""
    schema = closed(tool.function.arguments_schema)
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}  # what `$ref`s in a value point at
    required = set(schema.get("required", ()))
    parts, end = [], json.dumps("\n</parameter>\n")
    for name, sub in (schema.get("properties") or {}).items():
        block = " ".join((json.dumps("<parameter=" + name + ">\n"), _xml_value(sub, defs), end))
        parts.append(block if name in required else f"({block})?")
    head = json.dumps(f"<function={tool.function.name}>\n")
    return f"{head} {' '.join(parts)} \"</function>\""


def _xml_value(sub: dict, defs: dict) -> str:
    if isinstance(sub.get("enum"), list) and sub["enum"] and all(isinstance(v, str) for v in sub["enum"]):
        return "(" + " | ".join(json.dumps(v) for v in sub["enum"]) + ")"
    if sub.get("type") == "string" and not ({"pattern", "format", "const", "enum"} & set(sub)):
        low, high = sub.get("minLength", 0), sub.get("maxLength")
        return f"/[^<\\n]{{{low},{'' if high is None else high}}}/"
    return "%json" + schema_text({**sub, **defs})


def _describe(choice: ToolChoice) -> str:
    return repr(choice) if isinstance(choice, str) else f"naming {choice.function.name!r}"
