"""Tool parameter schemas as decoding sees them: closed.

A JSON schema object without `additionalProperties` allows any further key; a grammar that allows them lets a
sampler add keys until max_tokens and never close the call. Frameworks send such schemas by default
(LangChain's bind_tools, pydantic models without extra="forbid"), so for decoding every object schema that
does not say otherwise is closed (`additionalProperties: false`), as OpenAI's strict mode reads them. A schema
that sets `additionalProperties` (true, false or a schema) keeps it: a free-form mapping stays free.
"""
from __future__ import annotations

from typing import Any

# keywords whose value is one subschema / a list of them / a mapping of names to them
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema: Any) -> Any:
    """`schema` with every object schema in it that leaves `additionalProperties` unsaid closed; a new value
    (the argument is not changed)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed(out["additionalProperties"])
    elif "additionalProperties" not in out and _is_object(out):
        out["additionalProperties"] = False
    return out


def _is_object(schema: dict) -> bool:
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in schema
