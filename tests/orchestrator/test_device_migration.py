"""Capsule migration worker to worker over a pair link (migrate via="device"): the same code that runs NCCL
between CUDA workers runs Gloo here, between two CPU workers. A migrated capsule is the source's capsule
to the byte (same greedy tokens, logprobs and logits on both workers, identical exports); a link is set up
once per worker pair and reused; a move is one Ray call, to the source (the target receives on the link
itself); "auto" picks the object store between CPU workers; a refusal or a failure on the target stores
nothing there and leaves the router's view and the link as they were; a lost worker fails a move fast, and
the next move sets up a new link. The protocol itself, in one process: test_transfer_protocol.py; the
packed buffer and its digest: test_packed_capsule.py."""
import asyncio
import logging
import time

import numpy as np
import pytest
import pytest_asyncio

from capsulert.errors import ConfigError, DuplicateCapsuleError, PeerLinkError, UnknownCapsuleError, WorkerLost
from capsulert.orchestrator import Orchestrator, worker_pool
from capsulert.protocol.requests import (
    Append, Close, Delete, ExportCapsule, ListCapsules, PeerClose, Restore, SendCapsule, Turn)
from tests.orchestrator.processes import kill_and_wait

on_session_loop = pytest.mark.asyncio(loop_scope="session")
PROMPT = "A capsule moves between workers over a link of their own, byte for byte, and nothing else moves. " * 3


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def orch2(ray_session, engine_cfg):
    o = await Orchestrator.start(dict(engine={**engine_cfg, "slots": 8}, num_workers=2, call_timeout_s=30,
                                      max_restarts=1, torch_threads=1))
    yield o
    await o.close()


async def _capsule(orch, name: str, text: str = PROMPT, worker: int = 0) -> None:
    s = await orch.open(text, worker=worker)
    await s.snapshot(name)
    await s.close()


async def _names_on(orch, w: int, ns: str = "default") -> set[str]:
    return {c["name"] for c in await orch.call(w, ListCapsules(ns))}


async def _served(orch, w: int, name: str):
    """What worker w serves from capsule `name`: greedy tokens with their logprobs, and the logits after
    appending a suffix to a restored session."""
    res = await orch.call(w, Turn(None, name, " and then", 8, close=True))
    info = await orch.call(w, Restore(name))
    after = await orch.call(w, Append(info.session, " next", logits=True))
    await orch.call(w, Close(info.session))
    return list(res), list(res.logprobs), np.asarray(after.logits)


def _ray_calls(monkeypatch) -> list[str]:
    """The request type of every Ray call the pool submits from now on."""
    submitted, real = [], worker_pool.send

    def counted(handle, request, call_id=None):
        submitted.append(type(request).__name__)
        return real(handle, request, call_id)

    monkeypatch.setattr(worker_pool, "send", counted)
    return submitted


def _calls(orch, monkeypatch, lose=None) -> list[tuple[int, str]]:
    """(worker, request type) of every call the pool makes from now on; a request of type `lose` fails with
    WorkerLost instead, as when its worker was lost under it."""
    calls, real = [], orch.pool.call

    async def counted(w, request, **kw):
        calls.append((w, type(request).__name__))
        if lose is not None and isinstance(request, lose):
            raise WorkerLost(f"worker {w} was lost (simulated)")
        return await real(w, request, **kw)

    monkeypatch.setattr(orch.pool, "call", counted)
    return calls


@on_session_loop
async def test_a_capsule_migrated_over_the_link_is_the_same_capsule_and_the_link_is_reused(orch2, monkeypatch):
    orch = orch2
    await _capsule(orch, "dev-a")
    gen = orch.pool.link_generation
    assert await orch.migrate("dev-a", 1, via="device") == "device"
    assert orch.holders("dev-a") == {0, 1}
    assert orch.pool.link_generation == gen + 1 and len(orch.pool.links) == 1
    key = next(iter(orch.pool.links.values()))[1]

    toks0, lp0, logits0 = await _served(orch, 0, "dev-a")
    toks1, lp1, logits1 = await _served(orch, 1, "dev-a")
    assert len(toks0) == 8 and toks1 == toks0 and lp1 == lp0
    assert np.array_equal(logits1, logits0)
    e0, e1 = await asyncio.gather(orch.call(0, ExportCapsule("dev-a")), orch.call(1, ExportCapsule("dev-a")))
    assert e1.blob == e0.blob and e1.checksum == e0.checksum and e1.meta_json == e0.meta_json
    assert e1.origin == e0.origin is not None  # same origin: the target shares its blocks like the source

    # the other way round, over the same link: nothing is set up again, and a move is one call, to the source
    await _capsule(orch, "dev-b", PROMPT + " Another branch.", worker=1)
    calls, submitted = _calls(orch, monkeypatch), _ray_calls(monkeypatch)
    assert await orch.migrate("dev-b", 0, via="device") == "device"
    assert calls == [(1, "SendCapsule")] and submitted == ["SendCapsule"]
    monkeypatch.undo()
    assert orch.pool.link_generation == gen + 1 and next(iter(orch.pool.links.values()))[1] == key
    assert (await _served(orch, 0, "dev-b"))[0] == (await _served(orch, 1, "dev-b"))[0]
    assert await orch.migrate("dev-b", 0, via="device") is None  # held already: nothing copied


@on_session_loop
async def test_auto_uses_the_object_store_between_cpu_workers_and_via_is_checked(orch2):
    orch = orch2
    await _capsule(orch, "auto-a")
    gen = orch.pool.link_generation
    assert await orch.migrate("auto-a", 1) == "object_store"  # the default is "auto"
    assert orch.holders("auto-a") == {0, 1} and orch.pool.link_generation == gen
    with pytest.raises(ConfigError) as err:
        await orch.migrate("auto-a", 1, via="nvlink")
    for choice in ("auto", "device", "object_store", "disk"):
        assert repr(choice) in str(err.value)
    with pytest.raises(UnknownCapsuleError):
        await orch.migrate("no-such-capsule", 1, via="device")


@on_session_loop
async def test_auto_takes_the_link_between_cuda_workers_and_falls_back_with_a_warning(orch2, monkeypatch):
    """What "auto" decides from the workers' engine devices: simulated here by saying both are on CUDA (the
    workers, on CPU, still run the same link code over Gloo)."""
    orch = orch2
    for w in orch.pool.workers:
        monkeypatch.setattr(w, "device", "cuda")
    await _capsule(orch, "auto-b")
    assert await orch.migrate("auto-b", 1) == "device" and orch.holders("auto-b") == {0, 1}

    async def no_link(a, b, timeout_s):
        raise PeerLinkError("the store port 4242 was taken")

    monkeypatch.setattr(orch.pool, "link", no_link)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    router_log = logging.getLogger("capsulert.orchestrator.router")
    router_log.addHandler(handler)
    monkeypatch.setattr(router_log, "level", logging.WARNING)
    try:
        await _capsule(orch, "auto-c")
        assert await orch.migrate("auto-c", 1) == "object_store" and orch.holders("auto-c") == {0, 1}
    finally:
        router_log.removeHandler(handler)
    assert len(records) == 1 and "port 4242 was taken" in records[0].getMessage()
    assert "object store" in records[0].getMessage()
    await _capsule(orch, "auto-d")
    with pytest.raises(PeerLinkError):  # asked for explicitly: no fallback
        await orch.migrate("auto-d", 1, via="device")
    assert orch.holders("auto-d") == {0}


@on_session_loop
async def test_a_failing_receiver_stores_nothing_and_leaves_the_view_and_the_link_as_they_were(orch2):
    orch = orch2
    await _capsule(orch, "fail-a")
    view = orch.placement()
    # the target fails after the bytes arrived (its disk tier is disabled): nothing stored, view unchanged
    with pytest.raises(ConfigError, match="disk"):
        await orch.migrate("fail-a", 1, via="device", tier="disk")
    assert orch.placement() == view and "fail-a" not in await _names_on(orch, 1)

    # the target refuses before any bytes move (a capsule it holds already), asked directly over the link the
    # failed migration set up (it stays up: both sides ran the whole exchange)
    assert len(orch.pool.links) == 1
    key = next(iter(orch.pool.links.values()))[1]
    await _capsule(orch, "fail-b")
    await orch.call(0, SendCapsule("fail-b", key))
    with pytest.raises(DuplicateCapsuleError, match="already exists"):
        await orch.call(0, SendCapsule("fail-b", key))
    await orch.call(1, Delete("fail-b"))  # the copy the router does not know of
    assert "fail-a" not in await _names_on(orch, 1) and orch.placement() == {**view, "fail-b": {0}}

    # the link is still in step: the next migration over it succeeds, bitwise
    gen = orch.pool.link_generation
    assert await orch.migrate("fail-a", 1, via="device") == "device"
    assert orch.pool.link_generation == gen and orch.holders("fail-a") == {0, 1}
    assert (await _served(orch, 1, "fail-a"))[:2] == (await _served(orch, 0, "fail-a"))[:2]


@on_session_loop
async def test_a_sender_lost_under_a_move_has_the_targets_end_of_the_link_closed(orch2, monkeypatch):
    """As Ray reports a source lost under its call: the target may still wait on the link for bytes (an NCCL
    op never notices a dead peer), so the router closes the target's end (PeerClose), which breaks the link
    on both workers; the next move sets up a new one."""
    orch = orch2
    await _capsule(orch, "lost-a")
    await orch.migrate("lost-a", 1, via="device")  # the link is up
    gen, key = orch.pool.link_generation, orch.pool.links[(0, 1)][1]
    calls = _calls(orch, monkeypatch, lose=SendCapsule)
    await _capsule(orch, "lost-b")
    t0 = time.monotonic()
    with pytest.raises(WorkerLost, match="simulated"):
        await orch.migrate("lost-b", 1, via="device")
    assert time.monotonic() - t0 < 10 and orch.holders("lost-b") == {0} and (0, 1) not in orch.pool.links
    assert calls[-2:] == [(0, "SendCapsule"), (1, "PeerClose")]
    monkeypatch.undo()
    assert await orch.call(1, PeerClose(key)) is None  # closed already: a no-op
    assert await orch.migrate("lost-b", 1, via="device") == "device"  # over a new link
    assert orch.pool.link_generation == gen + 1


@on_session_loop
async def test_a_peer_that_dies_fails_the_transfer_fast_and_its_restart_gets_a_new_link(orch2):
    orch = orch2
    await _capsule(orch, "rs-a")
    await _capsule(orch, "rs-b")
    assert await orch.migrate("rs-a", 1, via="device") == "device"
    pids, key = orch.pool.links[(0, 1)]
    view = orch.placement()
    # the transfer alone finds the death, as when the lifeline of a worker on another node cannot be reached
    # (a death the pool has seen makes the migration wait for the restart instead)
    orch.pool.workers[1].process.close()
    await kill_and_wait(pids[1])  # gone before the migration starts: a kill lands some time after it is sent
    t0 = time.monotonic()
    with pytest.raises(WorkerLost):  # the receiver died: the link tells the sender, which does not wait for it
        await orch.migrate("rs-b", 1, via="device")
    assert time.monotonic() - t0 < 20 and orch.placement() == view and (0, 1) not in orch.pool.links

    # worker 1 comes back (its capsules died with it); the next migration makes a new link and works
    assert await orch.migrate("rs-b", 1, via="device") == "device"
    pids2, key2 = orch.pool.links[(0, 1)]
    assert pids2[0] == pids[0] and pids2[1] != pids[1] and key2 != key
    assert orch.holders("rs-b") == {0, 1} and orch.holders("rs-a") == {0}
    assert (await _served(orch, 1, "rs-b"))[:2] == (await _served(orch, 0, "rs-b"))[:2]
