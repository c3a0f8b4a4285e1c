"""The oracle drafter (tests and benchmarks only): proposes the continuation of a known token stream, with
every j-th drafted position corrupted, so acceptance can be forced to 100% or lowered at will."""
from __future__ import annotations

from typing import Sequence

from capsulert.engine.drafters.base import DraftRequest, Drafter, DraftSource, register_drafter
from capsulert.errors import InvalidRequestError


@register_drafter("oracle")
class OracleDrafter(Drafter):
    def __init__(self, streams: Sequence[Sequence[int]] = (), corrupt_every: int = 0):
        """`streams`: whole token sequences (a prompt and the output a plain run gave it); a session whose
        tokens are a prefix of one gets the rest of it. `corrupt_every=j` (> 0) replaces the draft for every
        sequence index i with (i + 1) % j == 0 by another token."""
        if not isinstance(corrupt_every, int) or corrupt_every < 0:
            raise InvalidRequestError(f"corrupt_every must be an int >= 0, got {corrupt_every!r}")
        self.streams = [list(s) for s in streams]
        self.corrupt_every = corrupt_every

    def propose(self, runner: DraftSource, requests: Sequence[DraftRequest]) -> list[list[int]]:
        vocab = runner.model_cfg.vocab_size  # type: ignore[attr-defined]
        out = []
        for r in requests:
            n = len(r.tokens)
            stream = next((s for s in self.streams if len(s) > n and s[:n] == list(r.tokens)), None)
            drafts = [] if stream is None or r.k <= 0 else stream[n:n + r.k]
            out.append([self._corrupt(t, n + i, vocab) for i, t in enumerate(drafts)])
        return out

    def _corrupt(self, token: int, index: int, vocab: int) -> int:
        j = self.corrupt_every
        return (token + 1) % vocab if j and (index + 1) % j == 0 else token
