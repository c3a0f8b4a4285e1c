"""TokenCodec: text <-> token ids, and the checks every token list passes before it reaches a slot."""
from __future__ import annotations

from typing import Sequence

import torch

from capsulert.errors import InvalidTokenError, SequenceTooLongError

# a BPE token covers at least one byte of text, so text longer than this many characters per token of
# room cannot fit; checked before tokenising (a 1 GB prompt is refused without reading it all)
MAX_CHARS_PER_TOKEN = 64


class TokenCodec:
    def __init__(self, tokenizer, vocab_size: int, max_seq: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_seq = max_seq

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidTokenError("this model has no tokenizer.json; pass token ids instead of text")
        return self.tokenizer.encode(text).ids

    def decode(self, tokens: Sequence[int]) -> str:
        if self.tokenizer is None:
            raise InvalidTokenError("this model has no tokenizer.json")
        return self.tokenizer.decode(list(tokens))

    def validate(self, tokens_or_text, room: int) -> list[int]:
        """Token ids from text, a 1-D integer tensor or a sequence of ints; at most `room` of them."""
        if isinstance(tokens_or_text, str):
            if len(tokens_or_text) > MAX_CHARS_PER_TOKEN * self.max_seq:
                raise SequenceTooLongError(f"text of {len(tokens_or_text)} characters cannot fit max_seq={self.max_seq}")
            tokens = self.encode(tokens_or_text)
        elif isinstance(tokens_or_text, torch.Tensor):
            if tokens_or_text.dim() != 1 or tokens_or_text.dtype.is_floating_point:
                raise InvalidTokenError("token tensor must be 1-D of an integer dtype")
            tokens = tokens_or_text.tolist()
        else:
            tokens = list(tokens_or_text)
        if not tokens:
            raise InvalidTokenError("nothing to append: empty token list")
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise InvalidTokenError(f"token id {t!r} is not an int in [0, {self.vocab_size})")
        if len(tokens) > room:
            raise SequenceTooLongError(
                f"{len(tokens)} tokens do not fit: the session holds {self.max_seq - room} of max_seq={self.max_seq}"
            )
        return tokens
