"""The served model's tokenizer, loaded in the server process too: prompts are tokenized here (so the
server knows their lengths and sends the workers token ids) and logprobs name their tokens here, without
a round trip to a worker per token.

The same tokenizer.json the workers load, so a text prompt becomes the same ids an in-process
`engine.tokenize` gives. A model without a tokenizer (random weights for benchmarks) serves token-id
prompts only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from capsulert.errors import InvalidRequestError, InvalidTokenError
from capsulert.protocol.tokens import check_text


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """The printable character byte-level BPE writes for each byte (GPT-2's scheme), inverted: the 188
    printable Latin-1 bytes stand for themselves, the other 68 map to 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = (b for b in range(256) if b not in printable)
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(extra)})
    return table


@dataclass(frozen=True)
class TokenText:
    tokenizer: object | None  # a tokenizers.Tokenizer
    vocab_size: int
    byte_level: bool  # token strings are byte-level BPE (each character stands for one byte)

    @classmethod
    def load(cls, model_dir: Path | None, vocab_size: int) -> "TokenText":
        from capsulert.engine.loader import load_tokenizer

        tok = None if model_dir is None else load_tokenizer(model_dir)
        byte_level = False
        if tok is not None:
            decoder = json.loads(tok.to_str()).get("decoder") or {}
            byte_level = decoder.get("type") == "ByteLevel"
        return cls(tok, vocab_size, byte_level)

    def encode(self, text: str, *, special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special_tokens=False for a rendered chat template, which already holds
        the special tokens the model expects (as transformers does)."""
        if self.tokenizer is None:
            raise InvalidRequestError("the served model has no tokenizer: send prompts as token ids")
        try:
            check_text(text)
        except InvalidTokenError as e:
            raise InvalidRequestError(str(e)) from None
        return self.tokenizer.encode(text, add_special_tokens=special_tokens).ids

    def check_ids(self, ids: list[int]) -> list[int]:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def token_id_text(self, token: int) -> str | None:
        """The text of a special or regular token by id (None when the model has no tokenizer)."""
        return None if self.tokenizer is None else self.tokenizer.id_to_token(token)

    def piece(self, token: int) -> str:
        """One token's text as clients show it; a token that is part of a UTF-8 character shows as
        U+FFFD (its exact bytes are in piece_bytes)."""
        if self.tokenizer is None:
            return f"token_id:{token}"
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def piece_bytes(self, token: int) -> list[int]:
        """The exact bytes a token stands for (byte-level tokenizers), else the UTF-8 of its text."""
        if self.byte_level and self.tokenizer is not None:
            raw = self.tokenizer.id_to_token(token) or ""
            table = _byte_level_alphabet()
            if all(ch in table for ch in raw):
                return [table[ch] for ch in raw]
        return list(self.piece(token).encode("utf-8"))
