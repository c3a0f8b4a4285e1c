"""Issue 29 item 1: the admission queue (orchestrator/admission.py) on its own, without workers: whole
reservations, first come first served within a namespace, round robin across namespaces, no starvation of
a large request, refusals at once for what could never start or a full queue, and cancelled waiters gone."""
import asyncio

import pytest

from capsulert.errors import ExceedsCapacityError, InvalidRequestError, QueueFullError
from capsulert.orchestrator.admission import SessionGate


def gate(slots=4, workers=1, max_queued=16):
    live = {"n": workers}
    g = SessionGate(slots, lambda: live["n"], max_queued)
    return g, live


async def hold(g, need, ns, order, release: asyncio.Event, tag=None, together=1):
    async with g.reserve(need, ns, together=together):
        order.append(tag or ns)
        await release.wait()


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def test_round_robin_across_namespaces_fifo_within_one():
    g, _ = gate(slots=2)
    order, gates = [], {}

    def start(need, ns, tag):
        gates[tag] = asyncio.Event()
        return asyncio.ensure_future(hold(g, need, ns, order, gates[tag], tag))

    tasks = [start(2, "a", "a0")]
    await settle()
    tasks += [start(1, "a", t) for t in ("a1", "a2", "a3")] + [start(1, "b", "b1"), start(1, "c", "c1")]
    await settle()
    assert order == ["a0"] and g.queued == 5 and g.in_use == 2
    gates["a0"].set()
    await settle()
    assert order == ["a0", "a1", "b1"]  # one per namespace in turn, in arrival order within one
    for tag in ("a1", "b1"):
        gates[tag].set()
    await settle()
    assert order == ["a0", "a1", "b1", "c1", "a2"]
    for e in gates.values():
        e.set()
    await asyncio.gather(*tasks)
    assert order[-1] == "a3" and g.in_use == 0 and g.queued == 0


async def test_a_large_request_is_not_starved_by_small_ones():
    g, _ = gate(slots=4)
    order, release = [], {k: asyncio.Event() for k in ("x", "big", "s1", "s2")}
    tasks = [asyncio.ensure_future(hold(g, 3, "t", order, release["x"], "x"))]
    await settle()
    tasks.append(asyncio.ensure_future(hold(g, 4, "t", order, release["big"], "big")))
    await settle()
    tasks += [asyncio.ensure_future(hold(g, 1, "u", order, release[k], k)) for k in ("s1", "s2")]
    await settle()
    assert order == ["x"]  # one slot free, but the head of the queue needs four: nobody overtakes it
    release["x"].set()
    await settle()
    assert order == ["x", "big"]
    release["big"].set()
    await settle()
    assert order == ["x", "big", "s1", "s2"]
    for e in release.values():
        e.set()
    await asyncio.gather(*tasks)


async def test_what_could_never_start_and_a_full_queue_are_refused_at_once():
    g, live = gate(slots=4, workers=2, max_queued=2)
    with pytest.raises(ExceedsCapacityError, match="9 sessions .* 8 slots in all"):
        async with g.reserve(9, "a"):
            pass
    with pytest.raises(ExceedsCapacityError, match="5 sessions must be held on one worker"):
        async with g.reserve(5, "a", together=5):
            pass
    with pytest.raises(InvalidRequestError):
        async with g.reserve(1, "a", together=2):
            pass
    order, release = [], asyncio.Event()
    tasks = [asyncio.ensure_future(hold(g, 8, "a", order, release))]
    await settle()
    tasks += [asyncio.ensure_future(hold(g, 6, "b", order, release, "b")),
              asyncio.ensure_future(hold(g, 1, "c", order, release, "c"))]
    await settle()
    with pytest.raises(QueueFullError) as e:
        async with g.reserve(1, "d"):
            pass
    assert 1.0 <= e.value.retry_after_s <= 60.0
    live["n"] = 1  # a worker is lost for good: the 6-session request can never start now
    release.set()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(done[1], ExceedsCapacityError) and done[2] is None and order == ["a", "c"]
    assert g.in_use == 0 and g.queued == 0


async def test_a_waiter_that_goes_away_leaves_the_queue():
    g, _ = gate(slots=2)
    order, release = [], asyncio.Event()
    first = asyncio.ensure_future(hold(g, 2, "a", order, release, "first"))
    await settle()
    head = asyncio.ensure_future(hold(g, 2, "a", order, release, "head"))
    small = asyncio.ensure_future(hold(g, 1, "a", order, release, "small"))
    await settle()
    head.cancel()  # its client went away
    await settle()
    assert g.queued == 1 and g.in_use == 2
    release.set()
    await asyncio.gather(first, small)
    assert order == ["first", "small"] and g.in_use == 0 and g.queued == 0
