"""A capsule's holder that no longer has it is passed over. The view of where capsules live can list a worker
that lost its copy: an unpinned copy dies with its process, and a request that waited out the restart finds
the new process without it. A restore, fork or turn of the capsule then goes to a worker that still holds it
instead of failing with UnknownCapsuleError, bitwise as it would have run there; with no holder left it is
UnknownCapsuleError as before. Two workers; the last test kills one."""
import pytest
import pytest_asyncio

from capsulert.errors import UnknownCapsuleError
from capsulert.orchestrator import Orchestrator
from capsulert.protocol.results import FinalEvent
from capsulert.protocol.sampling import SamplingParams
from tests.orchestrator.processes import kill_and_wait

pytestmark = pytest.mark.asyncio(loop_scope="session")
PROMPT = "A capsule outlives the copy a restarted worker lost. "
NOEOS = SamplingParams(ignore_eos=True)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def pair(ray_session, engine_cfg):
    o = await Orchestrator.start(dict(engine=engine_cfg, num_workers=2, call_timeout_s=60, max_restarts=5,
                                      torch_threads=1))
    s = await o.open(PROMPT, worker=0)
    await s.snapshot("c", pin=True)
    await s.close()
    busy = [await o.open("busy", worker=0) for _ in range(3)]  # worker 0 is the more loaded holder
    yield o
    for b in busy:
        await b.close()
    await o.close()


@pytest.fixture(scope="module")
def want(oracle):
    s = oracle.open()
    s.append(PROMPT)
    s.append(" more")
    return list(oracle.generate([s], 4, [NOEOS])[0])


def holders(orch, name):
    return orch.default.router.space.where.get(name, set())


async def test_a_holder_without_the_capsule_is_passed_over_by_every_restoring_verb(pair, want):
    orch = pair
    orch.default.router.space.add("c", 1)  # the view says worker 1 holds it too (it does not)
    assert holders(orch, "c") == {0, 1}
    r = await orch.restore_append_generate("c", " more", 4, NOEOS)
    assert list(r) == want
    events = [e async for e in orch.restore_append_stream("c", " more", 4, NOEOS)]
    assert isinstance(events[-1], FinalEvent) and [e.token for e in events[:-1]] == want
    s = await orch.restore("c")
    forks = await orch.fork("c", 2)
    assert {s.worker} | {f.worker for f in forks} == {0}
    for x in [s, *forks]:
        await x.close()
    orch.default.router.space.discard("c", 0)  # no holder that has it: the refusal stands
    with pytest.raises(UnknownCapsuleError):
        await orch.restore_append_generate("c", " more", 4, NOEOS)
    orch.default.router.space.add("c", 0)
    orch.default.router.space.discard("c", 1)


async def test_a_turn_after_the_copy_holder_restarted_runs_on_the_other_holder(pair, want):
    orch = pair
    await orch.migrate("c", 1)  # an unpinned copy on the less loaded worker: it dies with its process
    assert holders(orch, "c") == {0, 1}
    await kill_and_wait((await orch.health())[1]["pid"])
    r = await orch.restore_append_generate("c", " more", 4, NOEOS)
    assert list(r) == want and holders(orch, "c") == {0}
