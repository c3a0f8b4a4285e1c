"""Orchestrator: the async API. Starts (or joins) Ray, spawns one WorkerActor per GPU (or CPU worker),
routes each session to the worker holding its capsule, migrates capsules between workers (device to
device over a pair link between CUDA workers, else as bytes in the Ray object store, or through a disk
directory; router.py), and turns every failure into a typed error:
engine refusals keep their capsulert class, a dead or silent worker is WorkerLost within the timeout
(worker_pool.py).

Capsules live in namespaces: `orch.namespace("acme")` is a handle with the session and capsule verbs, bound
to the capsules of "acme" (see namespace.py); the Orchestrator passes the same verbs to its handle of
namespace "default" (`orch.open(...)` is `orch.namespace("default").open(...)`).

Worker logs reach the driver: each worker sends its `capsulert` logger to its stderr (worker/actor.py) at
the driver's level (or `worker_log_level`), and a Ray this starts forwards workers' output to the driver's
stderr (log_to_driver). A Ray the caller started forwards it when the caller's ray.init did.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, AsyncIterator

import ray
from pydantic import ValidationError

from capsulert.capsule_store import validate_name
from capsulert.capsule_store.owner import DirLock
from capsulert.errors import ConfigError, InsufficientResourcesError, InvalidRequestError
from capsulert.logs import level_name
from capsulert.orchestrator.admission import SessionGate
from capsulert.orchestrator.capsule_map import CapsuleMap
from capsulert.orchestrator.namespace import Namespace
from capsulert.orchestrator.router import CapsuleRouter
from capsulert.config.orchestrator import FAST_FAILURE_RAY_CONFIG, OrchestratorConfig, local_gpus
from capsulert.sessions.session import AsyncSession
from capsulert.worker.actor import WorkerActor
from capsulert.orchestrator.worker_pool import WorkerPool, WorkerRecord
from capsulert.orchestrator.weight_updates import broadcast_update
from capsulert.protocol.names import DEFAULT_NAMESPACE
from capsulert.protocol.results import FinalEvent, GenerateResult, TokenEvent
from capsulert.protocol.requests import Ping, Request, Stats


class Orchestrator:
    """The operator's object: lifecycle, workers, stats, and namespace handles. It answers the session and
    capsule verbs of namespace "default" through that namespace's handle (orch.open / restore / capsules /
    ... act on "default" capsules only)."""

    def __init__(self, config: OrchestratorConfig, pool: WorkerPool, capsule_map: CapsuleMap, owns_ray: bool,
                 dir_lock: DirLock | None = None):
        self.config, self.pool, self.capsule_map, self._owns_ray = config, pool, capsule_map, owns_ray
        self._dir_lock = dir_lock  # engine.disk_dir is ours while we live: a second orchestrator is refused
        self.default = Namespace(pool, capsule_map, DEFAULT_NAMESPACE)
        self._handles: dict[str, Namespace] = {DEFAULT_NAMESPACE: self.default}
        self._closed = False

    @property
    def ns(self) -> str:
        """The namespace the orchestrator's own verbs serve."""
        return self.default.ns

    # ------------------------------------------------------------------ namespace "default"'s verbs
    # passed to its handle as they are (Namespace documents each)
    @property
    def router(self) -> CapsuleRouter:
        return self.default.router

    @property
    def space(self):
        return self.default.space

    def admitted(self, sessions: int, *, together: int = 1):
        return self.default.admitted(sessions, together=together)

    async def open(self, prompt=None, *, worker: int | None = None) -> AsyncSession:
        return await self.default.open(prompt, worker=worker)

    async def restore(self, name: str) -> AsyncSession:
        return await self.default.restore(name)

    async def fork(self, name: str, n: int) -> list[AsyncSession]:
        return await self.default.fork(name, n)

    async def fork_spread(self, name: str, n: int) -> list[AsyncSession]:
        return await self.default.fork_spread(name, n)

    async def restore_append_generate(self, name: str, suffix, max_new_tokens: int, sampling=None, *,
                                      timeout: float | None = None) -> GenerateResult:
        return await self.default.restore_append_generate(name, suffix, max_new_tokens, sampling, timeout=timeout)

    async def restore_branch(self, name: str, suffix, max_new_tokens: int, sampling=None, *,
                             timeout: float | None = None) -> tuple[AsyncSession, GenerateResult]:
        return await self.default.restore_branch(name, suffix, max_new_tokens, sampling, timeout=timeout)

    def restore_append_stream(self, name: str, suffix, max_new_tokens: int, sampling=None
                              ) -> AsyncIterator[TokenEvent | FinalEvent]:
        return self.default.restore_append_stream(name, suffix, max_new_tokens, sampling)

    async def append_generate(self, prompt, max_new_tokens: int, sampling=None, *,
                              timeout: float | None = None) -> GenerateResult:
        return await self.default.append_generate(prompt, max_new_tokens, sampling, timeout=timeout)

    def append_stream(self, prompt, max_new_tokens: int, sampling=None) -> AsyncIterator[TokenEvent | FinalEvent]:
        return self.default.append_stream(prompt, max_new_tokens, sampling)

    async def generate(self, sessions: list[AsyncSession], max_new_tokens: int, sampling=None) -> list:
        return await self.default.generate(sessions, max_new_tokens, sampling)

    async def tokenize(self, text: str) -> list[int]:
        return await self.default.tokenize(text)

    async def detokenize(self, tokens: list[int]) -> str:
        return await self.default.detokenize(tokens)

    def holders(self, name: str) -> set[int]:
        return self.default.holders(name)

    def placement(self) -> dict[str, set[int]]:
        return self.default.placement()

    async def migrate(self, name: str, worker: int, *, via: str = "auto", directory: str | None = None,
                      tier: str = "device") -> str | None:
        return await self.default.migrate(name, worker, via=via, directory=directory, tier=tier)

    async def capsules(self) -> list[dict]:
        return await self.default.capsules()

    async def promote(self, name: str, tier: str) -> None:
        await self.default.promote(name, tier)

    async def demote(self, name: str, tier: str | None = None) -> None:
        await self.default.demote(name, tier)

    async def rebuild(self, name: str) -> None:
        await self.default.rebuild(name)

    async def delete(self, name: str) -> None:
        await self.default.delete(name)

    @property
    def workers(self) -> list[WorkerRecord]:
        """What the orchestrator knows of each worker (index, actor handle, load, process, liveness)."""
        return self.pool.workers

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
            kw = dict(include_dashboard=False, log_to_driver=True)
            if cfg.address:
                ray.init(address=cfg.address, **kw)
            else:
                _check_local_gpus(cfg)  # a Ray started here has this machine's GPUs: refuse before starting it
                ray.init(num_cpus=cfg.local_num_cpus, _system_config=FAST_FAILURE_RAY_CONFIG, **kw)
            owns = True
        try:
            use_gpu = _workers_take_gpus(cfg)
            await _check_free_resources(cfg, use_gpu)  # Ray would wait for them silently, for good
        except ConfigError:
            if owns:
                ray.shutdown()
            raise
        log_level = cfg.worker_log_level or level_name()
        handles = []
        for i in range(cfg.num_workers):
            ecfg, persist = cfg.engine.model_dump(), None
            if cfg.engine.disk_dir:
                ecfg["disk_dir"] = str(Path(cfg.engine.disk_dir) / f"worker-{i}")
                persist = str(Path(ecfg["disk_dir"]) / "pinned") if cfg.persist_pinned else None
            opts: dict = dict(max_restarts=cfg.max_restarts, max_task_retries=0, num_gpus=1 if use_gpu else 0)
            if cfg.worker_num_cpus is not None:
                opts["num_cpus"] = cfg.worker_num_cpus
            handles.append(WorkerActor.options(**opts).remote(ecfg, persist, cfg.torch_threads, i, log_level))
        capsule_map = CapsuleMap()
        pool = WorkerPool(handles, capsule_map, cfg.call_timeout_s, cfg.replicate_hot)
        pool.gate = SessionGate(cfg.engine.slots, lambda: len(pool.alive()), cfg.max_queued)
        orch = cls(cfg, pool, capsule_map, owns, dir_lock)
        try:
            await asyncio.gather(*(pool.resync(i, cfg.start_timeout_s) for i in range(len(handles))))
        except BaseException:
            await orch.close()
            raise
        for i in range(len(handles)):
            pool.watch(i)  # a worker's death is seen at once, even while nobody calls it
        return orch

    async def close(self) -> None:
        """Kill the workers (sessions and unpersisted capsules go with them); shut Ray down if we started it."""
        if self._closed:
            return
        self._closed = True
        self.pool.close()
        if self._owns_ray:
            ray.shutdown()
        if self._dir_lock is not None:
            self._dir_lock.release()

    async def __aenter__(self) -> "Orchestrator":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ namespaces and sessions
    def namespace(self, name: str) -> Namespace:
        """A handle bound to namespace `name` (a tenant, an application): the same verbs as the
        orchestrator, on that namespace's capsules only. The orchestrator's own verbs use "default"."""
        name = validate_name(name, "namespace")
        h = self._handles.get(name)
        if h is None:
            h = self._handles[name] = Namespace(self.pool, self.capsule_map, name)
        return h

    def sessions(self) -> list[AsyncSession]:
        """The sessions open now, of every namespace."""
        return list(self.pool.sessions)

    async def call(self, worker: int, request: Request, *, timeout: float | None = None) -> Any:
        """Send one typed request (capsulert.protocol.requests) to worker `worker` and await its reply: the
        operator's tool for what the handles do not cover (probes, exports, benchmarks). It bypasses the
        router: a request that makes or deletes a capsule leaves the router's view behind."""
        return await self.pool.call(self.pool.worker_arg(worker), request, timeout=timeout)

    # ------------------------------------------------------------------ weights and stats
    async def update_weights(self, weights, *, rebuild_pinned: bool = False) -> list[int]:
        """New weights on every worker, in place: a checkpoint directory (each worker reads it) or a
        mapping of HF names to tensors (sent once through the object store as safetensors bytes). Returns
        each worker's new weights version. Capsules made before are stale until rebuilt (`rebuild(name)`,
        or rebuild_pinned=True for the pinned ones). A worker Ray restarts afterwards is given the last
        update again, at the same version, before it serves a call (the orchestrator keeps the checkpoint
        path or the tensors' bytes in the object store for that)."""
        if isinstance(weights, (str, Path)):
            payload = str(weights)
        elif isinstance(weights, dict):
            from safetensors.torch import save as st_save

            payload = ray.put(st_save({k: v.detach().to("cpu").contiguous() for k, v in weights.items()}))
        else:
            raise InvalidRequestError("update_weights takes a checkpoint path or a dict of tensors, "
                                      f"got {type(weights).__name__}")
        return await broadcast_update(self.pool, payload, rebuild_pinned)

    def retry_after_s(self) -> float:
        """When a request refused for a full admission queue is likely to find room (seconds, an estimate
        from the recent holding times; what an HTTP 429's Retry-After says)."""
        return self.pool.gate.retry_after_s()

    async def stats(self, steps_since: float | None = None) -> list[dict]:
        """Each worker's figures (the Stats request); with `steps_since`, a time.monotonic() value of this
        host, also the step records of each worker's loop since then, under "recent_steps"."""
        return await self.pool.each(Stats(steps_since=steps_since))

    async def health(self) -> list[dict]:
        """Each worker's Ping (process, device, weights version, capsules reloaded and re-indexed at its
        start, files it set aside, `started_s`: its start's duration), with `last_restart_s`: how long its
        last restart took, from its death seen to its new process answering (None: never restarted)."""
        out = await self.pool.each(Ping())
        for h, w in zip(out, self.pool.workers):
            h["last_restart_s"] = w.last_restart_s
            h.pop("lifeline_token", None)  # the lifeline's secret stays between the pool and the process
        return out


def _workers_take_gpus(cfg: OrchestratorConfig) -> bool:
    """Whether each worker asks Ray for one GPU: decided by the cluster's resources, not by what this
    process sees (a CPU-only head node may drive GPU workers). device="cuda" insists on GPUs, "auto" takes
    them when the cluster has any, "cpu" never does."""
    gpus = ray.cluster_resources().get("GPU", 0)
    if cfg.engine.device == "cpu" or (cfg.engine.device == "auto" and gpus < 1):
        return False
    if gpus < cfg.num_workers:
        raise InsufficientResourcesError(
            f"each of the {cfg.num_workers} worker(s) takes a GPU of its own (device={cfg.engine.device!r}): "
            f"{cfg.num_workers} GPU(s) asked for, and the Ray cluster has {gpus:g}: add GPUs, start fewer "
            f"workers, or use device='cpu'")
    return True


def _check_local_gpus(cfg: OrchestratorConfig) -> None:
    """device="cuda" with a local Ray to start: InsufficientResourcesError before Ray starts when this machine
    has fewer GPUs than workers (_workers_take_gpus would refuse the same, after seconds of Ray's start)."""
    if cfg.engine.device != "cuda":
        return
    gpus = local_gpus()
    if gpus < cfg.num_workers:
        raise InsufficientResourcesError(
            f"each of the {cfg.num_workers} worker(s) takes a GPU of its own (device={cfg.engine.device!r}): "
            f"{cfg.num_workers} GPU(s) asked for, and this machine (whose GPUs a local Ray has) has {gpus:g}: "
            f"add GPUs, start fewer workers, or use device='cpu'")


# resources another orchestrator just released take a moment to show as free: wait this long for them when
# the cluster has enough in all, and refuse at once when it has not
RESOURCE_GRACE_S = 5.0


async def _check_free_resources(cfg: OrchestratorConfig, use_gpu: bool) -> None:
    """InsufficientResourcesError unless the cluster has the GPUs (one per worker) and the CPUs
    (`worker_num_cpus` each) the workers ask for free now: Ray would keep a worker it cannot place pending,
    and the start would wait silently (a second orchestrator on a one-GPU host whose GPU a server holds)."""
    need = {"GPU": float(cfg.num_workers if use_gpu else 0),
            "CPU": float(cfg.num_workers * (cfg.worker_num_cpus or 0))}
    need = {k: v for k, v in need.items() if v > 0}
    if not need:
        return
    total = ray.cluster_resources()
    deadline = asyncio.get_running_loop().time() + RESOURCE_GRACE_S
    while True:
        free = ray.available_resources()
        short = [k for k, v in need.items() if free.get(k, 0) < v]
        if not short:
            return
        if any(total.get(k, 0) < need[k] for k in short) or asyncio.get_running_loop().time() >= deadline:
            break
        await asyncio.sleep(0.2)
    what = "; ".join(f"{need[k]:g} {k}(s) asked for ({cfg.num_workers} worker(s)), the cluster has "
                     f"{total.get(k, 0):g}, {free.get(k, 0):g} free" for k in short)
    raise InsufficientResourcesError(
        f"the Ray cluster cannot place the workers now: {what} (the others are held by other actors, e.g. a "
        f"running server's workers); free them, start fewer workers, or use device='cpu'")


__all__ = ["GenerateResult", "Namespace", "Orchestrator", "OrchestratorConfig", "AsyncSession"]
