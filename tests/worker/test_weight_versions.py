"""Issue 29 item 2: weight versions never mix. A session open across update_weights is stale (every verb
that reads or extends its state is refused, typed, changing nothing) until it is re-derived, restored into
or closed; a generate that an update lands in ends at that step boundary with all of its tokens sampled
under the version it reports; capsules are never labelled with weights that did not compute them, and
rebuild re-derives a stale one. Every check is bitwise against a cold prefill under the named weights."""
import asyncio
import threading

import pytest
import torch

from capsulert.errors import StaleCapsuleError, StaleSessionError
from capsulert.sessions.local import AsyncEngine
from capsulert.protocol.sampling import SamplingParams
from capsulert.protocol.results import FinalEvent

NOEOS = SamplingParams(ignore_eos=True)


def nudged(engine, seed=1, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * v.abs().mean() * torch.randn(v.shape, generator=g).to(v.device, v.dtype)
            for k, v in engine.model_weights.items()}


def cold(engine, tokens):
    """A new session prefilled with `tokens` under the engine's current weights."""
    s = engine.open(namespace=None)
    s.append(list(tokens))
    return s


def test_a_session_open_across_an_update_is_refused_until_rederived(make_engine, text):
    eng = make_engine()
    s = eng.open()
    s.append(text[:300])
    s.generate(20, NOEOS)  # part of its state came from decode steps
    tokens, free, listing = list(s.tokens), eng.free_slots, eng.store.list()
    assert eng.update_weights(nudged(eng)) == 1 and s.stale
    for verb in (lambda: s.append([5, 6]), lambda: s.generate(3), lambda: s.logits(),
                 lambda: s.snapshot("mixed"), lambda: eng.generate([s], 2)):
        with pytest.raises(StaleSessionError, match="weights version 0"):
            verb()
    assert s.tokens == tokens and eng.free_slots == free and eng.store.list() == listing  # nothing changed
    assert s.rederive() == len(tokens) and not s.stale
    ref = cold(eng, tokens)
    assert torch.equal(s.logits(), ref.logits())
    assert s.generate(16, NOEOS) == ref.generate(16, NOEOS)
    ref.close()
    s.snapshot("after")  # made under the new weights, labelled so, and restores bitwise
    assert eng.store.info("after").meta.fingerprint == eng.fingerprint
    r = eng.restore("after")
    assert torch.equal(r.logits(), s.logits())


def test_restoring_into_a_stale_session_or_closing_it_is_allowed(make_engine, text):
    eng = make_engine()
    s = eng.open()
    s.append(text[:200])
    stale = eng.open()
    stale.append(text[:260])
    eng.update_weights(nudged(eng))
    s.rederive()
    s.snapshot("now")
    assert stale.restore("now") in ("device", "host", "disk") and not stale.stale  # all of its state replaced
    assert torch.equal(stale.logits(), s.logits())
    other = eng.open()
    other.append(text[:100])
    eng.update_weights(nudged(eng, seed=2))
    free = eng.free_slots
    other.close()
    assert eng.free_slots == free + 1
    empty = eng.open()
    eng.update_weights(nudged(eng, seed=3))
    empty.append(text[:50])  # an empty session computed nothing: it takes the current weights
    assert torch.equal(empty.logits(), cold(eng, empty.tokens).logits())


def test_stale_capsules_are_rebuilt_under_the_new_weights_and_refusals_leak_no_slots(make_engine, text):
    eng = make_engine(slots=3)
    s = eng.open()
    s.append(text[:270])
    s.snapshot("c", pin=True)
    s.snapshot("r", mode="replay")
    s.close()
    eng.update_weights(nudged(eng))
    for verb in (lambda: eng.restore("c"), lambda: eng.fork("c", 3), lambda: eng.restore("r")):
        with pytest.raises(StaleCapsuleError, match="version 0"):
            verb()
        assert eng.free_slots == 3
    ref = eng.rebuild("c")
    assert ref is not None and ref.name == "c" and eng.store.info("c").pinned  # what it did: a new capsule
    assert eng.store.info("c").meta.fingerprint == eng.fingerprint and eng.rebuild("c") is None
    assert eng.rebuild("r") is not None
    tokens = eng.store.info("c").meta.tokens
    for name in ("c", "r"):
        r = eng.restore(name)
        ref_s = cold(eng, tokens)
        assert torch.equal(r.logits(), ref_s.logits())
        r.close()
        ref_s.close()


async def test_async_refusals_of_stale_capsules_leak_no_slots(make_engine, text):
    eng = make_engine(slots=2)
    s = eng.open()
    s.append(text[:200])
    s.snapshot("old")
    s.close()
    eng.update_weights(nudged(eng))
    async with AsyncEngine(eng) as aeng:
        keep = await aeng.open(text[:40])
        for verb in (lambda: aeng.restore("old"), lambda: aeng.fork("old", 1),
                     lambda: keep.turn([7], 2, restore="old")):
            with pytest.raises(StaleCapsuleError):
                await verb()
            assert eng.free_slots == 1 and aeng.scheduler.session_count == 1
        assert len(await keep.generate(3, NOEOS)) == 3  # the refused in-place restore changed nothing
        await keep.close()


async def test_a_generate_an_update_lands_in_ends_at_the_step_boundary(make_engine, text):
    """The reported case: a generate spanning update_weights sampled under both versions and reported one.
    Now it ends at the step the update landed before, every token of it the old weights' (bitwise the
    old-weights run), and its session is stale until re-derived."""
    eng = make_engine()
    ref = cold(eng, eng.tokenize(text[:300]))
    want = ref.generate(200, NOEOS)
    ref.close()
    new = nudged(eng)
    async with AsyncEngine(eng) as aeng:
        s = await aeng.open(text[:300])
        updated = threading.Event()
        seen = 0
        async for ev in s.stream(200, NOEOS):
            if isinstance(ev, FinalEvent):
                res = ev.result
                break
            seen += 1
            if seen == 20:
                asyncio.get_running_loop().run_in_executor(None, lambda: (eng.update_weights(new), updated.set()))
        assert updated.wait(30)
        assert res.stop_reason == "weights_updated" and res.weights_version == 0
        assert 20 <= len(res) < 200 and list(res) == list(want[:len(res)])
        assert res.logprobs == want.logprobs[:len(res)]
        with pytest.raises(StaleSessionError):
            await s.generate(4, NOEOS)
        assert await s.rederive() == len(eng.tokenize(text[:300])) + len(res)
        tokens = eng.tokenize(text[:300]) + list(res)
        got = await s.generate(12, NOEOS)
        await s.close()
    assert got.weights_version == 1
    assert got == cold(eng, tokens).generate(12, NOEOS)  # continued as a cold prefill under the new weights
