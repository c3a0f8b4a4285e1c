"""The worker's one dispatch: every request type has one handler (WorkerCore.HANDLERS; a session request's
starter in worker/starters.py), and a simple session verb, a SessionVerb that applies itself, runs on the
step scheduler and on a WorkerCore with no code of its own in capsulert/worker/."""
import asyncio
import gc
from dataclasses import dataclass

import pytest
import torch

from capsulert.errors import InvalidRequestError, SessionClosedError, UnknownCapsuleError, WorkerLost
from capsulert.protocol import requests
from capsulert.protocol.requests import SESSION, Generate, Open, Request, SessionVerb, Snapshot
from capsulert.protocol.sampling import SamplingParams
from capsulert.sessions.local import AsyncEngine
from capsulert.worker.core import WorkerCore
from capsulert.scheduler import starters

NOEOS = SamplingParams(ignore_eos=True)


@pytest.fixture
def corpus(engine):
    from capsulert.engine.default_model import CORPUS_PATH

    return engine.tokenize(CORPUS_PATH.read_text()[:3000])


def _simple_verbs() -> tuple[type, type]:
    """Two simple session verbs, made as a new one is in protocol/requests.py: a SessionVerb that applies
    itself, nothing else. Made per test and collected after it, so that the lists of every request type other
    tests make do not hold them."""

    @dataclass(frozen=True)
    class RollBack(SessionVerb):
        """Restore capsule `name` into the session in place (Engine.restore_into)."""
        name: str
        namespace: str = "default"

        def apply(self, engine, session) -> None:
            engine.restore_into(session, self.name, self.namespace)

    @dataclass(frozen=True)
    class Recompute(SessionVerb):
        """Prefill the session's tokens again (Engine.rederive)."""

        def apply(self, engine, session) -> None:
            engine.rederive(session)

    return RollBack, Recompute


@pytest.fixture
def simple_verbs():
    verbs = _simple_verbs()
    yield verbs
    del verbs
    gc.collect()


def test_every_request_type_has_one_handler_and_each_scheduled_one_a_starter():
    types = {t for t in vars(requests).values() if isinstance(t, type) and issubclass(t, Request)
             and t.__module__ == requests.__name__ and not issubclass(t, SessionVerb) and not t.__subclasses__()}
    assert set(WorkerCore.HANDLERS) == types
    assert set(starters.STARTERS) <= types
    assert all(t.lane == SESSION for t in starters.STARTERS)
    for bad in (Request, str, dict):  # the base and non-requests are refused by both tables
        with pytest.raises(InvalidRequestError):
            WorkerCore.handler(bad)
    with pytest.raises(InvalidRequestError):
        starters.starter(Request)


def test_a_simple_verb_is_routed_by_its_type_and_applies_itself(simple_verbs):
    for verb in simple_verbs:
        assert verb not in WorkerCore.HANDLERS and verb not in starters.STARTERS
        assert WorkerCore.handler(verb) is WorkerCore.HANDLERS[Generate]  # the scheduler's, as a Generate's
        assert starters.starter(verb) not in starters.STARTERS.values()
    assert starters.starter(simple_verbs[0]) is starters.starter(simple_verbs[1])  # one for them all


async def test_a_simple_verb_runs_on_the_scheduler_in_its_sessions_order(make_engine, corpus, simple_verbs):
    RollBack, Recompute = simple_verbs
    engine = make_engine(slots=4)
    ref = engine.open()
    want = ref.append(corpus[:100])
    want_tokens = engine.generate([ref], 12, [NOEOS])[0].tokens
    ref.close()
    async with AsyncEngine(engine) as aeng:
        s = await aeng.open(corpus[:100])
        await aeng.submit(Snapshot(s.id, "start"))
        # submitted together: the rollback waits for the generate before it on the session
        generated, rolled = await asyncio.gather(aeng.submit(Generate(s.id, 30, NOEOS)),
                                                 aeng.submit(RollBack(s.id, "start")))
        assert generated.length == 130 and (rolled.session, rolled.length) == (s.id, 100)
        assert torch.equal(engine.logits(aeng.scheduler.session(s.id)), want)
        assert (await s.generate(12, NOEOS)).tokens == want_tokens
        with pytest.raises(UnknownCapsuleError):  # the engine's refusal reaches the caller, the session unchanged
            await aeng.submit(RollBack(s.id, "missing"))
        assert (await aeng.submit(Recompute(s.id))).length == 112
        with pytest.raises(SessionClosedError, match="closed or unknown"):
            await aeng.submit(RollBack(12345, "start"))


def test_a_simple_verb_runs_on_a_worker_core(model_dir, device, corpus, simple_verbs):
    RollBack, Recompute = simple_verbs
    core = WorkerCore(dict(model=str(model_dir), device=device, slots=2, max_seq=512, prefill_chunk=128))
    try:
        sid = core.execute(Open(corpus[:70])).session
        core.execute(Snapshot(sid, "start"))
        core.execute(Generate(sid, 9, NOEOS))
        info = core.execute(RollBack(sid, "start"))
        assert (info.session, info.length) == (sid, 70) and core.execute(Recompute(sid)).length == 70
        assert core.execute(Generate(sid, 9, NOEOS)).length == 79
        with pytest.raises(WorkerLost):  # a session the worker does not hold, as for every session request
            core.execute(RollBack(sid + 1, "start"))
    finally:
        core.scheduler.stop()

