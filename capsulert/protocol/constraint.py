"""Constrained decoding: a generate whose tokens must follow a grammar (a JSON schema, any JSON object, a
regular expression or a Lark grammar), through llguidance.

Why llguidance: it has no dependencies (xgrammar requires triton on Linux, which this project's CPU
environment must not have), it fills a session's token bitmask for the default model in ~30 us on the
2-core CPU box (xgrammar: ~2x that, bench/constrained.py), it needs no per-schema compile step, and it
says when a grammar is complete (`is_stopped`). Both write the same thing: an int32 bitmask per row, bit
t set when token t may come next.

How the mask meets the batch: a stream's GrammarState fills its row of a host bitmask before the step's
draw; the sampler (engine/sampler.py) turns the rows into a boolean [rows, vocab] block and sets the logits of
forbidden tokens to -inf, row by row, on the stacked logits block it samples from. That block is a copy
made after the decode step (and after a CUDA graph's replay): the mask never enters a captured graph.
A row's masking reads only its own logits and its own mask row (a masked_fill with an all-allowed row
changes no bit), so a constrained session's tokens are the same alone or batched, and an unconstrained
session's are the same next to constrained ones.

The grammar advances exactly once per token the session commits (GrammarState.accept); once the grammar
can take nothing more (`is_stopped`: a complete JSON value, a fixed-length regex matched) the generate
ends with stop reason "grammar_end". Where the grammar is complete but could go on (a `[0-9]+` regex),
the mask also allows the model's EOS tokens, and the model decides.
"""
from __future__ import annotations

import json
from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr, StrictBool, ValidationError, model_validator

from capsulert.errors import InvalidRequestError
from capsulert.protocol.schema_shape import check_schema

# compact JSON: a grammar that allowed free whitespace would let a sampler wander in it for ever
JSON_OPTIONS = {"whitespace_flexible": False}
# a regex or grammar past this many characters is refused before llguidance compiles it (a `choice` of 100k
# strings took 82 s to refuse); schemas are bounded by schema_shape.py
MAX_GRAMMAR_CHARS = 256 << 10


class Constraint(BaseModel):
    """What a generate's output must match: exactly one of `json_schema` (a JSON schema, as a dict),
    `json_object` (any JSON object), `regex` (a regular expression the whole output matches) or `grammar`
    (a Lark grammar in llguidance's dialect, whose `start` rule the output matches; it may embed JSON
    schemas as `%json{...}`). Checked when made: a schema or grammar llguidance refuses is an
    InvalidRequestError naming the problem."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    json_schema: dict[str, Any] | None = None
    json_object: StrictBool = False
    regex: str | None = None
    grammar: str | None = None
    _checked: bool = PrivateAttr(False)

    @model_validator(mode="after")
    def _one(self) -> "Constraint":
        if self._checked:  # pydantic runs this again on the instance inside every SamplingParams made with it
            return self
        given = [k for k in ("json_schema", "regex", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"a constraint takes exactly one of json_schema, json_object, regex, grammar; got {given}")
        if self.json_schema is not None:
            check_schema(self.json_schema, "the JSON schema")
        text = self.regex if self.regex is not None else self.grammar
        if text is not None and len(text) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"the {'regex' if self.regex is not None else 'grammar'} has {len(text)} characters; "
                             f"at most {MAX_GRAMMAR_CHARS} are compiled")
        error = _llguidance().LLMatcher.validate_grammar(self.llguidance_grammar, None)
        if error:
            raise ValueError(error.strip())
        self._checked = True  # the grammar compiles: a 15k-way choice takes ~0.8 s, paid once per constraint
        return self

    def __init__(self, **data):
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise InvalidRequestError(f"invalid constraint: {e.errors()[0]['msg']}") from None

    @cached_property
    def llguidance_grammar(self) -> str:
        """The grammar as llguidance takes it (a JSON string)."""
        matcher = _llguidance().LLMatcher
        if self.json_schema is not None:
            return matcher.grammar_from_json_schema(self.json_schema, defaults=JSON_OPTIONS)
        if self.json_object:
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.regex is not None:
            return matcher.grammar_from_regex(self.regex)
        return matcher.grammar_from_lark(self.grammar)


def _llguidance():
    import llguidance

    return llguidance


def schema_text(schema: dict) -> str:
    """A JSON schema as embedded in a Lark grammar (`%json{...}`), compact."""
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS}, separators=(",", ":"))
