"""Grammar matchers for constrained decoding (llguidance): one state per generate, the token masks of a
decode batch. What a constraint says is protocol/constraint.py.

Masks are computed off the decode step (mask_worker.py): a GrammarState asks for its first mask when its
generate starts and for each next one as soon as the token before it is committed; the step reads a mask
only once it is ready (`ready`), so a session whose mask is late skips steps, never holds them. A mask is
the same whenever it is computed (it depends only on the tokens the grammar took), so skipping changes no
token. A grammar whose mask runs longer than its budget (MASK_BUDGET_S) ends its generate with a
GrammarTooCostlyError instead of stalling it for ever."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from functools import lru_cache
from typing import Any, Callable, Sequence

import torch

from capsulert.engine.mask_worker import MaskWorker, PendingMask
from capsulert.errors import GrammarTooCostlyError, InvalidRequestError
from capsulert.protocol.constraint import Constraint, _llguidance

# how long one mask may run on its thread (building the matcher before the first is not counted):
# `(a{1000}){1000}` takes 1.5 to 3.6 s for its first on the 2-core CPU box; the usual mask 10 us to 1 ms
MASK_BUDGET_S = 0.5


def llguidance_error(matcher) -> str:
    """A matcher's error, its first line: llguidance appends its state and the whole grammar (200 KB for a
    long choice), which no client needs to read back."""
    return matcher.get_error().strip().split("\n", 1)[0][:500]


class GrammarState:
    """One generate's position in its grammar: the mask of its next token (computed by the mask worker),
    and each committed token taken once. The loop thread touches the matcher only while no computation
    of it is pending (after its mask is ready, before the next is asked for)."""

    def __init__(self, build: Callable[[], Any], words: int, worker: MaskWorker, budget_s: float):
        self._matcher: Any = None
        self._worker, self._budget_s = worker, budget_s
        self._mask = torch.full((words,), -1, dtype=torch.int32)  # written only by the pending computation
        self.accepted = 0  # tokens taken: one per token the session committed during this generate
        self._woken: PendingMask | None = None

        def prepare() -> None:  # the closures keep this state (and its buffer) alive until llguidance is done
            self._matcher = build()
        self._pending = worker.submit(self._compute, prepare)

    def _compute(self) -> None:
        m = self._matcher
        m.unsafe_compute_mask_ptr(self._mask.data_ptr(), self._mask.numel() * self._mask.element_size())
        if m.is_error():
            raise InvalidRequestError(f"invalid constraint: {llguidance_error(m)}")

    def ready(self, now: float | None = None) -> bool:
        """Whether the next token's mask is computed (False while it is, within the budget). Raises the
        grammar's typed error: llguidance refused it (InvalidRequestError), or its mask has run past the
        budget (GrammarTooCostlyError)."""
        pending = self._pending
        if pending.future.done():
            pending.future.result()
            return True
        if pending.running_for(time.monotonic() if now is None else now) > self._budget_s:
            which = "first token mask" if self.accepted == 0 else f"token mask after {self.accepted} tokens"
            raise GrammarTooCostlyError(
                f"the constraint's {which} took more than {self._budget_s:g} s to compute; a grammar this costly "
                "would stall its generate, so it is refused: simplify it (bounded repetitions, fewer alternatives)")
        return False

    def when_ready(self, callback: Callable[[], object]) -> None:
        """Call `callback` (on the worker's thread) once the pending mask is computed; at most once per mask."""
        if self._woken is not self._pending:
            self._woken = self._pending
            self._pending.future.add_done_callback(lambda _: callback())

    @property
    def pending(self) -> Future[None]:
        """The computation of the next mask (done once it is ready, or failed)."""
        return self._pending.future

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 host bitmask [rows, words] (once ready)."""
        bitmask[row].copy_(self._mask)

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):  # the mask allowed it: llguidance's parser limits refused it
            raise InvalidRequestError(f"the constraint cannot take token {token}: {llguidance_error(self._matcher)}")
        self.accepted += 1

    def request_next(self) -> None:
        """Compute the next token's mask now, while the steps before it run (after `accept`)."""
        self._pending = self._worker.submit(self._compute)

    @property
    def complete(self) -> bool:
        """The grammar can take no more tokens (the output is complete)."""
        return self._matcher.is_stopped()


class Grammars:
    """The engine's grammar side: llguidance's view of the tokenizer (built on first use, on the mask
    worker: ~30 ms for the default model, longer for a large vocabulary), the mask worker, and a
    GrammarState per constrained generate. `masks` and `budget_s` are the worker and the per-mask budget
    every new state gets (tests hold masks through their own worker)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], masks: MaskWorker | None = None,
                 budget_s: float = MASK_BUDGET_S):
        self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, list(eos_token_ids)
        self._lock = threading.Lock()
        self._ll = None
        self.masks = masks or MaskWorker()
        self.budget_s = budget_s

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
        """A new generate's grammar state; its matcher and first mask are computed on the mask worker."""
        if self._tokenizer is None:
            raise InvalidRequestError("constrained decoding needs the model's tokenizer; this model has none")
        grammar = constraint.llguidance_grammar

        def build():
            matcher = _llguidance().LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
            if matcher.is_error():
                raise InvalidRequestError(f"invalid constraint: {llguidance_error(matcher)}")
            return matcher
        return GrammarState(build, self.words, self.masks, self.budget_s)

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
