"""Through the orchestrator: generates of independent tasks share the worker's decode steps and equal the
in-process engine; streaming yields every token in order, then the result; closing a stream stops it at a
token boundary with the tokens committed; results carry logprobs and stop reasons; a streaming turn equals
append then stream; restores report the tier they read the capsule from."""
import asyncio

import pytest

from capsulert.errors import SequenceTooLongError, UnknownCapsuleError
from capsulert.protocol.sampling import SamplingParams
from capsulert.protocol.results import FinalEvent, TokenEvent

pytestmark = pytest.mark.asyncio(loop_scope="session")
PROMPT = "The harbour master counts the boats that come back before the storm. "
NOEOS = SamplingParams(ignore_eos=True)


async def test_independent_tasks_share_decode_steps_and_equal_the_engine(orch, fresh):
    prompts = [PROMPT * (1 + i % 3) + f"Boat {i}." for i in range(8)]
    params = [SamplingParams(temperature=0.8, seed=i, ignore_eos=True) if i % 2 else NOEOS for i in range(8)]
    sessions = await asyncio.gather(*(orch.open(p) for p in prompts))
    workers = {s.worker for s in sessions}
    before = {w: (await orch.stats())[w]["decode_steps"] for w in workers}
    results = await asyncio.gather(*(s.generate(24, p) for s, p in zip(sessions, params)))
    after = await orch.stats()
    steps = sum(after[w]["decode_steps"] - before[w] for w in workers)
    assert steps < 8 * 24  # the scheduler batched tasks the caller never batched
    for p, sp, res in zip(prompts, params, results):
        ref = fresh.open()
        ref.append(p)
        want = ref.generate(24, sp)
        assert res == want and res.logprobs == want.logprobs and res.stop_reason == "length"
    for s in sessions:
        await s.close()


async def test_stream_yields_every_token_then_the_result(orch, fresh):
    s = await orch.open(PROMPT)
    events = [ev async for ev in s.stream(10, NOEOS)]
    assert all(isinstance(e, TokenEvent) for e in events[:-1]) and isinstance(events[-1], FinalEvent)
    tokens = [e.token for e in events[:-1]]
    assert [e.index for e in events[:-1]] == list(range(10))
    assert events[-1].result == tokens and "".join(e.text for e in events[:-1]) == events[-1].result.text
    ref = fresh.open()
    ref.append(PROMPT)
    assert tokens == ref.generate(10, NOEOS)
    assert s.length == len(ref)
    await s.close()


async def test_closing_a_stream_stops_it_with_tokens_committed(orch, fresh):
    s = await orch.open(PROMPT)
    start = s.length
    got = []
    async for ev in s.stream(400, NOEOS):
        got.append(ev.token)
        if len(got) == 3:
            break
    # a session's requests run in order: this generate starts once the closed stream has stopped, so the tokens
    # read after it hold all the stream committed (read before it, on a loaded machine, they were a part of them)
    rest = await s.generate(5, NOEOS)
    produced = (await s.tokens())[start:-5]
    assert produced[:3] == got and 3 <= len(produced) < 400
    ref = fresh.open()
    ref.append(PROMPT)
    assert produced + rest == ref.generate(len(produced) + 5, NOEOS)
    await s.close()


async def test_a_streaming_turn_equals_append_then_stream(orch, fresh):
    params = SamplingParams(temperature=0.8, seed=11, ignore_eos=True, logprobs=3)
    turn_text = " The storm came early that year."
    a, b = await orch.open(PROMPT), await orch.open(PROMPT)
    turn = [ev async for ev in a.stream_turn(turn_text, 12, params)]
    await b.append(turn_text)
    split = [ev async for ev in b.stream(12, params)]
    assert turn[:-1] == split[:-1]  # token, logprob, text, index and top-k of every event, bitwise
    one, two = turn[-1].result, split[-1].result
    assert one == two and (one.logprobs, one.top_logprobs, one.text) == (two.logprobs, two.top_logprobs, two.text)
    assert [list(e.top_logprobs) for e in turn[:-1]] == one.top_logprobs  # top-k per token, as it is produced
    assert a.length == b.length == one.length
    ref = fresh.open()
    ref.append(PROMPT + turn_text)
    want = ref.generate(12, params)
    assert one == want and one.top_logprobs == want.top_logprobs
    await b.close()
    # with a restore in place: the same events again, and the tier the capsule was read from
    await a.snapshot("turn-start")
    await a.generate(3, NOEOS)  # moves away from the capsule
    c = await orch.restore("turn-start")
    await c.snapshot("start")
    await c.close()
    again = [ev async for ev in a.stream_turn(None, 12, params, restore="start")]
    assert again[-1].result.restored_from == "device" and a.length == one.length + 12
    await orch.demote("start", "host")
    from_host = [ev async for ev in a.stream_turn(None, 4, params, restore="start")]
    assert from_host[-1].result.restored_from == "host" and from_host[:-1] == again[:len(from_host) - 1]
    with pytest.raises(SequenceTooLongError):  # a refused append comes out of the first step of the stream
        async for _ in a.stream_turn("x" * 4000, 4, params):
            pass
    assert (await a.generate(2, NOEOS)).tokens  # the session is still usable
    for name in ("turn-start", "start"):
        await orch.delete(name)
    await a.close()


async def test_restores_report_the_tier_they_read_from(orch):
    s = await orch.open(PROMPT)
    await s.snapshot("tiers")
    r = await orch.restore("tiers")
    assert r.restored_from == "device"
    await r.close()
    await orch.demote("tiers", "host")
    r = await orch.restore("tiers")
    assert r.restored_from == "host"
    await r.close()
    await orch.demote("tiers", "host")
    assert await s.restore("tiers") == "host"
    await orch.demote("tiers", "host")
    res = await orch.restore_append_generate("tiers", " Next.", 2, NOEOS)
    assert res.restored_from == "host"
    branches = await orch.fork("tiers", 2)
    assert [b.restored_from for b in branches] == ["device", "device"]  # promoted by the last read
    for b in branches:
        await b.close()
    await s.close()
    await orch.delete("tiers")


async def _settled_worker(orch, sessions: int) -> dict:
    """The worker's stats once it holds `sessions` sessions again (a stopped one-request call closed its own)."""
    for _ in range(500):
        stats = (await orch.stats())[0]
        if stats["sessions"] == sessions:
            return stats
        await asyncio.sleep(0.02)
    raise AssertionError(f"the worker still holds {stats['sessions']} sessions, not {sessions}")


async def test_a_one_request_stream_equals_restore_then_streaming_turn_and_closes_its_session(orch, fresh):
    params = SamplingParams(temperature=0.7, seed=5, ignore_eos=True, logprobs=2)
    s = await orch.open(PROMPT)
    await s.snapshot("one-req")
    await s.close()
    held = (await orch.stats())[0]["sessions"]
    one = [ev async for ev in orch.restore_append_stream("one-req", " Then the tide turned.", 9, params)]
    r = await orch.restore("one-req")
    split = [ev async for ev in r.stream_turn(" Then the tide turned.", 9, params)]
    await r.close()
    assert one[:-1] == split[:-1] and one[-1].result == split[-1].result
    res = one[-1].result
    assert (res.logprobs, res.top_logprobs, res.text) == (split[-1].result.logprobs, split[-1].result.top_logprobs,
                                                          split[-1].result.text)
    assert res.restored_from == "device" and res.restore_s > 0 and res.session is None
    assert (await orch.stats())[0]["sessions"] == held  # the request's own session is closed
    whole = await orch.restore_append_generate("one-req", " Then the tide turned.", 9, params)
    assert whole == res and whole.logprobs == res.logprobs and whole.restore_s > 0
    ref = fresh.open()
    ref.append(PROMPT + " Then the tide turned.")
    assert res == ref.generate(9, params)
    with pytest.raises(UnknownCapsuleError):  # a refusal comes out of the first step
        async for _ in orch.restore_append_stream("no-such-capsule", None, 4):
            pass
    await orch.delete("one-req")


async def test_a_one_request_call_stops_when_its_caller_goes_away(orch):
    """Closing a one-request stream, or cancelling a one-request generate, interrupts the worker's generate
    by its call id alone (the caller never learns the session): it stops at the next token and closes."""
    s = await orch.open(PROMPT)
    await s.snapshot("one-stop")
    await s.close()
    held = (await orch.stats())[0]["sessions"]
    before = (await orch.stats())[0]["decoded_tokens"]
    got = []
    async for ev in orch.restore_append_stream("one-stop", None, 600, NOEOS):
        got.append(ev)
        if len(got) == 3:
            break
    after = await _settled_worker(orch, held)
    assert 3 <= after["decoded_tokens"] - before < 600
    task = asyncio.ensure_future(orch.restore_append_generate("one-stop", None, 600, NOEOS))
    while (await orch.stats())[0]["decoded_tokens"] - after["decoded_tokens"] < 3:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    last = await _settled_worker(orch, held)
    assert 3 <= last["decoded_tokens"] - after["decoded_tokens"] < 600
    await orch.delete("one-stop")
