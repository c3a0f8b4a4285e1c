"""The MTP drafter: the model's multi-token-prediction head, chained k times (ModelRunner.mtp_draft, on a
checkpoint that has the head). A runner without one refuses the request (InvalidRequestError): it names a
drafter this model cannot run."""
from __future__ import annotations

from typing import Sequence

from capsulert.engine.drafters.base import DraftRequest, Drafter, DraftSource, register_drafter
from capsulert.errors import InvalidRequestError


@register_drafter("mtp")
class MtpDrafter(Drafter):
    def check(self, runner: DraftSource) -> None:
        if not runner.has_mtp:
            raise InvalidRequestError("speculate_drafter 'mtp' needs a model with an MTP head, and this engine's "
                                      "has none; use speculate_drafter='ngram'")

    def propose(self, runner: DraftSource, requests: Sequence[DraftRequest]) -> list[list[int]]:
        self.check(runner)
        live = [r for r in requests if r.k > 0]
        out: dict[int, list[int]] = {}
        if live:
            k = max(r.k for r in live)
            rows = runner.mtp_draft([r.slot for r in live], [r.tokens[-1] for r in live], k)  # [len(live), k]
            for r, row in zip(live, rows.tolist()):
                out[id(r)] = [int(t) for t in row[:r.k]]
        return [out.get(id(r), []) for r in requests]
