"""Speculative decode, bitwise equal to plain decode.

A speculating stream (SamplingParams.speculate = k) samples its next token x as plain decode does, asks its
drafter for up to k tokens d1..dk that may follow, and feeds x, d1, ..., dk in one step
(SessionTable.verify -> ModelRunner.verify): each position with decode's own numerics (a decode row at its
position, batch-invariant, against the KV before it, the conv and recurrent state advanced token by token by
decode's step kernels), so the logits at every position are bitwise those plain decode computes there. Then
the token plain decode would pick after x is drawn from the first position's logits, at its own index of the
session's seeded stream (greedy: the argmax); while it equals d1 the stream commits d1 and draws from the next
position, and so on. The first mismatch (or the last draft) ends the step: the stream keeps what it
committed, its state goes back to its last committed token (RollbackStates), and the logits there are its
next ones; the token that did not match is drawn again, at the same index, from those logits next step. So
every committed token is the one plain decode draws at its index from the logits plain decode computes, and
stop rules, max_tokens, logprobs and top logprobs see each committed token one by one, as plain decode's do;
a stream that stops mid-draft keeps the state after its stopping token, as plain decode does.

Pacing (DraftPacing): a verify step costs more than the decode step it replaces (on an H100, 9B shape, a
4-row verify step 10.3 ms against a 6.84 ms decode step), so drafts that do not land slow the stream down. A
stream whose recent drafts land less often than ACCEPTANCE_FLOOR drafts one step in PROBE_EVERY until they
land again. Drafting changes no committed token, so pacing changes only the time.

Limits that keep it exact: a step feeds no position past the session's next grid point (decode re-derives
the state there through the prefill path: the step then ends on it and re-derives it as decode would), past
max_seq, or past max_tokens; constraints are refused with speculation (SamplingParams). A stream without
room, or beyond the runner's rollback sets (EngineConfig.speculate_slots), decodes plainly that step. Streams
of one decode group share the step: the plain ones are its first position's rows.
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from capsulert.engine.drafters import DraftRequest, Drafter
from capsulert.engine.runner import decode_groups
from capsulert.engine.sampler import SamplingPlan
from capsulert.engine.session import Session
from capsulert.engine.stops import StopRule
from capsulert.protocol.results import GenerateResult, TokenEvent
from capsulert.protocol.sampling import SamplingParams


# a stream whose recent acceptance is below this drafts one step in PROBE_EVERY: at 0.3 per position, k = 3
# drafts commit ~1.4 tokens a step, about what a 4-row verify step costs against a decode step (1.5x, H100)
ACCEPTANCE_FLOOR = 0.3
PROBE_EVERY = 8
RECENT = 0.5  # the weight of a step's acceptance in the running one


class DraftPacing:
    """Whether a speculating stream drafts this step: every step while its recent drafts land, one step in
    PROBE_EVERY (a probe, which may find they land again) while they do not. Its running acceptance starts at 1:
    a stream's first drafts are always tried."""

    def __init__(self) -> None:
        self.acceptance = 1.0  # accepted / drafted of the recent verify steps, weighted toward the latest
        self.skipped = 0  # steps without drafts since the last probe

    def drafts_now(self) -> bool:
        """Called once a step the stream has room to draft."""
        if self.acceptance >= ACCEPTANCE_FLOOR:
            return True
        self.skipped += 1
        if self.skipped < PROBE_EVERY:
            return False
        self.skipped = 0
        return True

    def verified(self, drafted: int, accepted: int) -> None:
        self.acceptance = RECENT * accepted / drafted + (1 - RECENT) * self.acceptance


class Stream(Protocol):
    """What speculation reads of a generate in flight (decoding.DecodeStream)."""
    session: Session
    params: SamplingParams
    seed: int
    drafter: Drafter | None
    pacing: DraftPacing
    result: GenerateResult
    rule: StopRule
    done: bool


class Group(Protocol):
    """A decode group (decoding._Batch): its streams and the logits block they sample from."""
    streams: list
    block: torch.Tensor


Commit = Callable[[Stream, int, float, list], "str | None"]


def draft_room(st: Stream, max_seq: int, grid: int) -> int:
    """How many drafts a step can verify after the stream's sampled token: up to its speculate, and no
    position past its next grid point, max_seq or max_tokens."""
    n = len(st.session.tokens)  # the sampled token goes to position n
    next_grid = (n // grid + 1) * grid
    left = st.rule.max_new - len(st.result) - 1
    return max(0, min(st.params.speculate, next_grid - n - 1, max_seq - n - 1, left))


def draft(engine, group: Sequence[Stream], tokens: list[int]) -> list[list[int]]:
    """Each stream's tokens for this step: its sampled token, then the drafts it verifies (none for a plain
    stream, or one without room or a rollback set)."""
    fed = [[t] for t in tokens]
    runner = engine.runner
    asks: dict[int, list[tuple[int, DraftRequest]]] = {}
    drafters: dict[int, Drafter] = {}
    for r, st in enumerate(group):
        if st.drafter is None or sum(len(v) for v in asks.values()) >= runner.rollback.capacity:
            continue
        k = draft_room(st, engine.config.max_seq, runner.grid)
        if k and st.pacing.drafts_now():
            drafters[id(st.drafter)] = st.drafter
            asks.setdefault(id(st.drafter), []).append((r, DraftRequest(st.session.slot, [*st.session.tokens, tokens[r]], k)))
    vocab = runner.model_cfg.vocab_size
    for key, items in asks.items():
        proposed = drafters[key].propose(runner, [req for _, req in items])
        for (r, req), drafts in zip(items, proposed):
            for t in list(drafts)[:req.k]:  # a drafter's bad token ends its draft: it could never be accepted
                if not isinstance(t, int) or not 0 <= t < vocab:
                    break
                fed[r].append(t)
    return fed


def speculative_step(engine, batch: Group, fed: list[list[int]], rest, commit: Commit,
                     events: bool) -> list[tuple[Stream, TokenEvent]]:
    """One decode step of `batch`'s streams where some verify drafts (fed[r] = sampled token + drafts);
    `rest`: the sampled tokens' logprobs (SamplingPlan.start); `commit`: decoding's commit of one token (its
    stop rule). Writes each live stream's next logits into its row of the batch's block."""
    group = batch.streams
    table = engine.table
    starts = [len(st.session.tokens) for st in group]
    rows = table.verify([st.session for st in group], fed)
    logprobs, tops = rest()
    drawn = _draw_positions(engine, group, rows, fed, starts)
    out = []
    for r, st in enumerate(group):
        if len(fed[r]) == 1:
            batch.block[r].copy_(rows[r][0])
            shown = commit(st, fed[r][0], logprobs[r], tops[r])
            if events:
                out.append((st, TokenEvent(fed[r][0], logprobs[r], shown, len(st.result) - 1, tuple(tops[r]))))
            continue
        accepted = 1
        while accepted < len(fed[r]) and drawn[r][accepted - 1][0] == fed[r][accepted]:
            accepted += 1
        kept = 0
        for i in range(accepted):
            token = fed[r][i]
            lp, top = (logprobs[r], tops[r]) if i == 0 else drawn[r][i - 1][1:]
            table.accept(st.session, token)
            shown = commit(st, token, lp, top)
            kept += 1
            if events:
                out.append((st, TokenEvent(token, lp, shown, len(st.result) - 1, tuple(top))))
            if st.done:
                break
        st.result.drafted += len(fed[r]) - 1
        st.result.accepted += kept - 1
        st.pacing.verified(len(fed[r]) - 1, accepted - 1)
        row = table.settle(st.session, len(fed[r]), kept, rows[r])
        batch.block[r].copy_(row)
    return out


def _draw_positions(engine, group: Sequence[Stream], rows: list[torch.Tensor], fed: list[list[int]],
                    starts: list[int]) -> dict[int, list[tuple[int, float, list]]]:
    """For each speculating stream r, the token plain decode would draw after fed[r][i] (i < len - 1), with its
    logprob and top logprobs: row i of its logits at index starts[r] + 1 + i of its stream."""
    items = [(r, i) for r in range(len(group)) if len(fed[r]) > 1 for i in range(len(fed[r]) - 1)]
    drawn: dict[int, list[tuple[int, float, list]]] = {r: [] for r, _ in items}
    runner = engine.runner
    for chunk in decode_groups(items):
        block = runner.pad_logits([rows[r][i] for r, i in chunk])
        plan = SamplingPlan([group[r].params for r, _ in chunk], [group[r].seed for r, _ in chunk], block.shape[0],
                            block.shape[1], block.device)
        tokens, rest = plan.start(block, [starts[r] + 1 + i for r, i in chunk])
        lps, tops = rest()
        for (r, _), t, lp, top in zip(chunk, tokens, lps, tops):
            drawn[r].append((t, lp, top))
    return drawn
