"""Fixtures: one real local Ray (num_cpus=2) for the whole test session, the default model generated
once into a temp dir, an in-process Engine as the oracle, and a one-worker Orchestrator per module."""
import pytest
import pytest_asyncio
import ray

from capsulert.orchestrator import Orchestrator
from capsulert.engine.engine import Engine

SHORT = "The capsule runtime keeps the complete state of a session at a committed boundary. "


@pytest.fixture(scope="session")
def ray_session():
    from capsulert.orchestrator.orchestrator import FAST_FAILURE_RAY_CONFIG

    # the settings of a Ray the orchestrator starts itself (a killed worker's callers learn it at once)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=FAST_FAILURE_RAY_CONFIG)
    yield
    ray.shutdown()


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
