"""A step's restores done together (scheduler/restore_batch.py): the capsules of the starting requests that
restore one are restored in one batch (Engine.restore_many / restore_into_many), and every request then gets
what its own restore gives it: the same session state bit for bit, the same tokens; a group that would fail
is left to the per-request path, untouched."""
import asyncio

import pytest
import torch

from capsulert.protocol.requests import Open, Restore, Turn
from capsulert.protocol.sampling import SamplingParams
from capsulert.scheduler.jobs import Job
from capsulert.scheduler.restore_batch import restore_together
from capsulert.scheduler.session_ids import SessionIds
from capsulert.sessions.local import AsyncEngine
from tests.worker.test_append_many import slot_bytes


@pytest.fixture
def corpus(engine):
    from capsulert.engine.default_model import CORPUS_PATH

    return engine.tokenize(CORPUS_PATH.read_text()[:20000])


def _capsules(eng, corpus):
    for name, n in (("on-grid", 128), ("off-grid", 150)):
        s = eng.open(corpus[:n])
        s.snapshot(name)
        s.close()


def _same_state(eng, a, b):
    assert a.tokens == b.tokens
    x, y = slot_bytes(eng, a), slot_bytes(eng, b)
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_the_step_s_restores_are_one_batch_each_bitwise_a_restore_alone(make_engine, corpus):
    eng = make_engine(slots=10)
    _capsules(eng, corpus)
    ids = SessionIds(1)
    mine = eng.open(corpus[:20])
    sid = ids.adopt(mine)
    jobs = [Job(r, None, r.target) for r in (
        Restore("on-grid"), Turn(restore="off-grid", suffix=[1, 2], max_new_tokens=2),
        Turn(session=sid, restore="on-grid", max_new_tokens=1), Restore("on-grid"))]
    free = eng.free_slots
    assert restore_together(eng, ids, jobs, busy=set()) == 1  # the three new sessions (an in-place one alone waits)
    assert eng.free_slots == free - 3
    assert [j.restored is not None for j in jobs] == [True, True, False, True]
    for job, name in zip([jobs[0], jobs[1], jobs[3]], ["on-grid", "off-grid", "on-grid"]):
        session, tier, seconds = job.restored
        assert tier == "device" and seconds >= 0
        _same_state(eng, session, eng.restore(name))


def test_in_place_restores_batch_and_a_busy_session_waits(make_engine, corpus):
    eng = make_engine(slots=8)
    _capsules(eng, corpus)
    ids = SessionIds(1)
    a, b, c = (eng.open(corpus[:10 + i]) for i in range(3))
    ia, ib, ic = (ids.adopt(s) for s in (a, b, c))
    jobs = [Job(r, None, r.target) for r in (Restore("off-grid", into=ia), Restore("on-grid", into=ib),
                                             Restore("on-grid", into=ic))]
    assert restore_together(eng, ids, jobs, busy={ic}) == 1
    assert [j.restored is not None for j in jobs] == [True, True, False]
    _same_state(eng, a, eng.restore("off-grid"))
    _same_state(eng, b, eng.restore("on-grid"))
    assert c.tokens == corpus[:12]


def test_a_group_that_would_fail_is_left_whole_to_each_request(make_engine, corpus):
    eng = make_engine(slots=6)
    _capsules(eng, corpus)
    ids = SessionIds(1)
    jobs = [Job(r, None, None) for r in (Restore("on-grid"), Restore("missing"), Restore("off-grid"))]
    free = eng.free_slots
    assert restore_together(eng, ids, jobs, busy=set()) == 0
    assert all(j.restored is None for j in jobs) and eng.free_slots == free


def test_new_sessions_are_taken_only_ahead_of_other_slot_takers_and_as_slots_allow(make_engine, corpus):
    eng = make_engine(slots=4)
    _capsules(eng, corpus)
    ids = SessionIds(1)
    jobs = [Job(r, None, None) for r in (Restore("on-grid"), Restore("on-grid"), Restore("on-grid"), Open(),
                                         Restore("off-grid"))]
    eng.open()  # 3 slots free: the first three restores, not the one behind the Open
    assert restore_together(eng, ids, jobs, busy=set()) == 1
    assert [j.restored is not None for j in jobs] == [True, True, True, False, False]


async def test_a_crowd_of_restoring_turns_equals_the_one_by_one_path(make_engine, corpus):
    """Sixteen turns restoring capsules at once, batched or not: the same tokens and logprobs; the batched
    scheduler restored some of them together."""
    results = {}
    for batch in (True, False):
        eng = make_engine(slots=20, max_seq=512, scheduler={"batch_prefill": batch})
        _capsules(eng, corpus)
        params = [SamplingParams(temperature=0.8, seed=i, ignore_eos=True) for i in range(16)]
        turns = [Turn(restore=("on-grid", "off-grid")[i % 2], suffix=corpus[600 + i:610 + i], max_new_tokens=5,
                      sampling=params[i], close=True) for i in range(16)]
        async with AsyncEngine(eng) as aeng:
            with eng.lock:  # the loop takes at most the first request before all sixteen are queued
                pending = [asyncio.ensure_future(aeng.submit(t)) for t in turns]
                while aeng.scheduler.queued < 15:
                    await asyncio.sleep(0.005)
            got = await asyncio.gather(*pending)
            results[batch] = [(r.tokens, r.logprobs, r.restored_from) for r in got]
            assert (aeng.scheduler.restore_batches > 0) == batch
    assert results[True] == results[False]


def test_no_restore_is_taken_ahead_of_a_request_that_may_change_a_capsule(make_engine, corpus):
    from capsulert.protocol.requests import Delete, Snapshot

    eng = make_engine(slots=8)
    _capsules(eng, corpus)
    ids = SessionIds(1)
    sid = ids.adopt(eng.open(corpus[:30]))
    for verb in (Delete("on-grid"), Snapshot(sid, "on-grid")):
        jobs = [Job(r, None, r.target) for r in (Restore("on-grid"), Restore("on-grid"), verb, Restore("on-grid"),
                                                 Restore("on-grid"))]
        assert restore_together(eng, ids, jobs, busy=set()) == 1
        assert [j.restored is not None for j in jobs] == [True, True, False, False, False]
