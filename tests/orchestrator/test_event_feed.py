"""Streams through the worker's event feed: one Ray stream per worker carries every streamed generate's
events; each consumer gets exactly its own events in order, a consumer that leaves stops only its own
generate, and a worker that dies fails every stream on it with WorkerLost."""
import asyncio
import threading

import pytest
import pytest_asyncio
import ray

from capsulert.errors import InvalidRequestError, WorkerLost
from capsulert.orchestrator import Orchestrator
from capsulert.worker.event_feed import EventFeed
from capsulert.worker.core import WorkerCore
from capsulert.protocol.sampling import SamplingParams
from capsulert.protocol.requests import Feed
from capsulert.protocol.results import FinalEvent, TokenEvent

pytestmark = pytest.mark.asyncio(loop_scope="session")
NOEOS = SamplingParams(ignore_eos=True)
PROMPTS = [f"Agent {i} plans its next move on the board. " for i in range(8)]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def orch_feed(ray_session, engine_cfg):
    o = await Orchestrator.start(dict(engine={**engine_cfg, "slots": 16}, call_timeout_s=30, max_restarts=2,
                                      torch_threads=1, worker_num_cpus=0))
    yield o
    await o.close()


async def _streamed(s, n):
    tokens, final = [], None
    async for ev in s.stream(n, NOEOS):
        if isinstance(ev, FinalEvent):
            final = ev.result
        else:
            assert isinstance(ev, TokenEvent) and ev.index == len(tokens)
            tokens.append(ev.token)
    return tokens, final


async def test_many_streams_share_one_feed_and_each_gets_its_own_events(orch_feed, oracle):
    sessions = [await orch_feed.open(p) for p in PROMPTS]
    outs = await asyncio.gather(*(_streamed(s, 12) for s in sessions))
    more = await asyncio.gather(*(_streamed(s, 4) for s in sessions))  # the same feed again
    for (tokens, final), p in zip(outs, PROMPTS):
        ref = oracle.open()
        ref.append(p)
        assert tokens == list(final) == ref.generate(12, NOEOS) and final.stop_reason == "length"
        ref.close()
    assert all(len(t) == 4 and f.stop_reason == "length" for t, f in more)
    for s in sessions:
        await s.close()


async def test_one_feed_stream_per_worker_whatever_the_number_of_streams(orch_feed, monkeypatch):
    from capsulert.orchestrator import worker_pool

    opened, real = [], worker_pool.send_stream
    monkeypatch.setattr(worker_pool, "send_stream", lambda h, r, *a: (opened.append(r), real(h, r, *a))[1])
    orch_feed.pool.feeds.pop(0, None).task.cancel()  # the next stream opens a fresh feed, through the spy
    sessions = [await orch_feed.open(p, worker=0) for p in PROMPTS]
    await asyncio.gather(*(_streamed(s, 6) for s in sessions))
    await asyncio.gather(*(_streamed(s, 3) for s in sessions))
    for s in sessions:
        await s.close()
    assert opened == [Feed()]  # 16 streamed generates, one Ray stream


async def test_a_consumer_that_leaves_stops_only_its_own_generate(orch_feed):
    a, b = await orch_feed.open(PROMPTS[0]), await orch_feed.open(PROMPTS[1])
    stays = asyncio.create_task(_streamed(b, 40))
    got = []
    async for ev in a.stream(200, NOEOS):
        got.append(ev)
        if len(got) == 3:
            break  # the consumer goes away: its generate stops at the next token, tokens committed
    tokens, final = await stays
    assert len(tokens) == 40 and final.stop_reason == "length"
    await a.generate(1, NOEOS)  # runs after the interrupted generate settled
    assert len(await a.tokens()) < a.length + 1 + 200 - 3 and a.length < 200  # stopped long before 200
    await asyncio.gather(a.close(), b.close())


async def test_a_worker_that_dies_fails_every_stream_on_it(orch_feed):
    sessions = [await orch_feed.open(p, worker=0) for p in PROMPTS[:3]]
    tasks = [asyncio.create_task(_streamed(s, 900)) for s in sessions]
    async def started() -> bool:
        return all([len(await s.tokens()) > s.length for s in sessions])

    while not await started():
        await asyncio.sleep(0.01)
    ray.kill(orch_feed.workers[0].handle, no_restart=False)
    for t in tasks:
        with pytest.raises(WorkerLost):
            await asyncio.wait_for(t, 20)
    fresh = await orch_feed.open(PROMPTS[3], worker=0)  # after the restart a new feed serves new streams
    tokens, final = await _streamed(fresh, 5)
    assert len(tokens) == 5 and final.stop_reason == "length"
    await fresh.close()


async def test_the_feed_is_a_stream_and_a_new_one_takes_it_over(engine_cfg):
    core = WorkerCore({**engine_cfg, "slots": 2})
    try:
        with pytest.raises(InvalidRequestError, match="stream"):
            core.execute(Feed())
    finally:
        core.scheduler.stop()
    feed = EventFeed()
    feed.put("k", "event", 1)
    feed.put("k", "error", KeyError("x"))  # not a capsulert error: travels as its text
    first = feed.stream()
    assert next(first) == []  # the greeting: this stream holds the feed now
    items = next(first)
    assert items[0] == ("k", "event", 1) and isinstance(items[1][2], RuntimeError) and "KeyError" in str(items[1][2])
    done = threading.Event()

    def read_rest():
        assert list(first) == []  # ended by the second stream, not left blocked
        done.set()

    t = threading.Thread(target=read_rest)
    t.start()
    second = feed.stream()
    assert next(second) == []  # from here every item is the second stream's
    feed.put("j", "done", 7)
    assert next(second) == [("j", "done", 7)]
    t.join(5)
    assert done.is_set()


async def test_a_stream_is_submitted_only_once_its_feed_is_handed_over():
    """A feed reader is ready on the worker's greeting, not before: a streamed request submitted earlier
    could have its first events taken by the stream being replaced."""
    from capsulert.worker.event_feed import FeedReader

    greeted = asyncio.Event()

    async def items():
        await greeted.wait()
        yield asyncio.sleep(0, result=[])
        yield asyncio.sleep(0, result=[("k", "event", 1)])
        await asyncio.sleep(3600)

    reader = FeedReader(0, items)
    events = reader.subscribe("k")
    await asyncio.sleep(0.05)
    assert not reader.ready.done()
    greeted.set()
    await asyncio.wait_for(reader.ready, 5)
    assert await asyncio.wait_for(events.get(), 5) == ("event", 1)
    reader.task.cancel()


async def test_a_feed_that_ends_before_its_greeting_leaves_no_stream_waiting():
    from capsulert.worker.event_feed import FeedReader

    async def items():
        raise ConnectionError("the worker is gone")
        yield  # an async generator

    reader = FeedReader(0, items)
    events = reader.subscribe("k")
    await asyncio.wait_for(reader.ready, 5)  # resolved by the end: a waiting stream goes on and fails typed
    kind, error = await asyncio.wait_for(events.get(), 5)
    assert kind == "error" and isinstance(error, WorkerLost) and "ConnectionError" in str(error)
