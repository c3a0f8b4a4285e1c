"""Fixtures: one real local Ray (num_cpus=2) for each run of this directory's tests on a test worker, the
default model generated once into a temp dir, an in-process Engine as the oracle, and a one-worker
Orchestrator per module."""
import pytest
import pytest_asyncio
import ray

from capsulert.orchestrator import Orchestrator
from capsulert.engine.engine import Engine

SHORT = "The capsule runtime keeps the complete state of a session at a committed boundary. "


@pytest.fixture(scope="module")
def ray_session():
    """The local Ray of this directory's tests: started by the first module that needs it, kept for the
    modules that follow on this test worker, shut down when the worker moves on (pytest_runtest_teardown)."""
    from capsulert.orchestrator.orchestrator import FAST_FAILURE_RAY_CONFIG

    if not ray.is_initialized():
        # the settings of a Ray the orchestrator starts itself (a killed worker's callers learn it at once)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=FAST_FAILURE_RAY_CONFIG)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last of a run of this directory's tests (its module fixtures, the orchestrators, torn down
    first): shut the local Ray down. An idle Ray costs ~12% of a core, which the rest of a 2-core suite needs."""
    out = yield
    if ray.is_initialized() and (nextitem is None or nextitem.path.parent != item.path.parent):
        ray.shutdown()
    return out


@pytest.fixture(scope="session")
def engine_cfg(default_model_dir):
    return dict(model=str(default_model_dir), device="cpu", slots=40, max_seq=1024, prefill_chunk=128)


@pytest.fixture(scope="session")
def oracle(engine_cfg):
    """The in-process engine the orchestrator's results are compared with."""
    return Engine.from_config(engine_cfg)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def orch(ray_session, engine_cfg):
    o = await Orchestrator.start(dict(engine=engine_cfg, call_timeout_s=60, torch_threads=1))
    yield o
    await o.close()


@pytest.fixture
def fresh(oracle):
    """Close every oracle session a test leaves open and delete its capsules."""
    yield oracle
    for s in list(oracle.table.sessions()):
        s.close()
    for info in oracle.store.list():
        oracle.store.delete(info.name)
