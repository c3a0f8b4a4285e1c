"""One session's generate in flight (DecodeStream), and the batched step that advances many of them.

`advance` is the unit both the blocking `Engine.generate` and the step scheduler run: it samples one token
for every stream from its current logits (one vectorised draw per group of at most MAX_DECODE_BATCH), feeds
the tokens in one batched decode step per group, and applies each stream's stop rule. Streams never share
anything but the step, so a stream's tokens do not depend on its partners (batch invariance).

On a GPU the host work between a step's tokens reaching the host and the next step's launch leaves the GPU
idle, so a group that steps again with the same streams (a _Batch) keeps its logits block (the next step
samples it in place: no stacking or padding) and its sampling plan (the per-row parameters on the device),
and the next step is launched as soon as the tokens are on the host: before their logprobs (computed on the
GPU meanwhile) and the per-stream bookkeeping (text, stops, results, events), which then runs while the GPU
computes.

A constrained stream (SamplingParams.constraint) fills its row of the step's token bitmask before the
draw and takes its token into its grammar state once the token is committed, once per token; a grammar
that can take nothing more ends the generate ("grammar_end"). Constrained and unconstrained streams share
the step: the mask is applied row by row to the sampled block (engine/grammar.py). Masks are computed off
the step (engine/mask_worker.py): a stream whose next mask is not ready when a step starts skips that step
and keeps its logits for a later one. Its token is drawn from the same logits, mask and token index
whenever that step comes, so skipping changes no token; a mask past its budget fails the stream
(`error`, a GrammarTooCostlyError) and its caller undoes what the generate committed.

A speculating stream (SamplingParams.speculate = k) feeds its sampled token and up to k drafts in the step
(engine/speculation.py): each further position is verified with decode's own numerics and its token drawn as
plain decode would draw it there, and the stream commits its tokens while they equal the drafts; its output
is bitwise plain decode's, in fewer steps.

Weight updates land between steps (they take the engine lock, which a step holds): a stream whose session
was computed under older weights ends there, stop reason "weights_updated", so every token of a result
was sampled under its `weights_version`, never under two.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Callable, Protocol, Sequence

import torch

from capsulert.config.engine import EngineConfig
from capsulert.engine.drafters import Drafter, Drafters
from capsulert.engine.grammar import Grammars, allowed_tokens
from capsulert.engine.runner import ModelRunner, decode_groups
from capsulert.engine.sampler import SamplingPlan, resolve_seed
from capsulert.engine.session import Session
from capsulert.engine.session_table import SessionTable
from capsulert.engine.speculation import DraftPacing, draft, speculative_step
from capsulert.engine.stops import HeldText, StopRule, TextStream
from capsulert.errors import CapsuleRTError, InvalidRequestError
from capsulert.protocol.results import GenerateResult, TokenEvent
from capsulert.protocol.sampling import GREEDY, SamplingParams


class Decoder(Protocol):
    """What decoding reads of the engine that runs it (Engine is one)."""
    config: EngineConfig
    runner: ModelRunner
    table: SessionTable
    grammars: Grammars
    drafters: Drafters
    eos_token_ids: tuple[int, ...]
    tokenizer: object

    @property
    def lock(self) -> threading.RLock: ...

    @property
    def weights_version(self) -> int: ...

    def detokenize(self, tokens: Sequence[int]) -> str: ...


def check_generate(sessions, max_new_tokens, sampling) -> tuple[list[Session], list[SamplingParams | None]]:
    """Typed refusals of generate's arguments (before any state changes)."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise InvalidRequestError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if isinstance(sessions, Session) or not isinstance(sessions, Sequence):
        raise InvalidRequestError("generate takes a list of sessions")
    sessions = list(sessions)
    if not sessions:
        raise InvalidRequestError("generate needs at least one session")
    for s in sessions:
        if not isinstance(s, Session):
            raise InvalidRequestError(f"generate takes Session objects, got {type(s).__name__}")
    sampling = list(sampling) if sampling is not None else [None] * len(sessions)
    if len(sampling) != len(sessions):
        raise InvalidRequestError("one SamplingParams per session (or None)")
    for p in sampling:
        if p is not None and not isinstance(p, SamplingParams):
            raise InvalidRequestError(f"sampling entries must be SamplingParams or None, got {type(p).__name__}")
    return sessions, sampling


class DecodeStream:
    def __init__(self, engine: Decoder, session: Session, max_new_tokens: int,
                 sampling: SamplingParams | None):
        session.check_current()  # a stale session's tokens would mix two weights versions
        self.session, self.table = session, engine.table
        self.params = sampling or GREEDY
        self.drafter: Drafter | None = None
        self.pacing = DraftPacing()  # whether a speculating stream drafts in a step (speculation.py)
        self.held_steps = 0  # steps in a row it sat out to bound a step's grid re-derivations (advance)
        if self.params.speculate:  # an unknown drafter, or one this model cannot run, is refused before anything
            self.drafter = engine.drafters.get(self.params.speculate_drafter)
            self.drafter.check(engine.runner)
        self.seed = resolve_seed(self.params)
        self.rule = StopRule(self.params, engine.eos_token_ids, max_new_tokens, engine.runner.model_cfg.vocab_size)
        self.has_text = engine.tokenizer is not None
        self.text = TextStream(engine.detokenize if self.has_text else None)
        self.held = HeldText(tuple(self.params.stop))  # the output's text, and what the events showed of it
        self.result = GenerateResult(weights_version=engine.weights_version)
        self.logits: torch.Tensor | None = None  # next-token logits row (fp32 [vocab])
        self.batch: _Batch | None = None  # the group whose block holds `logits`
        self.done = max_new_tokens == 0
        self.start = len(session.tokens)  # the session's length before this generate (what a failure undoes)
        self.error: CapsuleRTError | None = None  # why the generate failed (then done, with no result)
        constraint = self.params.constraint
        self.grammar = None if constraint is None or self.done else engine.grammars.state(constraint)
        if self.done:
            self.finish("length")

    def finish(self, reason: str) -> str:
        """End the generate; the text its events have not shown yet ("" without a tokenizer)."""
        self.done = True
        self.logits = self.batch = None  # its group's block is not kept alive for it
        self.result.stop_reason = reason
        self.table.stopped(self.session, reason)
        self.result.length = len(self.session.tokens)
        if not self.has_text:
            return ""
        # past a stop string the text ends before it; otherwise an incomplete character at the end is released
        final = self.held.text if reason == "stop_string" else self.held.seen + self.text.flush()
        self.result.text = final
        return self.held.finish(final)

    def fail(self, error: CapsuleRTError) -> None:
        """End the generate with `error` instead of a result (its grammar was refused)."""
        self.done, self.error = True, error
        self.logits = self.batch = None

    @property
    def mask_pending(self) -> bool:
        """Its grammar's next mask is still being computed (it skips the steps until it is not)."""
        if self.done or self.grammar is None:
            return False
        try:
            return not self.grammar.ready()
        except CapsuleRTError:
            return False  # refused: the next step fails it

    def when_mask_ready(self, callback: Callable[[], object]) -> None:
        """Call `callback` (on the mask worker's thread) once its pending grammar mask is computed."""
        if self.grammar is not None:
            self.grammar.when_ready(callback)


class _Batch:
    """A decode group that steps together: its streams in row order, their next-token logits as the rows of
    `block` (the fixed-shape block the sampler runs on, its padding rows zero, as ModelRunner.pad_logits makes
    it) and the sampling plan of their parameters. Each step writes the new logits into the same block, so
    while the group stays the same the next step samples it as it is."""

    def __init__(self, streams: list[DecodeStream], block: torch.Tensor):
        self.streams = streams
        self.block = block
        self.plan = SamplingPlan([st.params for st in streams], [st.seed for st in streams], block.shape[0],
                                 block.shape[1], block.device)
        self.constrained = any(st.grammar is not None for st in streams)
        for r, st in enumerate(streams):
            if st.batch is not None:  # its old group is split: none of it may sample that block in place again
                st.batch.streams = []
            st.batch, st.logits = self, block[r]


def advance(engine: Decoder, streams: list[DecodeStream],
            should_stop: Callable[[DecodeStream], bool] | None = None,
            events: bool = True, rederive_sessions: int | None = None) -> list[tuple[DecodeStream, TokenEvent]]:
    """One token for every live stream. Returns the (stream, event) pairs produced, in stream order (none
    with events=False: a caller that reads only the results). Holds the engine lock throughout: the graphs'
    static inputs and outputs are shared by every step.

    `rederive_sessions`: the most streams whose step reaches a grid point (and so re-derives it) that step;
    the others skip it, as a stream whose grammar mask is late does (logits kept, tokens unchanged), and go
    first in a later one. None: no bound (one forward re-derives them all; a crowd in lockstep then makes
    one long step, where every stream's next token waits)."""
    with engine.lock:
        return _advance(engine, streams, should_stop, events, rederive_sessions)


def _advance(engine, streams, should_stop, events, rederive_sessions=None):
    max_seq = engine.config.max_seq
    live = []
    now = time.monotonic()
    for st in streams:
        if st.done:
            continue
        if len(st.session.tokens) >= max_seq:
            st.finish("max_seq")
            continue
        if st.session.weights_version != engine.weights_version:
            # update_weights ran between two steps: every token so far was sampled under the old weights (the
            # result's weights_version), and the next would come from old state fed through new weights
            st.finish("weights_updated")
            continue
        if st.grammar is not None and not _mask_ready(st, now):
            if not st.done and should_stop is not None and should_stop(st):
                st.finish("interrupted")
            continue  # its mask is late: it skips this step, its logits kept for the next
        live.append(st)
    if rederive_sessions is not None:
        live = _bound_rederivations(live, engine.runner.grid, rederive_sessions, should_stop)
    need = [st for st in live if st.logits is None]
    if need:
        for st, row in zip(need, engine.runner.logits_rows([st.session.slot for st in need])):
            st.logits = row
    out = []
    for group in decode_groups(live):
        batch = group[0].batch
        if batch is None or batch.streams != group:  # a new group: its rows stacked into a block of its own
            batch = _Batch(group, engine.runner.pad_logits([st.logits for st in group]))
        tokens, rest = batch.plan.start(batch.block, [len(st.session.tokens) for st in group],
                                        _allowed(engine, group, batch.block) if batch.constrained else None)
        fed = draft(engine, group, tokens)
        if any(len(f) > 1 for f in fed):
            out += speculative_step(engine, batch, fed, rest, lambda *a: _commit(*a, max_seq, should_stop), events)
            continue
        # copied out of the graph's output buffer: the next group's replay, or another thread's step between
        # ours, reuses it
        batch.block[:len(group)].copy_(engine.table.step([st.session for st in group], tokens)[:len(group)])
        logprobs, tops = rest()
        for r, st in enumerate(group):
            top = tops[r]  # empty unless this stream asked for logprobs
            shown = _commit(st, tokens[r], logprobs[r], top, max_seq, should_stop)
            if events and st.error is None:
                out.append((st, TokenEvent(tokens[r], logprobs[r], shown, len(st.result) - 1, tuple(top))))
    return out


def _reaches_grid(st: DecodeStream, grid: int) -> bool:
    """Whether the stream's step may feed the token that ends a grid chunk (a speculating one feeds up to
    1 + speculate tokens, never past it)."""
    return grid - len(st.session.tokens) % grid <= 1 + st.params.speculate


def _bound_rederivations(live: list[DecodeStream], grid: int, most: int,
                         should_stop: Callable[[DecodeStream], bool] | None) -> list[DecodeStream]:
    """`live` without the streams reaching a grid point past the first `most` of them, longest held first
    (then in stream order); a held stream keeps its logits and may be stopped while it waits."""
    reaching = [st for st in live if _reaches_grid(st, grid)]
    if len(reaching) <= most:
        for st in reaching:
            st.held_steps = 0
        return live
    order = sorted(range(len(reaching)), key=lambda i: (-reaching[i].held_steps, i))
    held = {id(reaching[i]) for i in order[max(1, most):]}
    out = []
    for st in live:
        if id(st) not in held:
            st.held_steps = 0
            out.append(st)
            continue
        st.held_steps += 1
        if should_stop is not None and should_stop(st):
            st.finish("interrupted")
    return out


def _commit(st: DecodeStream, token: int, logprob: float, top: list, max_seq: int, should_stop) -> str | None:
    """Record the stream's token and apply its stop rule; the text its event shows (None without a
    tokenizer)."""
    res = st.result
    res.append(token)
    res.logprobs.append(logprob)
    if st.params.logprobs:
        res.top_logprobs.append(top)
    if st.grammar is not None:
        try:
            st.grammar.accept(token)  # the token is committed: the grammar takes it, once
        except CapsuleRTError as e:  # llguidance's parser past its limits (a 15k-way choice): this stream only
            st.fail(e)
            return None
    delta = st.text.push(token)
    shown = None if delta is None else st.held.push(delta)
    reason = st.rule.check(token, len(res), st.held.cut is not None)
    if reason is None and st.grammar is not None and st.grammar.complete:
        reason = "grammar_end"
    if reason is None and len(st.session.tokens) >= max_seq:
        reason = "max_seq"  # full: no token can follow this one
    if reason is None and should_stop is not None and should_stop(st):
        reason = "interrupted"
    if reason is None and st.grammar is not None:
        st.grammar.request_next()  # computed while this step's other work and the next steps run
    if reason is not None:
        rest = st.finish(reason)
        if shown is not None:  # the last event carries the rest: the events add up to the result
            shown += rest
    else:
        res.length = len(st.session.tokens)
    return shown


def _mask_ready(st: DecodeStream, now: float) -> bool:
    """Whether a constrained stream's mask is ready; a refused grammar fails the stream (False)."""
    try:
        return st.grammar is None or st.grammar.ready(now)
    except CapsuleRTError as e:
        st.fail(e)
        return False


def wait_for_masks(streams: Sequence[DecodeStream], timeout: float = 0.01) -> None:
    """Block until a live stream can step (or `timeout` passes): at once unless every live stream waits
    for its grammar's mask. For a caller that runs `advance` in a loop of its own (Engine.generate)."""
    live = [st for st in streams if not st.done]
    pending = [st.grammar.pending for st in live if st.mask_pending and st.grammar is not None]
    if pending and len(pending) == len(live):
        wait(pending, timeout, FIRST_COMPLETED)


def _allowed(engine: Decoder, group: list[DecodeStream], block: torch.Tensor) -> torch.Tensor:
    """The step's boolean token mask [rows, vocab] (each constrained stream fills its own row; the others
    and the padding rows allow everything)."""
    bitmask = engine.grammars.bitmask(block.shape[0])
    for r, st in enumerate(group):
        if st.grammar is not None:
            st.grammar.fill(bitmask, r)
    return allowed_tokens(bitmask, block.shape[1], block.device)
