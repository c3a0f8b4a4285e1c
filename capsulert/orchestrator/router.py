"""CapsuleRouter: a namespace's capsule verbs, and where its sessions go.

A session goes to the worker holding its capsule (the least loaded one when several do); a capsule
needed on another worker is copied there byte-exact, as safetensors bytes through the Ray object store
(the bytes go worker to worker, never through the caller) or as a verified capsule file on disk. The
view (capsule_map.py) is rebuilt from the workers' own listings whenever a worker was lost or restarted.

Every view is per namespace: a name is looked up only among the capsules of the caller's namespace, and
every request carries the namespace, so another namespace's capsules are unknown by construction
(UnknownCapsuleError), whatever name is tried.

Concurrency: the verbs that change where a capsule lives or whether it exists (snapshot, delete,
migrate, promote, demote) hold a per-(namespace, name) asyncio lock for their whole duration, so they are
serialised per capsule: a migration never lands on a worker after the capsule's deletion (no
resurrection), two snapshots of one name never both run, and the view is updated in the same critical
section as the requests. Restores do not take the lock: a worker serves a capsule atomically, so a restore
racing a delete either sees the whole capsule or fails with UnknownCapsuleError.
"""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from pathlib import Path

from capsulert.errors import ConfigError, DuplicateCapsuleError, UnknownCapsuleError, WorkerLost
from capsulert.orchestrator.capsule_map import NamespaceMap
from capsulert.orchestrator.orchestrator_config import name_arg, tier_arg
from capsulert.orchestrator.worker_pool import WorkerPool
from capsulert.worker.verbs import (Delete, Demote, ExportCapsule, ExportToDir, ImportCapsule, ImportFromFile,
                                    ListCapsules, Promote, Rebuild, Request)

_TIER_ORDER = ("gpu", "host", "disk")  # fastest first, as workers list them


class CapsuleRouter:
    """Mixin of Namespace: needs self.pool (WorkerPool), self.ns and self.space (its NamespaceMap)."""

    pool: WorkerPool
    ns: str
    space: NamespaceMap

    # ------------------------------------------------------------------ the view
    def holders(self, name: str) -> set[int]:
        """The workers holding capsule `name` of this namespace (UnknownCapsuleError when none does)."""
        return set(self._holders(name))

    def placement(self) -> dict[str, set[int]]:
        """This namespace's capsules as the router sees them: name -> the workers holding a copy."""
        return {name: set(h) for name, h in self.space.where.items()}

    def _holders(self, name: str) -> set[int]:
        holders = self.space.where.get(name)
        if not holders:
            raise UnknownCapsuleError(f"no capsule {name!r} in namespace {self.ns!r} on any worker")
        return holders

    @asynccontextmanager
    async def new_capsules(self, names, worker: int):
        """Make capsules `names` on `worker` in the body: their locks held, a name that exists refused
        (DuplicateCapsuleError), and the view updated when the body succeeds."""
        async with self.space.locks.hold(*names):
            for name in names:
                if name in self.space.where:
                    raise DuplicateCapsuleError(
                        f"capsule {name!r} already exists in namespace {self.ns!r} (on worker(s) "
                        f"{sorted(self.space.where[name])}); capsules are immutable: delete it first")
            yield
            for name in names:
                self.space.add(name, worker)

    async def ensure_on(self, name: str, worker: int) -> None:
        """Copy capsule `name` to `worker` unless it holds one already."""
        if worker not in self._holders(name):
            await self.migrate(name, worker)

    async def _on_holder(self, name: str, request: Request, **kw):
        """`request` on the least loaded worker holding capsule `name`; (worker, reply)."""
        w = self.pool.least_loaded(self._holders(name))
        return w, await self.pool.call(w, request, **kw)

    # ------------------------------------------------------------------ capsule verbs
    async def migrate(self, name: str, worker: int, *, via: str = "object_store", directory: str | None = None,
                      tier: str = "gpu") -> None:
        """Copy capsule `name` to `worker`, byte-exact: as safetensors bytes through the Ray object store
        (default), or as a verified capsule file written to and read from `directory` (via="disk")."""
        name, tier = name_arg(name), tier_arg(tier)
        worker = self.pool.worker_arg(worker)
        if via not in ("object_store", "disk"):
            raise ConfigError(f"via must be 'object_store' or 'disk', got {via!r}")
        if via == "disk" and directory is None:
            raise ConfigError("via='disk' needs a directory both workers can read")
        self._holders(name)
        async with self.space.locks.hold(name):
            holders = self._holders(name)  # again: it may have been deleted while we waited
            if worker in holders:
                return
            src, ns = min(holders), self.ns
            if via == "object_store":
                await self.pool.check(src)
                # the bytes stay in the object store: worker to worker, never through the caller
                payload = self.pool.send(src, ExportCapsule(name, ns))
                try:
                    await self.pool.call(worker, ImportCapsule(payload, tier, namespace=ns))
                except WorkerLost:
                    # a lost source fails the import too: have the next call on either worker check it
                    self.pool.mark_stale(src)
                    raise
            else:
                path = await self.pool.call(src, ExportToDir(name, directory, ns))
                try:
                    await self.pool.call(worker, ImportFromFile(path, tier, namespace=ns))
                finally:
                    Path(path).unlink(missing_ok=True)
            self.space.add(name, worker)

    async def capsules(self) -> list[dict]:
        """This namespace's capsules on every worker: name, namespace, tier (the fastest copy's), pinned
        (any copy pinned), nbytes, boundary, workers (holding a copy) and tiers (each copy's, same order)."""
        merged: dict[str, dict] = {}
        alive = self.pool.alive()  # a worker gone for good took its capsules with it
        for rows in await asyncio.gather(*(self.pool.call(w, ListCapsules(self.ns)) for w in alive)):
            for r in rows:
                w = r.pop("worker")
                m = merged.setdefault(r["name"], {**r, "workers": [], "tiers": []})
                m["workers"].append(w)
                m["tiers"].append(r["tier"])
                m["pinned"] = m["pinned"] or r["pinned"]
        for m in merged.values():
            m["tier"] = min(m["tiers"], key=_TIER_ORDER.index)
        return [merged[k] for k in sorted(merged)]

    async def _each_holder(self, name: str, request: Request) -> None:
        async with self.space.locks.hold(name):
            holders = sorted(self._holders(name))
            await asyncio.gather(*(self.pool.call(w, request) for w in holders))

    async def promote(self, name: str, tier: str) -> None:
        name, tier = name_arg(name), tier_arg(tier)
        await self._each_holder(name, Promote(name, tier, self.ns))

    async def demote(self, name: str, tier: str | None = None) -> None:
        name = name_arg(name)
        tier = None if tier is None else tier_arg(tier)
        await self._each_holder(name, Demote(name, tier, self.ns))

    async def rebuild(self, name: str) -> None:
        """Re-derive capsule `name` under the workers' current weights, on every worker holding it (a
        capsule made before update_weights is refused as stale until then)."""
        name = name_arg(name)
        await self._each_holder(name, Rebuild(name, self.ns))

    async def delete(self, name: str) -> None:
        """Delete capsule `name` on every worker holding it (and its persisted file). Waits for the
        snapshots, migrations and moves of that capsule in flight; a restore that started reading it
        first gets the whole capsule (a worker serves a capsule atomically), one after fails cleanly with
        UnknownCapsuleError."""
        name = name_arg(name)
        async with self.space.locks.hold(name):
            ws = sorted(self._holders(name))
            results = await asyncio.gather(*(self.pool.call(w, Delete(name, self.ns)) for w in ws),
                                           return_exceptions=True)
            errors = []
            for w, r in zip(ws, results):  # each copy gone (or never there) leaves the view
                if r is None or isinstance(r, UnknownCapsuleError):  # gone from w either way
                    self.space.discard(name, w)
                else:
                    errors.append(r)
            if errors:
                raise errors[0]
            if all(isinstance(r, UnknownCapsuleError) for r in results):
                raise results[0]
