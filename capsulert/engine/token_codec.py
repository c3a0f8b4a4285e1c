"""TokenCodec: text <-> token ids, and the checks every token list passes before it reaches a slot. A
ChatPrompt (capsulert/chat) is rendered by the model's chat template and encoded here too, so every path
that appends (Session.append, Open, Append and Turn requests) takes a conversation."""
from __future__ import annotations

from typing import Sequence

import torch

from capsulert.chat.prompt import ChatRenderer
from capsulert.protocol.conversation import ChatPrompt
from capsulert.errors import InvalidTokenError, SequenceTooLongError
from capsulert.protocol.tokens import check_text

# a BPE token covers at least one byte of text, so text longer than this many characters per token of
# room cannot fit; checked before tokenising (a 1 GB prompt is refused without reading it all)
MAX_CHARS_PER_TOKEN = 64


class TokenCodec:
    def __init__(self, tokenizer, vocab_size: int, max_seq: int, chat: ChatRenderer | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_seq = max_seq
        self.chat = chat if chat is not None else ChatRenderer(None, tokenizer)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidTokenError("this model has no tokenizer.json; pass token ids instead of text")
        return self.tokenizer.encode(check_text(text)).ids

    def decode(self, tokens: Sequence[int]) -> str:
        if self.tokenizer is None:
            raise InvalidTokenError("this model has no tokenizer.json")
        return self.tokenizer.decode(self._ids(token_list(tokens)))

    def _ids(self, tokens: list) -> list[int]:
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise InvalidTokenError(f"token id {t!r:.40} is not an int in [0, {self.vocab_size})")
        return tokens

    def validate(self, tokens_or_text, room: int) -> list[int]:
        """Token ids from text, a ChatPrompt, a 1-D integer tensor or a list / tuple of ints; at most `room`
        of them. Anything else (bytes, a dict, a set, a number, None) is refused: none of them is a token
        sequence with a defined order and meaning."""
        if isinstance(tokens_or_text, ChatPrompt):
            tokens = self.chat.encode(tokens_or_text)
        elif isinstance(tokens_or_text, str):
            if len(tokens_or_text) > MAX_CHARS_PER_TOKEN * self.max_seq:
                raise SequenceTooLongError(f"text of {len(tokens_or_text)} characters cannot fit max_seq={self.max_seq}")
            tokens = self.encode(tokens_or_text)
        else:
            tokens = token_list(tokens_or_text)
        if not tokens:
            raise InvalidTokenError("nothing to append: empty token list")
        self._ids(tokens)
        if len(tokens) > room:
            raise SequenceTooLongError(
                f"{len(tokens)} tokens do not fit: the session holds {self.max_seq - room} of max_seq={self.max_seq}"
            )
        return tokens


def token_list(value: object) -> list:
    """The elements of a list, a tuple or a 1-D integer tensor, in order (checked as ids by the caller);
    InvalidTokenError for any other type."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise InvalidTokenError(f"a token tensor must be 1-D of an integer dtype, got {value.dim()}-D {value.dtype}")
        return value.tolist()
    raise InvalidTokenError(
        f"tokens must be text (str), a list or tuple of ints, or a 1-D integer tensor; got {type(value).__name__}"
        + (" (decode bytes to text first)" if isinstance(value, (bytes, bytearray, memoryview)) else ""))
