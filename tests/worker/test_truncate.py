"""truncate(n): a session rolled back to its first n tokens holds bitwise the state a cold prefill of those
tokens computes (the same next-token logits, torch.equal, and the same greedy continuation with the same
logprobs), on the sync Session and on the AsyncEngine's session; n == len changes nothing; n past the
session's length or below 0 is InvalidRequestError and leaves the session as it was."""
import pytest
import torch

from capsulert.errors import InvalidRequestError
from capsulert.protocol.requests import Truncate
from capsulert.protocol.sampling import SamplingParams
from capsulert.sessions.local import AsyncEngine

NOEOS = SamplingParams(ignore_eos=True, logprobs=3)
PROMPT_LEN, DECODED = 180, 30  # decode crosses grid point 192: its last 64 tokens re-derived on the way


@pytest.fixture
def corpus(engine):
    from capsulert.engine.default_model import CORPUS_PATH

    return engine.tokenize(CORPUS_PATH.read_text()[:6000])


def _cold(engine, tokens):
    """A fresh session prefilled with `tokens` (no prefix reuse) and its next-token logits."""
    s = engine.open(namespace=None)
    return s, s.append(tokens)


def _same_result(a, b) -> bool:
    return list(a) == list(b) and a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs


# inside the prompt (off and on the grid), at the prompt's end, inside the decoded tokens (off and on the grid)
CUTS = [1, 63, 64, 100, 128, PROMPT_LEN, 185, 192, 200]


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_sync_truncate_equals_a_cold_prefill(make_engine, corpus, prefix_cache):
    engine = make_engine(prefix_cache=prefix_cache)
    s = engine.open()
    s.append(corpus[:PROMPT_LEN])
    s.generate(DECODED, NOEOS)
    full = list(s.tokens)
    for n in sorted(CUTS, reverse=True):  # each cut from the previous one: truncate after truncate
        assert s.truncate(n) == n == len(s)
        assert s.tokens == full[:n]
        cold, want = _cold(engine, full[:n])
        assert torch.equal(s.logits(), want)
        cold.close()
    if prefix_cache:  # the cuts past a kept grid checkpoint restored it instead of prefilling from 0
        assert engine.store.stats()["prefix"]["hit_tokens"] >= 64
    cold, _ = _cold(engine, full[:1])
    assert _same_result(s.generate(12, NOEOS), cold.generate(12, NOEOS))  # the same continuation
    assert torch.equal(s.logits(), cold.logits())


def test_truncate_after_a_generate_continues_as_a_cold_prefill_does(engine, corpus):
    s = engine.open()
    s.append(corpus[:PROMPT_LEN])
    s.generate(DECODED, NOEOS)
    n = 197
    keep = list(s.tokens[:n])
    s.truncate(n)
    cold, _ = _cold(engine, keep)
    assert _same_result(s.generate(20, NOEOS), cold.generate(20, NOEOS))  # crosses grid point 256 on the way
    assert torch.equal(s.logits(), cold.logits())


def test_truncate_to_zero_empties_the_session(engine, corpus):
    s = engine.open()
    s.append(corpus[:70])
    assert s.truncate(0) == 0 and s.tokens == []
    s.append(corpus[100:150])
    _, want = _cold(engine, corpus[100:150])
    assert torch.equal(s.logits(), want)


def test_truncate_to_the_length_changes_nothing(engine, corpus):
    s = engine.open()
    s.append(corpus[:90])
    before = s.logits().clone()
    assert s.truncate(90) == 90
    assert s.tokens == corpus[:90] and torch.equal(s.logits(), before)


@pytest.mark.parametrize("n", [91, 10_000, -1, 2.0, True, "3", None])
def test_a_refused_truncate_leaves_the_session_unchanged(engine, corpus, n):
    s = engine.open()
    s.append(corpus[:90])
    before = s.logits().clone()
    with pytest.raises(InvalidRequestError):
        s.truncate(n)
    assert s.tokens == corpus[:90] and torch.equal(s.logits(), before)
    cold, _ = _cold(engine, corpus[:90])
    assert _same_result(s.generate(6, NOEOS), cold.generate(6, NOEOS))


@pytest.mark.parametrize("n", [-1, 2.5, True, None])
def test_the_request_checks_n_when_made(n):
    with pytest.raises(InvalidRequestError):
        Truncate(1, n)


async def test_async_truncate_equals_a_cold_prefill(make_engine, corpus):
    oracle = make_engine()
    full, wants = None, {}
    async with AsyncEngine(make_engine()) as aeng:
        s = await aeng.open(corpus[:PROMPT_LEN])
        await s.generate(DECODED, NOEOS)
        full = await s.tokens()
        for n in sorted(CUTS, reverse=True):
            assert await s.truncate(n) == n == s.length
            assert await s.tokens() == full[:n]
            wants[n] = await s.append(corpus[300:305], logits=True)  # the state at n, read through an append
            await s.truncate(n)
        tail = await s.generate(12, NOEOS)
        with pytest.raises(InvalidRequestError):
            await s.truncate(s.length + 1)
        assert s.length == 1 + 12 and await s.tokens() == full[:1] + list(tail)
        with pytest.raises(InvalidRequestError):
            await s.truncate(-1)
        assert await s.truncate(s.length) == 13  # a no-op
        after = await s.generate(4, NOEOS)
        await s.close()
    for n, got in wants.items():
        cold, want = _cold(oracle, full[:n] + corpus[300:305])
        assert torch.equal(torch.from_numpy(got), want.cpu()), n  # the async API returns host logits
        cold.close()
    cold, _ = _cold(oracle, full[:1])
    assert _same_result(tail, cold.generate(12, NOEOS))
    assert _same_result(after, cold.generate(4, NOEOS))
