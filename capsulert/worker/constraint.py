"""Constrained decoding: a generate whose tokens must follow a grammar (a JSON schema, any JSON object, a
regular expression or a Lark grammar), through llguidance.

Why llguidance: it has no dependencies (xgrammar requires triton on Linux, which this project's CPU
environment must not have), it fills a session's token bitmask for the default model in ~30 us on the
2-core CPU box (xgrammar: ~2x that, bench/constrained.py), it needs no per-schema compile step, and it
says when a grammar is complete (`is_stopped`). Both write the same thing: an int32 bitmask per row, bit
t set when token t may come next.

How the mask meets the batch: a stream's GrammarState fills its row of a host bitmask before the step's
draw; the sampler (sampler.py) turns the rows into a boolean [rows, vocab] block and sets the logits of
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
import threading
from functools import cached_property, lru_cache
from typing import Any, Sequence

import torch
from pydantic import BaseModel, ConfigDict, StrictBool, ValidationError, model_validator

from capsulert.errors import InvalidRequestError

# compact JSON: a grammar that allowed free whitespace would let a sampler wander in it for ever
JSON_OPTIONS = {"whitespace_flexible": False}


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

    @model_validator(mode="after")
    def _one(self) -> "Constraint":
        given = [k for k in ("json_schema", "regex", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"a constraint takes exactly one of json_schema, json_object, regex, grammar; got {given}")
        error = _llguidance().LLMatcher.validate_grammar(self.llguidance_grammar, None)
        if error:
            raise ValueError(error.strip())
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


class GrammarState:
    """One generate's position in its grammar: fills its mask row, takes each committed token once."""

    def __init__(self, matcher):
        self._matcher = matcher
        self.accepted = 0  # tokens taken: one per token the session committed during this generate

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 host bitmask [rows, words]."""
        v = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):  # the mask allowed it: only a bug gets here
            raise InvalidRequestError(f"token {token} does not follow the grammar: {self._matcher.get_error()}")
        self.accepted += 1

    @property
    def complete(self) -> bool:
        """The grammar can take no more tokens (the output is complete)."""
        return self._matcher.is_stopped()


class Grammars:
    """The engine's grammar side: llguidance's view of the tokenizer (built on first use: ~30 ms for the
    default model, longer for a large vocabulary) and a GrammarState per constrained generate."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, list(eos_token_ids)
        self._lock = threading.Lock()
        self._ll = None

    @property
    def words(self) -> int:
        """int32 words of one mask row."""
        return (self.vocab_size + 31) // 32

    def _ll_tokenizer(self):
        with self._lock:
            if self._ll is None:
                if self._tokenizer is None:
                    raise InvalidRequestError("constrained decoding needs the model's tokenizer; this model has none")
                llg = _llguidance()
                self._ll = llg.LLTokenizer(self._tokenizer.to_str(), n_vocab=self.vocab_size,
                                           eos_token=self._eos or None)
            return self._ll

    def state(self, constraint: Constraint) -> GrammarState:
        matcher = _llguidance().LLMatcher(self._ll_tokenizer(), constraint.llguidance_grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid constraint: {matcher.get_error()}")
        return GrammarState(matcher)

    def bitmask(self, rows: int) -> torch.Tensor:
        """A host bitmask with every token allowed in every row (rows without a grammar keep it)."""
        return torch.full((rows, self.words), -1, dtype=torch.int32)


@lru_cache(maxsize=8)
def _bit_positions(device: torch.device) -> torch.Tensor:
    return torch.arange(32, dtype=torch.int32, device=device)


def allowed_tokens(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """The boolean [rows, vocab] block of an int32 bitmask [rows, words] (bit t of a row: token t allowed),
    on `device`. Row by row: each row's block depends only on its own mask row."""
    words = bitmask.to(device, non_blocking=True)
    return ((words[:, :, None] >> _bit_positions(device)) & 1).reshape(words.shape[0], -1)[:, :vocab].bool()


def schema_text(schema: dict) -> str:
    """A JSON schema as embedded in a Lark grammar (`%json{...}`), compact."""
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS}, separators=(",", ":"))
