"""Grammar masks off the decode step (engine/mask_worker.py): a session whose mask is late skips steps
without changing any token, never delays another session's steps (its first mask included), and a mask past
its budget fails the generate with a typed error, its session put back as it was."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from capsulert.engine.grammar import Grammars
from capsulert.engine.mask_worker import MaskWorker
from capsulert.errors import GrammarTooCostlyError, InvalidRequestError
from capsulert.protocol.constraint import Constraint
from capsulert.protocol.sampling import SamplingParams
from capsulert.serve.http_errors import kind_of
from capsulert.sessions.local import AsyncEngine

LETTERS = Constraint(regex="[a-z ]{40}")
SAMPLINGS = {"greedy": (SamplingParams(constraint=LETTERS), SamplingParams(ignore_eos=True)),
             "seeded": (SamplingParams(temperature=0.9, seed=11, constraint=LETTERS),
                        SamplingParams(temperature=0.9, seed=5, ignore_eos=True))}


class HeldMasks(MaskWorker):
    """A deliberately slow mask: the `held`-th computation (1-based, counted over every grammar) waits until
    `release()` (60 s at most, so a failing test frees its thread)."""

    def __init__(self, held: int):
        super().__init__(threads=2)
        self.held, self.count, self.gate = held, 0, threading.Event()

    def submit(self, compute, prepare=None):
        self.count += 1
        if self.count != self.held:
            return super().submit(compute, prepare)

        def slow() -> None:
            self.gate.wait(60)
            compute()
        return super().submit(slow, prepare)

    def release(self) -> None:
        self.gate.set()


def _hold(engine, held: int, budget_s: float = 60.0) -> HeldMasks:
    worker = HeldMasks(held)
    engine.grammars = Grammars(engine.tokenizer, engine.model_cfg.vocab_size, engine.eos_token_ids, masks=worker,
                               budget_s=budget_s)
    return worker


def _solo(engine, prompt: str, n: int, params: SamplingParams):
    s = engine.open()
    s.append(prompt)
    out = engine.generate([s], n, [params])[0]
    s.close()
    return out


@pytest.mark.parametrize("kind", sorted(SAMPLINGS))
@pytest.mark.parametrize("held", [1, 3])  # the first mask, and one after two committed tokens
def test_a_held_mask_skips_steps_and_changes_no_token(engine, kind, held):
    """Engine.generate of a constrained session A beside an unconstrained B, A's `held`-th mask held until B
    has made 6 tokens: A is skipped meanwhile (it holds held - 1 tokens when the mask is released) and both
    give the tokens and logprobs they give alone."""
    pa, pb = SAMPLINGS[kind]
    want_a, want_b = _solo(engine, "Spell it: ", 10, pa), _solo(engine, "The capsule runtime ", 10, pb)
    worker = _hold(engine, held)
    a, b = engine.open(), engine.open()
    a.append("Spell it: ")
    b.append("The capsule runtime ")
    a_start, b_made, a_at_release = len(a.tokens), [0], []

    def should_stop(session) -> bool:
        if session is b:
            b_made[0] += 1
            if b_made[0] == 6:
                a_at_release.append(len(a.tokens) - a_start)
                worker.release()
        return False
    got_a, got_b = engine.generate([a, b], 10, [pa, pb], should_stop=should_stop)
    assert a_at_release == [held - 1]
    assert got_a.tokens == want_a.tokens and got_a.logprobs == want_a.logprobs and len(got_a) > held
    assert got_b.tokens == want_b.tokens and got_b.logprobs == want_b.logprobs


@pytest.mark.parametrize("held", [1, 3])
async def test_a_held_mask_does_not_delay_another_sessions_steps(engine, held):
    """Through the step scheduler: B generates all its 12 tokens while A's mask is held (A's first mask:
    A has not even joined decode); once released, A's tokens are those it makes alone."""
    pa, pb = SAMPLINGS["seeded"]
    want = _solo(engine, "Spell it: ", 8, pa)
    worker = _hold(engine, held)
    async with AsyncEngine(engine) as aeng:
        a = await aeng.open("Spell it: ")
        b = await aeng.open("The capsule runtime ")
        slow = asyncio.ensure_future(a.generate(8, pa))
        try:
            other = await asyncio.wait_for(b.generate(12, pb), 60)
            assert len(other.tokens) == 12 and not slow.done()
        finally:
            worker.release()
        got = await asyncio.wait_for(slow, 60)
        assert got.tokens == want.tokens and got.logprobs == want.logprobs


@pytest.mark.parametrize("held", [1, 3])
def test_a_mask_past_its_budget_is_a_typed_error_and_the_session_is_put_back(engine, held):
    worker = _hold(engine, held, budget_s=0.05)
    try:
        s = engine.open()
        s.append("Spell it: ")
        before = list(s.tokens)
        logits = s.logits().clone()
        with pytest.raises(GrammarTooCostlyError, match="more than 0.05 s"):
            s.generate(8, SamplingParams(constraint=LETTERS))
        assert s.tokens == before and bool((s.logits() == logits).all())
    finally:
        worker.release()
    assert kind_of(GrammarTooCostlyError("x")).status == 400 and kind_of(GrammarTooCostlyError("x")).code == \
        "grammar_too_costly"
    assert isinstance(GrammarTooCostlyError("x"), InvalidRequestError)


@pytest.mark.parametrize("held", [1, 3])
async def test_a_turn_whose_mask_passes_its_budget_fails_typed_and_leaves_no_prompt(engine, held):
    """A turn (append + generate) through the scheduler: the error reaches the caller, the turn's prompt
    and tokens are undone, and another session decoding beside it finishes untouched."""
    pb = SAMPLINGS["greedy"][1]
    want_b = _solo(engine, "The capsule runtime ", 16, pb)
    worker = _hold(engine, held, budget_s=0.05)
    try:
        async with AsyncEngine(engine) as aeng:
            a = await aeng.open("Spell it: ")
            b = await aeng.open("The capsule runtime ")
            before = await a.tokens()
            other = asyncio.ensure_future(b.generate(16, pb))
            with pytest.raises(GrammarTooCostlyError):
                await a.turn(" now", 8, SamplingParams(constraint=LETTERS))
            assert await a.tokens() == before
            got_b = await asyncio.wait_for(other, 60)
            assert got_b.tokens == want_b.tokens
    finally:
        worker.release()


async def test_a_grammar_its_parser_refuses_part_way_fails_alone(engine):
    """A 2,500-way choice compiles, but llguidance's parser refuses its first token (more items in a row than
    its limit): that generate fails typed, with the error's first line only (llguidance appends the whole
    grammar), and its session is put back; the session decoding beside it finishes as it does alone. Before,
    the error escaped the step and failed every session in it."""
    choice = Constraint(grammar="start: " + " | ".join(f'"opt {i}"' for i in range(2500)))
    pb = SAMPLINGS["greedy"][1]
    want_b = _solo(engine, "The capsule runtime ", 16, pb)
    async with AsyncEngine(engine) as aeng:
        a = await aeng.open("Pick one: ")
        b = await aeng.open("The capsule runtime ")
        before = await a.tokens()
        other = asyncio.ensure_future(b.generate(16, pb))
        with pytest.raises(InvalidRequestError, match="items") as refused:
            await a.generate(4, SamplingParams(constraint=choice))
        assert len(str(refused.value)) < 600 and "opt 2499" not in str(refused.value)
        assert await a.tokens() == before
        got_b = await asyncio.wait_for(other, 60)
        assert got_b.tokens == want_b.tokens


def test_building_the_matcher_is_not_charged_to_the_first_masks_budget(engine):
    """A 15k-way choice takes ~1 s to build its matcher (the compile its Constraint's check already paid):
    only the mask computations count against the budget."""
    class SlowBuild(MaskWorker):
        def submit(self, compute, prepare=None):
            def slow_prepare() -> None:
                time.sleep(0.3)
                if prepare is not None:
                    prepare()
            return super().submit(compute, slow_prepare)

    engine.grammars = Grammars(engine.tokenizer, engine.model_cfg.vocab_size, engine.eos_token_ids,
                               masks=SlowBuild(1), budget_s=0.1)
    s = engine.open()
    s.append("Spell it: ")
    assert len(s.generate(4, SamplingParams(constraint=LETTERS))) == 4
