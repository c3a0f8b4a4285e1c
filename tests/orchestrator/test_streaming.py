"""Through the orchestrator: generates of independent tasks share the worker's decode steps and equal the
in-process engine; streaming yields every token in order, then the result; closing a stream stops it at a
token boundary with the tokens committed; results carry logprobs and stop reasons."""
import asyncio

import pytest

from capsulert.worker.sampler import SamplingParams
from capsulert.worker.verbs import FinalEvent, TokenEvent

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
    await asyncio.sleep(0.2)
    produced = (await s.tokens())[start:]
    assert produced[:3] == got and 3 <= len(produced) < 400
    rest = await s.generate(5, NOEOS)
    ref = fresh.open()
    ref.append(PROMPT)
    assert produced + rest == ref.generate(len(produced) + 5, NOEOS)
    await s.close()
