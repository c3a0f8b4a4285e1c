"""CapsuleRouter: a namespace's view of which worker holds which of its capsules, and the capsule verbs.

A session goes to the worker holding its capsule (the least loaded one when several do); a capsule
needed on another worker is copied there byte-exact, as safetensors bytes through the Ray object store
(the bytes go worker to worker, never through the caller) or as a verified capsule file on disk. The
view is rebuilt from the workers' own listings whenever a worker was lost or restarted.

Every view is per namespace (`_Space`): a name is looked up only among the capsules of the caller's
namespace, and every worker call carries the namespace, so another namespace's capsules are unknown
by construction (UnknownCapsuleError), whatever name is tried.

Concurrency: the verbs that change where a capsule lives or whether it exists (snapshot, delete,
migrate, promote, demote, snapshotting branches) hold a per-(namespace, name) asyncio lock for their
whole duration, so they are serialised per capsule: a migration never lands on a worker after the
capsule's deletion (no resurrection), two snapshots of one name never both run, and the router's
view is updated in the same critical section as the worker calls. Restores do not take the lock: they
read a capsule that a worker's engine serves atomically (one engine call at a time per worker), so a
restore racing a delete either sees the whole capsule or fails with UnknownCapsuleError.
"""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from capsulert.errors import ConfigError, DuplicateCapsuleError, UnknownCapsuleError, WorkerLost
from capsulert.orchestrator.orchestrator_config import name_arg, tier_arg


class NameLocks:
    """asyncio locks by capsule name, created on demand and dropped when nobody holds or waits."""

    def __init__(self) -> None:
        self._locks: dict[str, list] = {}  # name -> [Lock, holders + waiters]

    def __len__(self) -> int:
        return len(self._locks)

    def locked(self, name: str) -> bool:
        e = self._locks.get(name)
        return e is not None and e[0].locked()

    @asynccontextmanager
    async def hold(self, *names: str):
        """Hold the locks of `names` (sorted, so two holders of overlapping sets cannot deadlock)."""
        entries = []
        for n in sorted(set(names)):
            e = self._locks.setdefault(n, [asyncio.Lock(), 0])
            e[1] += 1
            entries.append((n, e))
        got = []
        try:
            for _, e in entries:
                await e[0].acquire()
                got.append(e)
            yield
        finally:
            for e in got:
                e[0].release()
            for n, e in entries:
                e[1] -= 1
                if e[1] == 0:
                    del self._locks[n]


@dataclass
class _Space:
    """The router's state for one namespace (shared by every handle on that namespace)."""

    where: dict[str, set[int]] = field(default_factory=dict)  # capsule name -> workers holding a copy
    locks: NameLocks = field(default_factory=NameLocks)


class CapsuleRouter:
    """Mixin of Namespace: needs self._orch (the Orchestrator: workers, _call), self.ns and self._space."""

    ns: str

    @property
    def _where(self) -> dict[str, set[int]]:
        return self._space.where

    # ------------------------------------------------------------------ routing
    def _least_loaded(self, among) -> int:
        workers = self._orch.workers
        alive = [i for i in among if workers[i].lost is None]
        if not alive:
            raise WorkerLost(f"every worker that could serve this is gone for good: "
                             f"{'; '.join(f'worker {i}: {workers[i].lost}' for i in among)}")
        return min(alive, key=lambda i: (workers[i].sessions + workers[i].pending, i))

    def _holders(self, name: str) -> set[int]:
        holders = self._where.get(name)
        if not holders:
            raise UnknownCapsuleError(f"no capsule {name!r} in namespace {self.ns!r} on any worker")
        return holders

    def _worker_arg(self, worker) -> int:
        n = len(self._orch.workers)
        if not isinstance(worker, int) or isinstance(worker, bool) or not 0 <= worker < n:
            raise ConfigError(f"no worker {worker!r}; there are {n}")
        return worker

    def _check_new_name(self, name: str) -> None:
        if name in self._where:
            raise DuplicateCapsuleError(
                f"capsule {name!r} already exists in namespace {self.ns!r} (on worker(s) {sorted(self._where[name])}); "
                "capsules are immutable: delete it first")

    def _add_holder(self, name: str, w: int) -> None:
        self._where.setdefault(name, set()).add(w)

    async def _ensure_on(self, name: str, w: int) -> None:
        if w not in self._holders(name):
            await self.migrate(name, w)

    async def migrate(self, name: str, worker: int, *, via: str = "object_store", directory: str | None = None,
                      tier: str = "gpu") -> None:
        """Copy capsule `name` to `worker`, byte-exact: as safetensors bytes through the Ray object store
        (default), or as a verified capsule file written to and read from `directory` (via="disk")."""
        name, tier = name_arg(name), tier_arg(tier)
        worker = self._worker_arg(worker)
        if via not in ("object_store", "disk"):
            raise ConfigError(f"via must be 'object_store' or 'disk', got {via!r}")
        if via == "disk" and directory is None:
            raise ConfigError("via='disk' needs a directory both workers can read")
        self._holders(name)
        async with self._space.locks.hold(name):
            holders = self._holders(name)  # again: it may have been deleted while we waited
            if worker in holders:
                return
            src, ns = min(holders), self.ns
            if via == "object_store":
                await self._orch._check_worker(src)
                # the bytes stay in the object store: worker to worker, never through the caller
                payload = self._orch.workers[src].handle.export_capsule.remote(name, namespace=ns)
                try:
                    await self._orch._call(worker, "import_capsule", payload, tier, namespace=ns)
                except WorkerLost:
                    # a lost source fails the import too: have the next call on either worker check it
                    self._orch.workers[src].stale = True
                    raise
            else:
                path = await self._orch._call(src, "export_to_dir", name, directory, namespace=ns)
                try:
                    await self._orch._call(worker, "import_from_file", path, tier, namespace=ns)
                finally:
                    Path(path).unlink(missing_ok=True)
            self._add_holder(name, worker)

    # ------------------------------------------------------------------ capsule verbs
    async def capsules(self) -> list[dict]:
        """This namespace's capsules on every worker: name, namespace, tier (the fastest copy's), pinned
        (any copy pinned), nbytes, boundary, workers (holding a copy) and tiers (each copy's, same order)."""
        workers = self._orch.workers
        merged: dict[str, dict] = {}
        alive = [w for w in workers if w.lost is None]  # a worker gone for good took its capsules with it
        for rows in await asyncio.gather(*(self._orch._call(w.index, "list_capsules", self.ns) for w in alive)):
            for r in rows:
                w = r.pop("worker")
                m = merged.setdefault(r["name"], {**r, "workers": [], "tiers": []})
                m["workers"].append(w)
                m["tiers"].append(r["tier"])
                m["pinned"] = m["pinned"] or r["pinned"]
        for m in merged.values():
            m["tier"] = min(m["tiers"], key=("gpu", "host", "disk").index)
        return [merged[k] for k in sorted(merged)]

    async def _each_holder(self, name: str, method: str, *args) -> None:
        async with self._space.locks.hold(name):
            holders = sorted(self._holders(name))
            await asyncio.gather(*(self._orch._call(w, method, name, *args, namespace=self.ns) for w in holders))

    async def promote(self, name: str, tier: str) -> None:
        name, tier = name_arg(name), tier_arg(tier)
        await self._each_holder(name, "promote", tier)

    async def demote(self, name: str, tier: str | None = None) -> None:
        name = name_arg(name)
        tier = None if tier is None else tier_arg(tier)
        await self._each_holder(name, "demote", tier)

    async def rebuild(self, name: str) -> None:
        """Re-derive capsule `name` under the workers' current weights, on every worker holding it (a
        capsule made before update_weights is refused as stale until then)."""
        await self._each_holder(name_arg(name), "rebuild")

    async def delete(self, name: str) -> None:
        """Delete capsule `name` on every worker holding it (and its persisted file). Waits for the
        snapshots, migrations and moves of that capsule in flight; a restore already queued on a worker
        runs first (the worker serves one engine call at a time), one queued after fails cleanly with
        UnknownCapsuleError."""
        name = name_arg(name)
        async with self._space.locks.hold(name):
            holders = self._holders(name)
            ws = sorted(holders)
            results = await asyncio.gather(*(self._orch._call(w, "delete", name, namespace=self.ns) for w in ws),
                                            return_exceptions=True)
            errors = []
            for w, r in zip(ws, results):  # each copy gone (or never there) leaves the view
                if r is None or isinstance(r, UnknownCapsuleError):  # gone from w either way
                    holders.discard(w)
                else:
                    errors.append(r)
            if not holders:
                self._where.pop(name, None)
            if errors:
                raise errors[0]
            if all(isinstance(r, UnknownCapsuleError) for r in results):
                raise results[0]
