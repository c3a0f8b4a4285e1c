"""Orchestrator: the async API. Starts (or joins) Ray, spawns one WorkerActor per GPU (or CPU worker),
routes each session to the worker holding its capsule, migrates capsules between workers through host
bytes in the Ray object store (or a disk directory), and turns every failure into a typed error:
engine refusals keep their capsulert class, a dead or silent worker is WorkerLost within the timeout.
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
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayTaskError, WorkerCrashedError

from capsulert.errors import CapsuleRTError, ConfigError, WorkerLost
from capsulert.orchestrator.config import (OrchestratorConfig, int_arg, name_arg, sampling_arg, samplings_arg,
                                           tokens_arg)
from capsulert.orchestrator.router import CapsuleRouter
from capsulert.orchestrator.session import GenerateResult, RemoteSession
from capsulert.orchestrator.worker_actor import WorkerActor

_LOST = (RayActorError, WorkerCrashedError, ObjectLostError, GetTimeoutError)


@dataclass
class _Worker:
    index: int
    handle: Any
    sessions: int = 0
    stale: bool = False
    resync: Any = None  # the task bringing the router's view of this worker up to date


class Orchestrator(CapsuleRouter):
    def __init__(self, config: OrchestratorConfig, workers: list[_Worker], owns_ray: bool):
        self.config, self.workers, self._owns_ray = config, workers, owns_ray
        self._where: dict[str, set[int]] = {}  # capsule name -> workers holding a copy
        self._reserved: set[str] = set()  # names of snapshots in flight
        self._open: weakref.WeakSet[RemoteSession] = weakref.WeakSet()
        self._closed = False

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
        orch = cls(cfg, workers, owns)
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

    async def __aenter__(self) -> "Orchestrator":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ calls
    async def _await(self, w: int, ref, what: str, timeout: float | None):
        t = timeout if timeout is not None else self.config.call_timeout_s
        try:
            return await asyncio.wait_for(ref, t)
        except asyncio.TimeoutError:
            self.workers[w].stale = True
            raise WorkerLost(f"worker {w} did not answer {what} within {t:g}s") from None
        except RayTaskError as e:
            if isinstance(e.cause, CapsuleRTError):
                raise e.cause from None
            raise
        except _LOST as e:
            self.workers[w].stale = True
            raise WorkerLost(f"worker {w} was lost during {what}: {type(e).__name__}") from None

    async def _call(self, w: int, method: str, *args, timeout: float | None = None, **kwargs):
        await self._check_worker(w)
        ref = getattr(self.workers[w].handle, method).remote(*args, **kwargs)
        return await self._await(w, ref, method, timeout)

    async def _check_worker(self, w: int) -> None:
        if self._closed:
            raise WorkerLost("the orchestrator is closed")
        worker = self.workers[w]
        if worker.stale:  # one resync per worker at a time; every waiting call shares it
            if worker.resync is None or worker.resync.done():
                worker.resync = asyncio.ensure_future(self._resync(w, self.config.call_timeout_s))
            await asyncio.shield(worker.resync)

    async def _resync(self, w: int, timeout: float) -> None:
        """Wait until worker w answers (a restarted actor rebuilds its engine and reloads pinned
        capsules), then rebuild the router's view of its capsules."""
        worker, loop = self.workers[w], asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            left = deadline - loop.time()
            try:
                await asyncio.wait_for(worker.handle.ping.remote(), max(left, 0.05))
                listing = await asyncio.wait_for(worker.handle.list_capsules.remote(), max(deadline - loop.time(), 1.0))
                stats = await asyncio.wait_for(worker.handle.stats.remote(), max(deadline - loop.time(), 1.0))
                break
            except asyncio.TimeoutError:
                raise WorkerLost(f"worker {w} did not come back within {timeout:g}s") from None
            except RayTaskError as e:
                raise WorkerLost(f"worker {w} failed: {e}") from None
            except _LOST as e:
                if getattr(e, "actor_init_failed", False):  # the engine refused to start: do not wait
                    raise WorkerLost(f"worker {w} could not start: {e}") from None
                if loop.time() >= deadline:
                    raise WorkerLost(f"worker {w} did not come back within {timeout:g}s") from None
                await asyncio.sleep(0.1)
        for holders in self._where.values():
            holders.discard(w)
        for c in listing:
            self._where.setdefault(c["name"], set()).add(w)
        for name in [n for n, h in self._where.items() if not h]:
            del self._where[name]
        worker.sessions, worker.stale = stats["sessions"], False

    # ------------------------------------------------------------------ sessions
    def _session(self, w: int, res: dict) -> RemoteSession:
        s = RemoteSession(self, w, res["sid"], res["len"])
        self.workers[w].sessions += 1
        self._open.add(s)
        return s

    def _forget(self, s: RemoteSession) -> None:
        self._open.discard(s)
        self.workers[s.worker].sessions = max(0, self.workers[s.worker].sessions - 1)

    # ------------------------------------------------------------------ verbs
    async def open(self, prompt=None, *, worker: int | None = None) -> RemoteSession:
        """A new session (on the least loaded worker), prefilled with `prompt` when given."""
        prompt = None if prompt is None else tokens_arg(prompt, "prompt")
        w = self._least_loaded(range(len(self.workers))) if worker is None else self._worker_arg(worker)
        return self._session(w, await self._call(w, "open", prompt))

    async def restore(self, name: str) -> RemoteSession:
        """A new session holding capsule `name`, on a worker that has it."""
        name = name_arg(name)
        w = self._least_loaded(self._holders(name))
        return self._session(w, await self._call(w, "restore", name))

    async def fork(self, name: str, n: int) -> list[RemoteSession]:
        """n independent sessions from capsule `name` (on one worker, so they can decode batched)."""
        name, n = name_arg(name), int_arg(n, "n", 1)
        w = self._least_loaded(self._holders(name))
        return [self._session(w, r) for r in await self._call(w, "fork", name, n)]

    async def restore_append_generate(self, name: str, suffix, max_new_tokens: int, sampling=None, *,
                                      keep: bool = False, timeout: float | None = None):
        """restore + append + generate in one actor call. Returns the tokens, or (session, tokens) with keep=True."""
        name, n = name_arg(name), int_arg(max_new_tokens, "max_new_tokens", 0)
        suffix = None if suffix is None else tokens_arg(suffix, "suffix")
        sp = sampling_arg(sampling)
        w = self._least_loaded(self._holders(name))
        res = await self._call(w, "restore_append_generate", name, suffix, n, sp, close=not keep, timeout=timeout)
        if not keep:
            return res["tokens"]
        s = self._session(w, res)
        s.stop_reason = res["stop_reason"]
        return s, res["tokens"]

    async def generate(self, sessions: list[RemoteSession], max_new_tokens: int, sampling=None) -> list[list[int]]:
        """Generate for several sessions, one batched decode per worker (workers run concurrently)."""
        n = int_arg(max_new_tokens, "max_new_tokens", 0)
        sessions = list(sessions)
        sps = samplings_arg(sampling, len(sessions))
        if len({id(s) for s in sessions}) != len(sessions):
            from capsulert.errors import InvalidRequestError

            raise InvalidRequestError("a session appears twice in one generate call")
        for s in sessions:
            s._check()
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(sessions):
            groups.setdefault(s.worker, []).append(i)

        async def run(w: int, idx: list[int]):
            locks = sorted((sessions[i] for i in idx), key=lambda s: s.sid)
            for s in locks:
                await s._lock.acquire()
            try:
                res = await self._call(w, "generate_many", [sessions[i].sid for i in idx], n, [sps[i] for i in idx])
            finally:
                for s in locks:
                    s._lock.release()
            for i, r in zip(idx, res):
                sessions[i]._take(r)
            return idx, [r["tokens"] for r in res]

        out: list[list[int]] = [[] for _ in sessions]
        for idx, toks in await asyncio.gather(*(run(w, idx) for w, idx in groups.items())):
            for i, t in zip(idx, toks):
                out[i] = t
        return out

    async def _branch(self, name: str, suffixes: list, max_new_tokens: int, samplings: list,
                      snapshot_names: list[str] | None = None) -> list[dict]:
        """fork len(suffixes) + append + batched generate (+ snapshot each) + close: one actor call."""
        w = self._least_loaded(self._holders(name))
        if snapshot_names:
            for nm in snapshot_names:
                self._check_new_name(name_arg(nm))
        res = await self._call(w, "fork_append_generate", name, suffixes, max_new_tokens, samplings,
                               snapshot_names, True, True)
        for nm in snapshot_names or []:
            self._where.setdefault(nm, set()).add(w)
        return res

    # ------------------------------------------------------------------ stats
    async def stats(self) -> list[dict]:
        return list(await asyncio.gather(*(self._call(w.index, "stats") for w in self.workers)))

    async def health(self) -> list[dict]:
        return list(await asyncio.gather(*(self._call(w.index, "ping") for w in self.workers)))

    async def tokenize(self, text: str) -> list[int]:
        return await self._call(0, "tokenize", tokens_arg(text, "text"))

    async def detokenize(self, tokens: list[int]) -> str:
        return await self._call(0, "detokenize", list(tokens))


__all__ = ["Orchestrator", "OrchestratorConfig", "RemoteSession", "GenerateResult"]
