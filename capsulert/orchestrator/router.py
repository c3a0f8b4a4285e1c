"""CapsuleRouter: a namespace's capsule verbs, and where its sessions go.

A session goes to the worker holding its capsule (the least loaded one when several do; one that answers
that it has no such capsule, its copy lost with a restarted process, is passed over for another); a capsule
needed on another worker is copied there byte-exact: over a pair link between the two workers' devices
(NCCL between CUDA workers, Gloo between CPU ones; the default between CUDA workers), as safetensors bytes
through the Ray object store (the default otherwise), or as a verified capsule file on disk. The bytes go
worker to worker, never through the caller. The
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
import logging
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Awaitable, Callable, TypeVar

from capsulert.errors import (BudgetExceededError, CapsuleRTError, ConfigError, DuplicateCapsuleError, PeerLinkError,
                              UnknownCapsuleError, WorkerLost)
from capsulert.orchestrator.capsule_map import NamespaceMap
from capsulert.protocol.checks import name_arg, tier_arg
from capsulert.orchestrator.worker_pool import WorkerPool
from capsulert.protocol.requests import (
    Delete, Demote, ExportCapsule, ExportToDir, ImportCapsule, ImportFromFile, ListCapsules, PeerClose, Promote,
    Rebuild, SendCapsule)

log = logging.getLogger(__name__)
T = TypeVar("T")
_TIER_ORDER = ("device", "host", "disk")  # fastest first, as workers list them
MIGRATION_PATHS = ("auto", "device", "object_store", "disk")
LINK_CONNECT_TIMEOUT_S = 30.0  # at most: a pair link that is not up by then is not coming


class CapsuleRouter:
    """One namespace's capsule verbs and its view of where each capsule lives (held by a Namespace)."""

    def __init__(self, pool: WorkerPool, space: NamespaceMap, ns: str):
        self.pool, self.space, self.ns = pool, space, ns

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
        """Copy capsule `name` to `worker` unless it holds one already: into its device tier or, where that tier
        cannot make room (the capsules it holds are pinned or being read: a step's batch of restores reads
        many at once), the next tier down. The copy's tier is this placement's choice, not the caller's: a
        restore reads a capsule from any tier. BudgetExceededError (the device tier's) when no tier has room."""
        if worker in self._holders(name):
            return
        first: BudgetExceededError | None = None
        for tier in _TIER_ORDER:
            try:
                await self.migrate(name, worker, tier=tier)
                return
            except BudgetExceededError as e:
                first = first or e
                log.info("capsule %r: no room in worker %d's %s tier (%s); placing its copy a tier down",
                         name, worker, tier, e)
            except ConfigError:
                if first is None:
                    raise  # the device tier itself is refused: as before, the caller's error
                # a tier down that this worker has disabled: the next one
        raise first  # type: ignore[misc]

    async def on_holder(self, name: str, run: Callable[[int], Awaitable[T]]) -> tuple[int, T]:
        """run(w) (a request that restores capsule `name` into new sessions) on the least loaded worker w holding
        it; (w, its reply). A holder that answers UnknownCapsuleError while another still holds the capsule is
        passed over for that one (held_elsewhere)."""
        tried: set[int] = set()
        while True:
            w = await self.serving_worker(name, tried)
            try:
                return w, await run(w)
            except UnknownCapsuleError:
                tried.add(w)
                if not self.held_elsewhere(name, tried):
                    raise

    def held_elsewhere(self, name: str, tried: set[int]) -> bool:
        """Whether a worker not in `tried` holds capsule `name`, by the view. A holder answers
        UnknownCapsuleError for a capsule the view gave it when the request waited out the restart of its
        process, whose unpinned copy died with the old one (the resync took it out of the view); a refused
        restore changes nothing, so the request may go to another holder. After a delete, none is left."""
        return bool(self.space.where.get(name, set()) - tried)

    async def serving_worker(self, name: str, exclude: set[int] = frozenset()) -> int:
        """The least loaded worker holding capsule `name`. With OrchestratorConfig.replicate_hot = GAP, a
        capsule whose best holder carries GAP or more sessions (open or in flight) than the least loaded
        live worker is first copied there (migrate, via="auto"): a hot capsule spreads over idle workers on
        demand. A copy that fails is logged and the request stays with the holders."""
        holders = self._holders(name) - exclude
        if not holders:
            raise UnknownCapsuleError(f"no capsule {name!r} in namespace {self.ns!r} on any worker")
        w, gap = self.pool.least_loaded(holders), self.pool.replicate_hot
        if gap is None:
            return w
        idle = self.pool.least_loaded(self.pool.alive())
        if idle not in self._holders(name) and self.pool.load(w) - self.pool.load(idle) >= gap:
            try:
                path = await self.migrate(name, idle)
                if path is not None:
                    log.info("capsule %r: replicated to worker %d (%s) for load", name, idle, path)
            except CapsuleRTError as e:
                log.warning("capsule %r: could not replicate it to the idle worker %d (%s); serving it from "
                            "worker(s) %s", name, idle, e, sorted(self._holders(name)))
            w = self.pool.least_loaded(self._holders(name) - exclude or holders)  # others may have taken the copy
        return w

    # ------------------------------------------------------------------ capsule verbs
    async def migrate(self, name: str, worker: int, *, via: str = "auto", directory: str | None = None,
                      tier: str = "device") -> str | None:
        """Copy capsule `name` to `worker`, byte-exact, by one of these paths (`via`):

        - "device": worker to worker over a pair link (worker/peer_link.py), set up on first use: the
          capsule packed into one buffer on the source's engine device, sealed with its digest, received into
          one on the target's and checked there (capsule_store/format/wire.py). One call per move, to the
          source: the target receives on the link itself (worker/transfers.py). NCCL between CUDA workers,
          Gloo between CPU workers;
        - "object_store": as safetensors bytes through the Ray object store;
        - "disk": as a verified capsule file written to and read from `directory`;
        - "auto" (the default): "device" when both workers' engines are on CUDA, else "object_store". If the
          pair link cannot be set up, a warning names the reason and the object store is used instead.

        Returns the path used ("device", "object_store" or "disk"; the way to see what "auto" chose), or
        None when `worker` held the capsule already. The view gains the copy only once it is complete and
        verified on `worker`; a failed copy raises a typed error (WorkerLost, or its PeerLinkError, for a
        lost or unreachable worker; the target's refusal otherwise) and leaves no capsule on `worker`."""
        name, tier = name_arg(name), tier_arg(tier)
        worker = self.pool.worker_arg(worker)
        if via not in MIGRATION_PATHS:
            raise ConfigError(f"via must be one of {', '.join(map(repr, MIGRATION_PATHS))}; got {via!r}")
        if via == "disk" and directory is None:
            raise ConfigError("via='disk' needs a directory both workers can read")
        self._holders(name)
        async with self.space.locks.hold(name):
            holders = self._holders(name)  # again: it may have been deleted while we waited
            if worker in holders:
                return None
            src, ns = min(holders), self.ns
            if via == "auto":
                via = "device" if self.pool.workers[src].device == self.pool.workers[worker].device == "cuda" \
                    else "object_store"
                if via == "device" and not await self._by_device(name, src, worker, tier, fall_back=True):
                    via = "object_store"
            elif via == "device":
                await self._by_device(name, src, worker, tier, fall_back=False)
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
            elif via == "disk":
                path = await self.pool.call(src, ExportToDir(name, directory, ns))
                try:
                    await self.pool.call(worker, ImportFromFile(path, tier, namespace=ns))
                finally:
                    Path(path).unlink(missing_ok=True)
            self.space.add(name, worker)
            return via

    async def _by_device(self, name: str, src: int, dst: int, tier: str, *, fall_back: bool) -> bool:
        """Copy capsule `name` from src to dst over their pair link: one call, SendCapsule to src, whose reply
        is dst's (dst receives on the link itself: worker/transfers.py). False when the link could not be set
        up and `fall_back` allows another path (logged as a warning with the reason); raises when the copy
        fails: the target's refusal or failure as its typed error, a lost worker or a broken link as
        WorkerLost (PeerLinkError)."""
        timeout = self.pool.call_timeout_s  # the move's deadline on both workers; the call waits a little longer
        async with self.pool.transferring(src, dst):
            try:
                key = await self.pool.link(src, dst, min(LINK_CONNECT_TIMEOUT_S, timeout))
            except WorkerLost as e:  # PeerLinkError is one
                if not fall_back:
                    raise
                log.warning("capsule %r: no device link between workers %d and %d (%s); migrating it through the "
                            "object store instead", name, src, dst, e)
                return False
            try:
                await self.pool.call(src, SendCapsule(name, key, self.ns, timeout, tier), timeout=timeout + 10)
            except WorkerLost as e:
                if not isinstance(e, PeerLinkError) and not self.pool.workers[dst].stale:
                    # the sender was lost or went silent, and the target may still wait on the link (an NCCL op
                    # never notices a dead peer): closing its end fails that op at once. A sender that failed
                    # on the link (PeerLinkError) is alive and closed its end, which breaks the target's
                    # messages; a data op there ends by the same deadline at the latest
                    with suppress(CapsuleRTError):
                        await self.pool.call(dst, PeerClose(key), timeout=10)
                self.pool.drop_link(src, dst)  # the next transfer sets up a new link
                # the target may have stored its verified copy before the link broke: its next call re-lists
                # its capsules, so the view learns of the copy from the worker itself
                self.pool.mark_stale(dst)
                raise
        return True

    async def capsules(self) -> list[dict]:
        """This namespace's capsules on every worker: name, namespace, tier (the fastest copy's), pinned
        (any copy pinned), nbytes (what it holds alone: CapsuleInfo.nbytes), size_bytes (its whole state:
        CapsuleRef.nbytes), boundary, workers (holding a copy) and tiers (each copy's, same order)."""
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

    async def _each_holder(self, request: Promote | Demote | Rebuild) -> None:
        """A checked request on every worker holding its capsule, under the capsule's lock."""
        name = request.name
        async with self.space.locks.hold(name):
            holders = sorted(self._holders(name))
            await asyncio.gather(*(self.pool.call(w, request) for w in holders))

    async def promote(self, name: str, tier: str) -> None:
        await self._each_holder(Promote(name, tier, self.ns))

    async def demote(self, name: str, tier: str | None = None) -> None:
        await self._each_holder(Demote(name, tier, self.ns))

    async def rebuild(self, name: str) -> None:
        """Re-derive capsule `name` under the workers' current weights, on every worker holding it (a
        capsule made before update_weights is refused as stale until then)."""
        await self._each_holder(Rebuild(name, self.ns))

    async def delete(self, name: str) -> None:
        """Delete capsule `name` on every worker holding it (and its persisted file). Waits for the
        snapshots, migrations and moves of that capsule in flight; a restore that started reading it
        first gets the whole capsule (a worker serves a capsule atomically), one after fails cleanly with
        UnknownCapsuleError."""
        request = Delete(name, self.ns)
        async with self.space.locks.hold(name):
            ws = sorted(self._holders(name))
            results = await asyncio.gather(*(self.pool.call(w, request) for w in ws),
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
