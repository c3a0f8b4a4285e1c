"""Orchestrator: the async API. Starts (or joins) Ray, spawns one WorkerActor per GPU (or CPU worker),
routes each session to the worker holding its capsule, migrates capsules between workers through host
bytes in the Ray object store (or a disk directory), and turns every failure into a typed error:
engine refusals keep their capsulert class, a dead or silent worker is WorkerLost within the timeout.

Capsules live in namespaces: `orch.namespace("acme")` is a handle with the same verbs, bound to the
capsules of "acme" (see namespace.py); the Orchestrator's own verbs serve namespace "default".
"""
from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from pydantic import ValidationError
from ray.exceptions import (ActorDiedError, ActorUnavailableError, GetTimeoutError, ObjectLostError, RayActorError,
                            RayTaskError, WorkerCrashedError)

from capsulert.capsule_store import validate_name
from capsulert.capsule_store.owner import DirLock
from capsulert.errors import CapsuleRTError, ConfigError, WorkerLost
from capsulert.orchestrator.orchestrator_config import OrchestratorConfig
from capsulert.orchestrator.namespace import Namespace
from capsulert.orchestrator.router import _Space
from capsulert.orchestrator.remote_session import GenerateResult, RemoteSession
from capsulert.orchestrator.worker_actor import WorkerActor

_LOST = (RayActorError, WorkerCrashedError, ObjectLostError, GetTimeoutError)
# calls whose every effect lives in the worker's memory (sessions, unpinned capsules, reads): when the
# worker restarted under one, whatever it did died with the old process, so it runs once more on the new
# one. Session verbs are not here (their session died too), nor verbs that persist (pinned snapshot, delete).
_RERUNNABLE = frozenset({"open", "restore", "fork", "restore_append_generate", "fork_append_generate",
                         "list_capsules", "stats", "ping", "tokenize", "detokenize", "export_capsule"})


class _Restarting(Exception):
    """Internal: the worker died under a call and Ray is restarting it (surfaces as WorkerLost)."""


@dataclass
class _Worker:
    index: int
    handle: Any
    sessions: int = 0
    pending: int = 0  # calls in flight (so concurrent opens spread out before any reply counts a session)
    stale: bool = False
    resync: Any = None  # the task bringing the router's view of this worker up to date
    pid: int | None = None  # the process answering now: a new pid after a resync means Ray restarted it
    lost: str | None = None  # why the worker is gone for good (Ray will not restart it); calls fail at once


class Orchestrator(Namespace):
    """The operator's object: lifecycle, workers, stats, and namespace handles. As a handle itself it
    serves namespace "default" (orch.open / restore / capsules / ... act on "default" capsules only)."""

    def __init__(self, config: OrchestratorConfig, workers: list[_Worker], owns_ray: bool,
                 dir_lock: DirLock | None = None):
        self.config, self.workers, self._owns_ray = config, workers, owns_ray
        self._dir_lock = dir_lock  # engine.disk_dir is ours while we live: a second orchestrator is refused
        self._spaces: dict[str, _Space] = {}  # namespace -> router state (capsule name -> holders, locks)
        self._handles: dict[str, Namespace] = {}
        self._open: weakref.WeakSet[RemoteSession] = weakref.WeakSet()
        self._closed = False
        super().__init__(self, "default")

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    async def start(cls, config: OrchestratorConfig | dict | None = None, **overrides) -> "Orchestrator":
        try:
            if isinstance(config, OrchestratorConfig):
                cfg = config.model_copy(update=overrides) if overrides else config
            else:
                cfg = OrchestratorConfig.model_validate({**(config or {}), **overrides})
        except ValidationError as e:
            raise ConfigError(f"invalid orchestrator config: {e}") from None
        # before any worker starts: two orchestrators (or an engine) on one disk_dir would share worker-i dirs
        dir_lock = DirLock(cfg.engine.disk_dir, "orchestrator") if cfg.engine.disk_dir else None
        try:
            return await cls._start(cfg, dir_lock)
        except BaseException:
            if dir_lock is not None:
                dir_lock.release()
            raise

    @classmethod
    async def _start(cls, cfg: OrchestratorConfig, dir_lock: DirLock | None) -> "Orchestrator":
        owns = False
        if not ray.is_initialized():
            kw = dict(include_dashboard=False, log_to_driver=False)
            ray.init(address=cfg.address, **kw) if cfg.address else ray.init(num_cpus=cfg.local_num_cpus, **kw)
            owns = True
        use_gpu = torch.cuda.is_available() and cfg.engine.device != "cpu"
        workers = []
        for i in range(cfg.num_workers):
            ecfg, persist = cfg.engine.model_dump(), None
            if cfg.engine.disk_dir:
                ecfg["disk_dir"] = str(Path(cfg.engine.disk_dir) / f"worker-{i}")
                persist = str(Path(ecfg["disk_dir"]) / "pinned") if cfg.persist_pinned else None
            opts: dict = dict(max_restarts=cfg.max_restarts, max_task_retries=0, num_gpus=1 if use_gpu else 0)
            if cfg.worker_num_cpus is not None:
                opts["num_cpus"] = cfg.worker_num_cpus
            handle = WorkerActor.options(**opts).remote(ecfg, persist, cfg.torch_threads, i)
            workers.append(_Worker(i, handle))
        orch = cls(cfg, workers, owns, dir_lock)
        try:
            await asyncio.gather(*(orch._resync(w.index, cfg.start_timeout_s) for w in workers))
        except BaseException:
            await orch.close()
            raise
        return orch

    async def close(self) -> None:
        """Kill the workers (sessions and unpersisted capsules go with them); shut Ray down if we started it."""
        if self._closed:
            return
        self._closed = True
        for s in list(self._open):
            s.closed = True
        for w in self.workers:
            ray.kill(w.handle, no_restart=True)
        if self._owns_ray:
            ray.shutdown()
        if self._dir_lock is not None:
            self._dir_lock.release()

    async def __aenter__(self) -> "Orchestrator":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ calls
    async def _await(self, w: int, ref, what: str, timeout: float | None):
        try:
            return await self._await_or_restarting(w, ref, what, timeout)
        except _Restarting as e:
            raise WorkerLost(str(e)) from None

    async def _await_or_restarting(self, w: int, ref, what: str, timeout: float | None):
        """_await, except that a worker Ray is restarting raises _Restarting (the caller may rerun the call)."""
        t = timeout if timeout is not None else self.config.call_timeout_s
        try:
            return await asyncio.wait_for(ref, t)
        except asyncio.TimeoutError:
            self.workers[w].stale = True
            raise WorkerLost(f"worker {w} did not answer {what} within {t:g}s") from None
        except RayTaskError as e:
            if isinstance(e.cause, CapsuleRTError):
                raise e.cause from None
            if isinstance(e.cause, _LOST):  # an argument came from a worker that died (capsule migration)
                self.workers[w].stale = True
                raise WorkerLost(f"a worker was lost while {what} ran on worker {w}: {type(e.cause).__name__}") from None
            raise
        except ActorUnavailableError:
            self.workers[w].stale = True
            raise _Restarting(f"worker {w} died during {what} and is restarting; the call did not complete "
                              "and its sessions are gone") from None
        except _LOST as e:
            # an ActorDiedError may name a worker this call depended on (a migration's source): the next
            # call's resync pings worker w itself, and only that decides whether w is gone for good
            self.workers[w].stale = True
            raise WorkerLost(f"worker {w} was lost during {what}: {type(e).__name__}") from None

    async def _call(self, w: int, method: str, *args, timeout: float | None = None, **kwargs):
        worker = self.workers[w]
        worker.pending += 1
        try:
            await self._check_worker(w)
            incarnation = worker.pid
            try:
                return await self._await_or_restarting(w, getattr(worker.handle, method).remote(*args, **kwargs),
                                                       method, timeout)
            except _Restarting as e:
                if method not in _RERUNNABLE:
                    raise WorkerLost(str(e)) from None
            # the worker died under the call (or before it, idle): hold it until the restart is done
            # (bounded by call_timeout_s), then run it once on the new process
            await self._check_worker(w)
            if worker.pid == incarnation:  # the same process: the call may have run there after all
                raise WorkerLost(f"worker {w} was unavailable during {method}; the call may or may not have run")
            return await self._await(w, getattr(worker.handle, method).remote(*args, **kwargs), method, timeout)
        finally:
            worker.pending -= 1

    async def _check_worker(self, w: int) -> None:
        if self._closed:
            raise WorkerLost("the orchestrator is closed")
        worker = self.workers[w]
        if worker.lost is not None:
            raise WorkerLost(f"worker {w} is gone for good: {worker.lost}")
        if worker.stale:  # one resync per worker at a time; every waiting call shares it
            if worker.resync is None or worker.resync.done():
                worker.resync = asyncio.ensure_future(self._resync(w, self.config.call_timeout_s))
            await asyncio.shield(worker.resync)

    def _mark_lost(self, w: int, why: str) -> None:
        """Worker w will never answer again: calls fail at once, and its capsules leave the router's view."""
        worker = self.workers[w]
        worker.lost, worker.stale, worker.sessions = why, False, 0
        for space in self._spaces.values():
            for name in [n for n, h in space.where.items() if w in h]:
                space.where[name].discard(w)
                if not space.where[name]:
                    del space.where[name]

    async def _resync(self, w: int, timeout: float) -> None:
        """Wait until worker w answers (a restarted actor rebuilds its engine and reloads pinned
        capsules), then rebuild the router's view of its capsules."""
        worker, loop = self.workers[w], asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            left = deadline - loop.time()
            try:
                pong = await asyncio.wait_for(worker.handle.ping.remote(), max(left, 0.05))
                listing = await asyncio.wait_for(worker.handle.list_capsules.remote(), max(deadline - loop.time(), 1.0))
                stats = await asyncio.wait_for(worker.handle.stats.remote(), max(deadline - loop.time(), 1.0))
                break
            except asyncio.TimeoutError:
                raise WorkerLost(f"worker {w} did not come back within {timeout:g}s") from None
            except RayTaskError as e:
                raise WorkerLost(f"worker {w} failed: {e}") from None
            except ActorDiedError as e:
                # a ping of w itself: Ray reports a restarting actor as unavailable, a dead one as died,
                # so w is gone for good (restarts exhausted, or its engine refused to start): do not wait
                why = f"its engine could not start: {e}" if e.actor_init_failed else \
                    "it died and Ray will not restart it (max_restarts reached)"
                self._mark_lost(w, why)
                raise WorkerLost(f"worker {w} is gone for good: {why}") from None
            except _LOST as e:
                if loop.time() >= deadline:
                    raise WorkerLost(f"worker {w} did not come back within {timeout:g}s (last: {type(e).__name__})") from None
                await asyncio.sleep(0.1)
        for space in self._spaces.values():
            for holders in space.where.values():
                holders.discard(w)
        for c in listing:
            self._spaces.setdefault(c["namespace"], _Space()).where.setdefault(c["name"], set()).add(w)
        for space in self._spaces.values():
            for name in [n for n, h in space.where.items() if not h]:
                del space.where[name]
        worker.sessions, worker.stale, worker.pid = stats["sessions"], False, pong["pid"]

    # ------------------------------------------------------------------ namespaces and sessions
    def namespace(self, name: str) -> Namespace:
        """A handle bound to namespace `name` (a tenant, an application): the same verbs as the
        orchestrator, on that namespace's capsules only. The orchestrator's own verbs use "default"."""
        name = validate_name(name, "namespace")
        h = self._handles.get(name)
        if h is None:
            h = self._handles[name] = Namespace(self, name)
        return h

    def _register(self, s: RemoteSession) -> None:
        self.workers[s.worker].sessions += 1
        self._open.add(s)

    def _forget(self, s: RemoteSession) -> None:
        self._open.discard(s)
        self.workers[s.worker].sessions = max(0, self.workers[s.worker].sessions - 1)

    # ------------------------------------------------------------------ stats
    async def _each_worker(self, method: str) -> list[dict]:
        """method on every worker; a worker gone for good answers {"worker": i, "lost": why}."""
        async def one(w: _Worker) -> dict:
            if w.lost is not None:
                return {"worker": w.index, "lost": w.lost}
            return await self._call(w.index, method)
        return list(await asyncio.gather(*(one(w) for w in self.workers)))

    async def update_weights(self, weights, *, rebuild_pinned: bool = False) -> list[int]:
        """New weights on every worker, in place: a checkpoint directory (each worker reads it) or a
        mapping of HF names to tensors (sent once through the object store as safetensors bytes). Returns
        each worker's new weights version. Capsules made before are stale until rebuilt (`rebuild(name)`,
        or rebuild_pinned=True for the pinned ones). A worker Ray restarts afterwards comes back with the
        configured weights: update it again."""
        if isinstance(weights, (str, Path)):
            payload = str(weights)
        elif isinstance(weights, dict):
            from safetensors.torch import save as st_save

            payload = ray.put(st_save({k: v.detach().to("cpu").contiguous() for k, v in weights.items()}))
        else:
            from capsulert.errors import InvalidRequestError

            raise InvalidRequestError(f"update_weights takes a checkpoint path or a dict of tensors, got {type(weights).__name__}")
        alive = [w.index for w in self.workers if w.lost is None]
        return list(await asyncio.gather(*(self._call(w, "update_weights", payload, rebuild_pinned) for w in alive)))

    async def stats(self) -> list[dict]:
        return await self._each_worker("stats")

    async def health(self) -> list[dict]:
        return await self._each_worker("ping")


__all__ = ["GenerateResult", "Namespace", "Orchestrator", "OrchestratorConfig", "RemoteSession"]
