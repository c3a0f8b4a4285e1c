"""Prompt lookup: drafts by finding the session's last n tokens earlier in its own tokens and proposing what
followed them there. No weights; agents repeat tool output, code and quoted context, which this catches."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from capsulert.engine.drafters.base import DraftRequest, Drafter, DraftSource, register_drafter

# the longest suffix looked up first: longer matches predict better, shorter ones match more often
MAX_NGRAM = 3
MIN_NGRAM = 1


@register_drafter("ngram")
class NgramDrafter(Drafter):
    def __init__(self, max_n: int = MAX_NGRAM, min_n: int = MIN_NGRAM):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, runner: DraftSource, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self.lookup(r.tokens, r.k) for r in requests]

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest suffix (max_n down to min_n tokens) that
        occurs earlier, up to k tokens; [] when none does."""
        L = len(tokens)
        if k <= 0 or L < self.min_n + 1:
            return []
        ids = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            suffix = ids[L - n:]
            # starts p < L - n with ids[p:p+n] == suffix, latest first
            hits = np.flatnonzero(ids[:L - n] == suffix[0])
            for i in range(1, n):
                hits = hits[ids[hits + i] == suffix[i]]
            if hits.size:
                p = int(hits[-1]) + n
                return [int(t) for t in ids[p:p + k]]
        return []
