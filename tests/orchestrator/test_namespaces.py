"""Namespaces: a handle bound to a tenant sees, restores, forks, promotes, demotes, migrates and deletes
its own capsules only. Another tenant's capsule names, the file names its capsules have on disk, and
path-like names are all refused with typed errors; listing shows only the caller's capsules; routing and
migration stay inside the namespace; the orchestrator's own API is namespace "default"; a restarted
worker brings pinned capsules back into their namespaces."""
import asyncio

import pytest
import pytest_asyncio
import ray

from capsulert.capsule_store import capsule_file_name
from capsulert.capsule_store.format.names import capsule_key_hash
from capsulert.errors import (CapsuleError, DuplicateCapsuleError, InvalidCapsuleNameError, UnknownCapsuleError,
                              WorkerLost)
from capsulert.orchestrator import EpisodeDriver, Namespace, Orchestrator, best_of_n, tree_search
from capsulert.engine.engine import GRID
from capsulert.protocol.requests import ExportCapsule, ExportToDir, ImportCapsule, ImportFromFile, ListCapsules, Restore

pytestmark = pytest.mark.asyncio(loop_scope="session")
ACME = "Acme keeps its trade secrets in a capsule that nobody else may open. "
GLOBEX = "Globex runs a different agent with a different system prompt entirely. "


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def orch_ns(ray_session, engine_cfg, tmp_path_factory):
    disk = tmp_path_factory.mktemp("ns-disk")
    cfg = dict(engine={**engine_cfg, "slots": 12, "disk_dir": str(disk)}, num_workers=2, call_timeout_s=20,
               max_restarts=2, torch_threads=1)
    o = await Orchestrator.start(cfg)
    o.disk = disk
    yield o
    await o.close()


async def _names(h) -> list[str]:
    return [c["name"] for c in await h.capsules()]


async def test_a_tenant_cannot_reach_another_tenants_capsules(orch_ns):
    orch = orch_ns
    acme, globex = orch.namespace("acme"), orch.namespace("globex")
    assert isinstance(acme, Namespace) and orch.namespace("acme") is acme and acme.ns == "acme"
    assert orch.ns == "default"
    for operator_only in ("close", "stats", "health", "namespace"):
        assert not hasattr(acme, operator_only)

    a = await acme.open(ACME, worker=0)
    assert a.namespace == "acme"
    await a.snapshot("secret", pin=True)  # persisted under worker-0/pinned with a hashed file name
    await a.snapshot("same-name")
    g = await globex.open(GLOBEX, worker=1)
    await g.snapshot("same-name")  # names are per namespace: no clash
    await g.snapshot("g-own")
    with pytest.raises(DuplicateCapsuleError):
        await g.snapshot("same-name")

    # listing shows only the caller's own capsules
    assert await _names(acme) == ["same-name", "secret"]
    assert {c["namespace"] for c in await acme.capsules()} == {"acme"}
    assert await _names(globex) == ["g-own", "same-name"]
    assert await orch.capsules() == []  # the default namespace holds nothing
    assert await orch.namespace("default").capsules() == []

    # by name: every verb of globex (and of the default API) refuses acme's capsule as unknown
    other = await globex.open(GLOBEX, worker=0)  # a globex session on the very worker holding "secret"
    refusals = [
        globex.restore("secret"), globex.fork("secret", 2), globex.restore_append_generate("secret", " x", 2),
        globex.promote("secret", "device"), globex.demote("secret", "host"), globex.delete("secret"),
        globex.migrate("secret", 1), other.restore("secret"), other.restore_append_generate("secret", " x", 2),
        best_of_n(globex, "secret", " x", 2, 2),
        tree_search(globex, "secret", lambda n: [" a"], lambda n: 0.0, width=1, depth=1),
        EpisodeDriver(globex, "secret", 2).start(),
        orch.restore("secret"), orch.delete("secret"), orch.fork("secret", 1),
    ]
    for coro in refusals:
        with pytest.raises(UnknownCapsuleError):
            await coro
    # ... also when a worker is asked directly under the wrong namespace
    with pytest.raises(UnknownCapsuleError):
        await orch.call(0, Restore("secret", "globex"))
    with pytest.raises(UnknownCapsuleError):
        await orch.call(0, ExportCapsule("secret"))

    # by guessing file names: the persisted file exists, but its name (or hash, or a path) is no capsule
    files = sorted(p.name for p in (orch.disk / "worker-0" / "pinned").iterdir())
    assert files == [capsule_file_name("acme", "secret")]
    key = capsule_key_hash("acme", "secret")
    for guess in (files[0], files[0].split(".")[0], key, key[:40], "acme:secret", "acme-secret", "acme=secret"):
        for coro in (globex.restore(guess), orch.restore(guess), globex.delete(guess)):
            with pytest.raises(UnknownCapsuleError):
                await coro
    for guess in ("../worker-0/pinned/" + files[0], "/etc/passwd", "acme/secret", "..", ".hidden", "a\x00b",
                  "acme\\secret", "sécret", ""):
        for coro in (globex.restore(guess), globex.fork(guess, 1), globex.delete(guess), other.snapshot(guess)):
            with pytest.raises(InvalidCapsuleNameError):
                await coro
    for bad_ns in ("", "../acme", "a/b", ".acme", "acme\x00", 7, None, "x" * 201):
        with pytest.raises(InvalidCapsuleNameError):
            orch.namespace(bad_ns)

    # nothing changed for acme; its same-name capsule is its own, not globex's
    assert await _names(acme) == ["same-name", "secret"]
    ref_a = await a.append_generate(" next", 6)  # continuing the live session = restoring its capsule
    ref_g = await g.append_generate(" next", 6)
    assert await acme.restore_append_generate("same-name", " next", 6) == ref_a
    assert await globex.restore_append_generate("same-name", " next", 6) == ref_g
    assert ref_a != ref_g
    cands = await best_of_n(acme, "secret", " next", 2, 6, {"temperature": 0.0})
    assert [c.tokens for c in cands] == [ref_a, ref_a]

    # deleting globex's same-name leaves acme's
    await globex.delete("same-name")
    assert await _names(globex) == ["g-own"]
    assert await acme.restore_append_generate("same-name", " next", 6) == ref_a
    await asyncio.gather(a.close(), g.close(), other.close(), acme.delete("same-name"), globex.delete("g-own"))
    assert await _names(acme) == ["secret"]


async def test_routing_and_migration_stay_inside_the_namespace(orch_ns, tmp_path):
    orch = orch_ns
    acme, globex = orch.namespace("acme"), orch.namespace("globex")
    a = await acme.open(ACME, worker=0)
    await a.snapshot("c")
    ref = await acme.restore_append_generate("c", " then", 5)
    # an acme session on worker 1 restores "c": migrated within acme, byte-exact
    a1 = await acme.open(" filler", worker=1)
    await a1.restore("c")
    assert acme.placement()["c"] == {0, 1} and "c" not in orch.placement() and "c" not in globex.placement()
    pa = await orch.call(0, ExportCapsule("c", "acme"))
    pb = await orch.call(1, ExportCapsule("c", "acme"))
    assert pa == pb
    assert await a1.append_generate(" then", 5) == ref
    # globex, on the same two workers, still cannot reach it; and a worker refuses to import it as globex's
    g1 = await globex.open(GLOBEX, worker=1)
    with pytest.raises(UnknownCapsuleError):
        await g1.restore("c")
    with pytest.raises(CapsuleError, match="belongs to namespace 'acme'"):
        await orch.call(1, ImportCapsule(pa, "device", namespace="globex"))
    path = await orch.call(0, ExportToDir("c", str(tmp_path), "acme"))
    with pytest.raises(CapsuleError, match="belongs to namespace 'acme'"):
        await orch.call(1, ImportFromFile(path, "device", namespace="globex"))
    assert await _names(globex) == []
    # a globex capsule of the same name migrates by disk inside globex and does not disturb acme's
    await g1.snapshot("c")
    await globex.migrate("c", 0, via="disk", directory=str(tmp_path / "mig"))
    assert globex.placement()["c"] == {0, 1} and acme.placement()["c"] == {0, 1}
    assert await globex.restore_append_generate("c", " then", 5) == await g1.append_generate(" then", 5)
    assert await acme.restore_append_generate("c", " then", 5) == ref
    await globex.promote("c", "device")
    await globex.demote("c", "disk")
    assert {c["tier"] for c in await globex.capsules()} == {"disk"}
    assert {c["tier"] for c in await acme.capsules() if c["name"] == "c"} == {"device"}
    # the default API is namespace "default" (its listing rows say so, and it routes only default capsules)
    d = await orch.open(ACME, worker=1)
    await d.snapshot("c")
    rows = await orch.capsules()
    assert [(r["name"], r["namespace"], r["workers"]) for r in rows] == [("c", "default", [1])]
    assert orch.placement()["c"] == {1}
    assert await orch.restore_append_generate("c", " then", 5) == ref  # same prompt as acme's "c"
    await asyncio.gather(a.close(), a1.close(), g1.close(), d.close())
    await asyncio.gather(acme.delete("c"), globex.delete("c"), orch.delete("c"))
    assert await _names(acme) == ["secret"] and await _names(globex) == [] and await orch.capsules() == []
    for w in (0, 1):
        rows = await orch.call(w, ListCapsules())
        assert [(r["namespace"], r["name"]) for r in rows] == ([("acme", "secret")] if w == 0 else [])


async def test_restarted_worker_brings_pinned_capsules_back_into_their_namespace(orch_ns):
    orch = orch_ns
    acme, globex = orch.namespace("acme"), orch.namespace("globex")
    ref = await acme.restore_append_generate("secret", " again", 6)
    victim = await acme.open(ACME, worker=0)
    ray.kill(orch.workers[0].handle, no_restart=False)
    with pytest.raises(WorkerLost):
        await victim.generate(400)
    assert await acme.restore_append_generate("secret", " again", 6) == ref
    caps = await acme.capsules()
    assert [(c["name"], c["namespace"], c["pinned"], c["workers"]) for c in caps] == [("secret", "acme", True, [0])]
    assert await orch.capsules() == [] and await globex.capsules() == []
    with pytest.raises(UnknownCapsuleError):
        await globex.restore("secret")
    await acme.delete("secret")
    assert await acme.capsules() == []
    assert list((orch.disk / "worker-0" / "pinned").iterdir()) == []


async def test_a_migrated_capsule_keeps_sharing_its_prefix_blocks(orch_ns, oracle, text):
    ns = orch_ns.namespace("blocks")
    prompt = oracle.tokenize(text)[:300]  # four KV blocks of 64 tokens, and the grid-state block at 256
    src = await ns.open(prompt, worker=0)
    await src.snapshot("blocked")
    want = await src.generate(6)
    await src.close()
    before = (await orch_ns.stats())[1]["store"]["blocks"]["device"]
    dst = await ns.open(" filler", worker=1)
    await dst.restore("blocked")  # migrates worker 0 -> worker 1 through the object store
    assert (await orch_ns.stats())[1]["store"]["blocks"]["device"] == before + 256 // GRID + 1
    assert await dst.generate(6) == want
    mine = await ns.open(prompt, worker=1)  # a capsule of the same prefix made there shares those blocks
    await mine.snapshot("mine")
    assert (await orch_ns.stats())[1]["store"]["blocks"]["device"] == before + 256 // GRID + 1
    await asyncio.gather(dst.close(), mine.close())
