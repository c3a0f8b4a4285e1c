"""Grammar matchers for constrained decoding (llguidance): one state per generate, the token masks of a
decode batch. What a constraint says is protocol/constraint.py."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from functools import lru_cache
from typing import Sequence

import torch

from capsulert.errors import InvalidRequestError
from capsulert.protocol.constraint import Constraint, _llguidance

# a grammar's first token mask is computed when its generate starts, off the decode step and within this
# budget: a short regex like `(a{1000}){1000}` took ~2 s for its first mask inside the shared step, stalling
# every session's decode; past the budget the generate is refused (InvalidRequestError) and the mask left
# to finish on its own thread (llguidance releases the GIL while it computes)
FIRST_MASK_BUDGET_S = 0.5
MASK_THREADS = 4

class GrammarState:
    """One generate's position in its grammar: fills its mask row, takes each committed token once."""

    def __init__(self, matcher, first_mask: torch.Tensor | None = None):
        self._matcher = matcher
        self.accepted = 0  # tokens taken: one per token the session committed during this generate
        self._first = first_mask  # the mask before any token, computed when the generate started

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 host bitmask [rows, words]."""
        if self._first is not None and self.accepted == 0:
            bitmask[row].copy_(self._first)
            return
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
        self._masks: ThreadPoolExecutor | None = None  # first masks (FIRST_MASK_BUDGET_S), made on first use

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
        first = torch.full((self.words,), -1, dtype=torch.int32)
        with self._lock:
            if self._masks is None:
                self._masks = ThreadPoolExecutor(MASK_THREADS, thread_name_prefix="capsulert-grammar-mask")
        def compute() -> None:  # holds `first` (and the matcher) until llguidance is done writing into it, even
            matcher.unsafe_compute_mask_ptr(first.data_ptr(), first.numel() * first.element_size())  # if refused
        work = self._masks.submit(compute)
        try:
            work.result(FIRST_MASK_BUDGET_S)
        except FutureTimeout:
            raise InvalidRequestError(f"the constraint's first token mask took more than {FIRST_MASK_BUDGET_S:g} s to "
                                      "compute; a grammar this costly would stall every session's decode, so it is "
                                      "refused: simplify it (bounded repetitions, fewer alternatives)") from None
        if matcher.is_error():
            raise InvalidRequestError(f"invalid constraint: {matcher.get_error()}")
        return GrammarState(matcher, first)

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
