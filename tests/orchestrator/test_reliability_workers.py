"""Issue 15 items 1-3 on the orchestrator: one disk_dir per orchestrator, a call after an idle worker's
death waits for its restart and succeeds, and a worker dead for good fails every call at once.

One two-worker orchestrator with max_restarts=1; the tests run in order: worker 1 is killed while idle
(Ray restarts it: its one restart), then killed again (no restart left: dead for good).
"""
import asyncio
import os
import time

import pytest
import pytest_asyncio

from capsulert.errors import DiskDirInUseError, WorkerLost
from capsulert.orchestrator import Orchestrator
from capsulert.engine.engine import Engine
from tests.orchestrator.processes import kill_and_wait

pytestmark = pytest.mark.asyncio(loop_scope="session")
PROMPT = "A worker may die between two calls; the next call should not be the one that pays for it. "
TIMEOUT = 20.0


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def orch_rw(ray_session, engine_cfg, tmp_path_factory):
    disk = tmp_path_factory.mktemp("rel-workers")
    o = await Orchestrator.start(dict(engine={**engine_cfg, "slots": 8, "disk_dir": str(disk)}, num_workers=2,
                                      call_timeout_s=TIMEOUT, max_restarts=1, torch_threads=1))
    yield o
    await o.close()


async def test_a_second_orchestrator_or_engine_on_its_disk_dir_is_refused(orch_rw, engine_cfg):
    disk = orch_rw.config.engine.disk_dir
    with pytest.raises(DiskDirInUseError, match="orchestrator"):
        await Orchestrator.start(dict(engine={**engine_cfg, "disk_dir": disk}, num_workers=1))
    with pytest.raises(DiskDirInUseError):
        Engine.from_config({**engine_cfg, "disk_dir": disk})
    with pytest.raises(DiskDirInUseError):  # a worker's own directory is held by that worker's process
        Engine.from_config({**engine_cfg, "disk_dir": os.path.join(disk, "worker-0")})
    assert [h["worker"] for h in await orch_rw.health()] == [0, 1]  # the first one is untouched


async def test_calls_after_an_idle_workers_death_wait_for_its_restart(orch_rw):
    s = await orch_rw.open(PROMPT, worker=1)
    await s.snapshot("rw-pinned", pin=True)
    old = (await orch_rw.health())[1]["pid"]
    await kill_and_wait(old)  # nobody is calling worker 1 when it dies
    t0 = time.monotonic()
    a, b = await asyncio.gather(orch_rw.open(PROMPT, worker=1), orch_rw.restore_append_generate("rw-pinned", None, 3))
    assert time.monotonic() - t0 < TIMEOUT
    assert (await orch_rw.health())[1]["pid"] != old and a.worker == 1 and len(b) == 3
    assert len(await a.generate(2)) == 2
    with pytest.raises(WorkerLost):
        await s.generate(1)  # its session died with the old process
    await a.close()


async def test_a_worker_dead_for_good_fails_every_call_at_once(orch_rw):
    pid = (await orch_rw.health())[1]["pid"]
    await kill_and_wait(pid)  # its one restart is spent: Ray will not restart it
    for _ in range(3):  # each used to wait call_timeout_s
        t0 = time.monotonic()
        with pytest.raises(WorkerLost):
            await orch_rw.open(PROMPT, worker=1)
        assert time.monotonic() - t0 < 2.0
    health = await orch_rw.health()
    assert health[0]["pid"] and health[1]["worker"] == 1 and "will not restart" in health[1]["lost"]
    s = await orch_rw.open(PROMPT)  # routed to the live worker
    assert s.worker == 0 and len(await s.generate(2)) == 2
    assert [c["name"] for c in await orch_rw.capsules()] == []  # rw-pinned lived on worker 1 only
    stats = await orch_rw.stats()
    assert stats[0]["worker"] == 0 and "lost" in stats[1]
    await s.close()
