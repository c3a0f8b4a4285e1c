"""Grammar matchers for constrained decoding (llguidance): one state per generate, the token masks of a
decode batch. What a constraint says is protocol/constraint.py."""
from __future__ import annotations

import threading
from functools import lru_cache
from typing import Sequence

import torch

from capsulert.errors import InvalidRequestError
from capsulert.protocol.constraint import Constraint, _llguidance

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
