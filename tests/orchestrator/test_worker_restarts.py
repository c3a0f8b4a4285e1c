"""Issue 29 items 5 and 6 on a real worker: what a restart brings back, and how fast callers learn of a death.

- One damaged pinned file used to stop the worker from ever restarting (the reload was all or nothing):
  now it is set aside with a typed record and the worker starts with the rest.
- A restarted worker left the unpinned capsules of its disk tier on disk, unlisted and uncounted (more
  files after every restart): now it indexes them, so they are listed, restorable and counted.
- Callers of a killed worker's sessions waited for the restart (27 s on the H200) to learn that their
  sessions were gone: now they get WorkerLost within a second.

One one-worker orchestrator with a disk_dir; the tests run in order and each kills the worker once.
"""
import asyncio
import re
import time

import pytest
import pytest_asyncio

from capsulert.capsule_store import capsule_file_name
from capsulert.capsule_store.format.blockfiles import block_files, referenced_blocks
from capsulert.capsule_store.format.disk import list_capsule_files
from capsulert.errors import WorkerLost
from capsulert.orchestrator import Orchestrator
from capsulert.protocol.sampling import SamplingParams
from tests.orchestrator.processes import kill_and_wait

pytestmark = pytest.mark.asyncio(loop_scope="session")
PROMPT = "A worker restarts with every capsule it kept on disk, and a bad file costs only itself. "
NOEOS = SamplingParams(ignore_eos=True)
PINNED, UNPINNED = ["p0", "p1", "p2"], ["d0", "d1", "d2", "d3"]


def config(engine_cfg, disk):
    return dict(engine={**engine_cfg, "slots": 40, "disk_dir": str(disk)}, call_timeout_s=60, max_restarts=5,
                torch_threads=1)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def restarts(ray_session, engine_cfg, tmp_path_factory):
    disk = tmp_path_factory.mktemp("restarts")
    o = await Orchestrator.start(config(engine_cfg, disk))
    yield o, disk
    await o.close()


def text(name):
    """Long enough to be cut into a prefix block (the capsules share it)."""
    return PROMPT * 6 + f"Capsule {name}."


def worker_dir(disk):
    return disk / "worker-0"


async def test_a_damaged_pinned_file_costs_only_itself_and_the_disk_tier_comes_back(restarts, oracle):
    orch, disk = restarts
    want = {}
    for name in PINNED + UNPINNED:
        s = await orch.open(text(name))
        await s.snapshot(name, pin=name in PINNED, tier="disk" if name in UNPINNED else "device")
        ref = oracle.open()
        ref.append(text(name))
        want[name] = ref.generate(5, NOEOS)
        ref.close()
        await s.close()
    bad = worker_dir(disk) / "pinned" / capsule_file_name("default", "p1")
    raw = bytearray(bad.read_bytes())
    raw[-3] ^= 0x01  # one flipped bit in a pinned capsule's tensor bytes
    bad.write_bytes(bytes(raw))
    files = {p.name for p in list_capsule_files(worker_dir(disk))}
    assert len(files) == len(UNPINNED)

    await kill_and_wait((await orch.health())[0]["pid"])
    [h] = await orch.health()  # waits for the restart: the worker starts, without p1
    assert sorted(h["reloaded"]) == ["p0", "p2"] and h["reindexed"] == len(UNPINNED)
    [q] = h["quarantined"]
    assert q["error"] == "CorruptCapsuleError" and q["path"] == str(bad) and not bad.exists()
    assert sorted(c["name"] for c in await orch.capsules()) == sorted(["p0", "p2"] + UNPINNED)
    for name in ["p0", "p2"] + UNPINNED:
        assert await orch.restore_append_generate(name, None, 5, NOEOS) == want[name]
    # the restores promoted copies of the d's (their files stay in the disk tier: a restore once used to lose
    # them at the next restart); two more go there, then a second restart
    for name in ("e0", "e1"):
        s = await orch.open(text(name))
        await s.snapshot(name, tier="disk")
        await s.close()
    assert (await orch.stats())[0]["store"]["disk"]["count"] == 2
    await kill_and_wait((await orch.health())[0]["pid"])
    [h] = await orch.health()
    assert h["reindexed"] == 2 + len(UNPINNED) and h["last_restart_s"] is not None and h["started_s"] > 0
    store = (await orch.stats())[0]["store"]
    assert store["disk"]["count"] == 2 + len(UNPINNED) and store["disk"]["bytes"] > 0  # counted in the budget
    for name in UNPINNED:  # restored once before the restart, and still there after it
        assert await orch.restore_append_generate(name, None, 5, NOEOS) == want[name]
    # the disk tier holds what it lists, and nothing else: no growth from one restart to the next
    listed = {capsule_file_name("default", c["name"]) for c in await orch.capsules() if c["name"][0] in "de"}
    assert {p.name for p in list_capsule_files(worker_dir(disk))} == listed and len(listed) == 2 + len(UNPINNED)
    assert set(block_files(worker_dir(disk))) == set(referenced_blocks(worker_dir(disk)))


async def test_a_fresh_orchestrator_on_the_same_disk_dir_starts_with_the_rest(restarts, engine_cfg):
    orch, disk = restarts
    names = sorted(c["name"] for c in await orch.capsules())
    await orch.close()
    async with await Orchestrator.start(config(engine_cfg, disk)) as again:
        assert sorted(c["name"] for c in await again.capsules()) == names
        [h] = await again.health()
        assert sorted(h["reloaded"]) == ["p0", "p2"] and h["quarantined"] == []  # set aside once, for good


async def test_callers_of_a_killed_workers_sessions_get_worker_lost_within_a_second(ray_session, engine_cfg,
                                                                                    tmp_path_factory):
    async with await Orchestrator.start(config(engine_cfg, tmp_path_factory.mktemp("fast"))) as orch:
        sessions = await asyncio.gather(*(orch.open(PROMPT) for _ in range(30)))
        running = [asyncio.ensure_future(s.generate(900, NOEOS)) for s in sessions]
        await asyncio.sleep(0.5)  # every generate is decoding
        await kill_and_wait((await orch.health())[0]["pid"])
        t0 = time.monotonic()
        for r in await asyncio.gather(*running, return_exceptions=True):
            # seen through the process's lifeline, not when Ray notices (up to a second under load)
            assert isinstance(r, WorkerLost) and re.search(r"its process (\d+ )?exited", str(r)), r
        in_flight_s = time.monotonic() - t0
        t1 = time.monotonic()
        for r in await asyncio.gather(*(s.generate(4) for s in sessions), return_exceptions=True):
            assert isinstance(r, WorkerLost), r  # before the restart is done, not after it
        after_s = time.monotonic() - t1
        assert in_flight_s < 1.0 and after_s < 1.0, (in_flight_s, after_s)
        s = await orch.open(PROMPT)  # a new session waits for the restart and is served
        assert len(await s.generate(3, NOEOS)) == 3


async def test_a_turn_from_a_capsule_whose_worker_dies_under_it_runs_again_on_the_restarted_one(
        ray_session, engine_cfg, tmp_path_factory, oracle):
    """restore_append_generate names no live session (it restores a capsule into a new one), so a worker that
    dies while it decodes costs a rerun on the restarted process, not the caller's request: the pool runs it
    once more, as it runs any rerunnable call."""
    async with await Orchestrator.start(config(engine_cfg, tmp_path_factory.mktemp("rerun"))) as orch:
        s = await orch.open(text("r"))
        await s.snapshot("r", pin=True)  # reloaded from disk by the restarted worker
        await s.close()
        ref = oracle.open()
        ref.append(text("r"))
        want = ref.generate(600, NOEOS)
        ref.close()
        pid = (await orch.health())[0]["pid"]
        turn = asyncio.ensure_future(orch.restore_append_generate("r", None, 600, NOEOS))
        while (await orch.stats())[0]["decoded_tokens"] < 5:
            await asyncio.sleep(0.05)
        assert not turn.done()
        await kill_and_wait(pid)
        assert await turn == want
        assert (await orch.health())[0]["pid"] != pid
