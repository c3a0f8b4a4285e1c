"""Races through the orchestrator: many async tasks snapshot, restore, fork, migrate, promote, demote and
delete the same and different capsules at once, on two workers with small tier budgets (so moves and
evictions to disk happen all the time). Invariants:

- no restore observes a half-copied capsule: every successful restore / fork / restore_append_generate
  continues bit for bit like the in-process reference;
- a deleted capsule is never restored: a restore that starts after a delete returned succeeds only if a
  snapshot of that name completed after the delete;
- deletion of a capsule a running restore reads waits for it (the worker serves one engine call at a
  time); a restore queued after the delete fails cleanly with UnknownCapsuleError;
- budgets hold at every poll of the workers' stats while the tasks run;
- every surviving capsule is byte-exact (its exported bytes equal the reference capsule's) and the
  router's view equals the workers' own listings (nothing leaked, nothing resurrected);
- only the typed refusals each verb may legitimately give occur (Unknown / Duplicate / wrong direction).
"""
import asyncio
import random
import time

import pytest
import pytest_asyncio
import torch
from safetensors.torch import load as st_load

from capsulert.capsule_store import tensors_checksum
from capsulert.errors import (CapsuleInUseError, DuplicateCapsuleError, InvalidRequestError, UnknownCapsuleError)
from capsulert.orchestrator import Orchestrator
from capsulert.protocol.requests import ExportCapsule, ListCapsules, Restore, Stats, Turn

pytestmark = pytest.mark.asyncio(loop_scope="session")
BASE = "Race number {k}: the capsule of this prompt must never be seen half written. "
PROMPTS = [BASE.format(k=k) * (1 if k % 3 else 4) for k in range(6)]  # 1 in 3 is past the 128-token grid
SUFFIX, N = " go", 4
GPU_BUDGET, HOST_BUDGET = 3_000_000, 2_000_000  # about 2-3 capsules each (0.5-1.3 MB): constant demotion to disk
TASKS, OPS = 24, 10
ALLOWED = {
    "snapshot": (DuplicateCapsuleError,),
    "restore": (UnknownCapsuleError,), "rag": (UnknownCapsuleError,), "restore_into": (UnknownCapsuleError,),
    "fork": (UnknownCapsuleError,), "migrate": (UnknownCapsuleError,),
    "promote": (UnknownCapsuleError, InvalidRequestError, CapsuleInUseError),
    "demote": (UnknownCapsuleError, InvalidRequestError, CapsuleInUseError),
    "delete": (UnknownCapsuleError, CapsuleInUseError),
}
READS = ("restore", "rag", "restore_into", "fork")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def orch_r(ray_session, engine_cfg, tmp_path_factory):
    engine = {**engine_cfg, "slots": 48, "disk_dir": str(tmp_path_factory.mktemp("race-disk")),
              "capsule_budgets": {"device": GPU_BUDGET, "host": HOST_BUDGET}}
    o = await Orchestrator.start(dict(engine=engine, num_workers=2, call_timeout_s=60, torch_threads=1))
    yield o
    await o.close()


@pytest.fixture(scope="module")
def refs(oracle):
    """Per prompt k: the reference capsule's checksum and tensors, and its greedy continuation."""
    out = {}
    for k, p in enumerate(PROMPTS):
        s = oracle.open()
        s.append(p)
        s.snapshot(f"race-ref-{k}")
        s.close()
        with oracle.store.reading(f"race-ref-{k}") as (meta, tensors):
            cpu = {n: t.clone() for n, t in tensors.items()}
        r = oracle.restore(f"race-ref-{k}")
        r.append(SUFFIX)
        out[k] = dict(checksum=tensors_checksum(cpu), tensors=cpu, cont=r.generate(N), boundary=meta.boundary)
        r.close()
        oracle.store.delete(f"race-ref-{k}")
    return out


def _name(k: int) -> str:
    return f"race-c{k}"


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


async def _check_bytes(orch, name: str, w: int, ref: dict) -> None:
    export = await orch.call(w, ExportCapsule(name))
    checksum, tensors = export.checksum, st_load(export.blob)
    assert checksum == ref["checksum"] == tensors_checksum(tensors), (name, w)
    assert set(tensors) == set(ref["tensors"])
    for key, t in ref["tensors"].items():
        assert tensors[key].dtype == t.dtype and tensors[key].shape == t.shape, (name, w, key)
        assert torch.equal(_raw(tensors[key]), _raw(t)), (name, w, key)


async def test_concurrent_verbs_keep_every_invariant(orch_r, refs):
    orch = orch_r
    makers = [await orch.open(p, worker=k % 2) for k, p in enumerate(PROMPTS)]  # snapshot sources, never change
    for k, m in enumerate(makers):
        await m.snapshot(_name(k), tier=random.Random(k).choice(["device", "host", "disk"]))
    log: list[dict] = []
    failures: list[str] = []
    budget_polls = 0
    done = asyncio.Event()

    async def monitor():
        nonlocal budget_polls
        while not done.is_set():
            for st in await orch.stats():
                store = st["store"]
                if store["device"]["bytes"] > GPU_BUDGET or store["host"]["bytes"] > HOST_BUDGET:
                    failures.append(f"budget exceeded on worker {st['worker']}: {store}")
                if min(store[t]["bytes"] for t in ("device", "host", "disk")) < 0:
                    failures.append(f"negative byte count on worker {st['worker']}: {store}")
            budget_polls += 1
            await asyncio.sleep(0.02)

    async def task(i: int):
        rng = random.Random(1000 + i)
        own = await orch.open(" a task's own session", worker=i % 2)
        for _ in range(OPS):
            op = rng.choice(["snapshot", "snapshot", "snapshot", "restore", "rag", "rag", "restore_into", "fork",
                             "promote", "demote", "delete", "migrate"])
            k = rng.randrange(len(PROMPTS))
            name, ref = _name(k), refs[k]["cont"]
            ev = dict(op=op, k=k, t0=time.monotonic(), ok=False, err=None)
            try:
                if op == "snapshot":
                    await makers[k].snapshot(name, tier=rng.choice(["device", "host", "disk"]))
                elif op == "restore":
                    s = await orch.restore(name)
                    got = await s.append_generate(SUFFIX, N)
                    await s.close()
                    assert got == ref, (op, k)
                elif op == "rag":
                    assert await orch.restore_append_generate(name, SUFFIX, N) == ref, (op, k)
                elif op == "restore_into":
                    await own.restore(name)  # in place, migrating to own's worker when needed
                    assert own.length == refs[k]["boundary"]
                    assert await own.append_generate(SUFFIX, N) == ref, (op, k)
                elif op == "fork":
                    branches = await orch.fork(name, 2)
                    outs = [await b.append_generate(SUFFIX, N) for b in branches]
                    await asyncio.gather(*(b.close() for b in branches))
                    assert outs == [ref, ref], (op, k)
                elif op == "promote":
                    await orch.promote(name, rng.choice(["device", "host"]))
                elif op == "demote":
                    await orch.demote(name, rng.choice(["host", "disk", None]))
                elif op == "delete":
                    await orch.delete(name)
                elif op == "migrate":
                    await orch.migrate(name, rng.randrange(2))
                ev["ok"] = True
            except ALLOWED[op] as e:
                ev["err"] = type(e).__name__
            except AssertionError as e:
                failures.append(f"wrong continuation: {e}")
            except Exception as e:  # noqa: BLE001
                failures.append(f"{op} {name}: unexpected {type(e).__name__}: {e}")
            ev["t1"] = time.monotonic()
            log.append(ev)
        await own.close()

    mon = asyncio.create_task(monitor())
    await asyncio.gather(*(task(i) for i in range(TASKS)))
    done.set()
    await mon
    assert not failures, failures[:10]
    assert len(log) == TASKS * OPS and budget_polls >= 3
    by_op = {op: sum(e["ok"] for e in log if e["op"] == op) for op in ALLOWED}
    assert by_op["delete"] and by_op["snapshot"] and by_op["rag"] and by_op["restore_into"], by_op  # it raced

    # a deleted capsule is never restored: after a delete returned, a restore succeeds only if a
    # snapshot of that name completed after that delete (and started before the restore ended)
    for r in (e for e in log if e["op"] in READS and e["ok"]):
        deletes = [d for d in log if d["op"] == "delete" and d["ok"] and d["k"] == r["k"] and d["t1"] < r["t0"]]
        if deletes:
            last = max(d["t1"] for d in deletes)
            assert any(s["op"] == "snapshot" and s["ok"] and s["k"] == r["k"] and s["t1"] > last and s["t0"] < r["t1"]
                       for s in log), f"capsule {_name(r['k'])} restored after its delete"

    # the router's view is exactly what the workers hold; every surviving copy is byte-exact and
    # continues like the reference on every worker holding it
    listing = {}
    for w in range(2):
        for row in await orch.call(w, ListCapsules()):
            listing.setdefault(row["name"], set()).add(w)
    assert listing == orch.placement()
    for name, holders in listing.items():
        k = int(name.removeprefix("race-c"))
        for w in holders:
            await _check_bytes(orch, name, w, refs[k])
            res = await orch.call(w, Turn(None, name, SUFFIX, N, close=True))
            assert res == refs[k]["cont"]
    for st in await orch.stats():
        assert st["store"]["device"]["bytes"] <= GPU_BUDGET and st["store"]["host"]["bytes"] <= HOST_BUDGET
        assert st["sessions"] == 3 and st["free_slots"] == 48 - 3  # only the makers are left open
    assert orch.capsule_map.held_locks() == 0  # no lock leaked

    # deleted everywhere: no worker keeps a copy
    await asyncio.gather(*(orch.delete(n) for n in list(listing)), *(m.close() for m in makers))
    for w in range(2):
        assert await orch.call(w, ListCapsules()) == []
        for k in range(len(PROMPTS)):
            with pytest.raises(UnknownCapsuleError):
                await orch.call(w, Restore(_name(k)))


async def test_delete_waits_for_the_restore_reading_the_capsule(orch_r, refs):
    orch = orch_r
    s = await orch.open(PROMPTS[1], worker=0)
    await s.snapshot("busy")
    await s.close()
    long_ref = await orch.restore_append_generate("busy", SUFFIX, 120)
    before = (await orch.call(0, Stats()))["sessions"]
    reader = asyncio.create_task(orch.restore_append_generate("busy", SUFFIX, 120))
    while (await orch.call(0, Stats()))["sessions"] == before:  # the restore is running on worker 0
        await asyncio.sleep(0.002)
    await orch.delete("busy")  # queued behind the running restore: returns after it
    assert await reader == long_ref
    with pytest.raises(UnknownCapsuleError):
        await orch.restore_append_generate("busy", SUFFIX, 2)
    with pytest.raises(UnknownCapsuleError):
        await orch.call(0, Restore("busy"))

    # a restore submitted while the delete is queued is served in order: it either read the whole
    # capsule before the delete, or fails with UnknownCapsuleError; never a partial capsule
    await (await orch.open(PROMPTS[2], worker=0)).snapshot("busy2")
    ref2 = await orch.restore_append_generate("busy2", SUFFIX, N)
    readers = [asyncio.create_task(orch.restore_append_generate("busy2", SUFFIX, N)) for _ in range(6)]
    await asyncio.sleep(0)
    deleter = asyncio.create_task(orch.delete("busy2"))
    readers += [asyncio.create_task(orch.restore_append_generate("busy2", SUFFIX, N)) for _ in range(6)]
    results = await asyncio.gather(*readers, return_exceptions=True)
    await deleter
    for r in results:
        assert r == ref2 or isinstance(r, UnknownCapsuleError), r
    assert "busy2" not in orch.placement() and await orch.capsules() == []
    for sess in orch.sessions():
        await sess.close()


async def test_concurrent_snapshots_of_one_name_make_exactly_one_capsule(orch_r, refs):
    orch = orch_r
    sessions = [await orch.open(p, worker=k % 2) for k, p in enumerate(PROMPTS)]
    results = await asyncio.gather(*(s.snapshot("dup") for s in sessions), return_exceptions=True)
    winners = [k for k, r in enumerate(results) if not isinstance(r, BaseException)]
    assert len(winners) == 1
    assert all(isinstance(r, DuplicateCapsuleError) for k, r in enumerate(results) if k != winners[0])
    k = winners[0]
    assert orch.placement()["dup"] == {k % 2}
    await _check_bytes(orch, "dup", k % 2, refs[k])
    assert await orch.restore_append_generate("dup", SUFFIX, N) == refs[k]["cont"]
    # the same name in several namespaces at once: each namespace gets its own capsule
    spaces = [orch.namespace(f"race-ns{j}") for j in range(3)]
    sess = [await sp.open(PROMPTS[j]) for j, sp in enumerate(spaces)]
    await asyncio.gather(*(s.snapshot("dup") for s in sess))
    outs = await asyncio.gather(*(sp.restore_append_generate("dup", SUFFIX, N) for sp in spaces))
    assert outs == [refs[j]["cont"] for j in range(3)]
    # a delete racing a migration of the same capsule: never a copy left behind on the target
    for _ in range(4):
        await asyncio.gather(orch.migrate("dup", 1 - k % 2), orch.delete("dup"), return_exceptions=True)
        listing = [{r["name"] for r in await orch.call(w, ListCapsules("default"))} for w in range(2)]
        assert all(("dup" in names) == (w in orch.placement().get("dup", set())) for w, names in enumerate(listing))
        if "dup" not in orch.placement():
            await sessions[k].snapshot("dup")
    await asyncio.gather(*(s.close() for s in sessions + sess), *(sp.delete("dup") for sp in spaces))
    if "dup" in orch.placement():
        await orch.delete("dup")
    assert await orch.capsules() == []
