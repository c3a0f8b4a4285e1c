"""CapsuleRouter: the Orchestrator's view of which worker holds which capsule.

A session goes to the worker holding its capsule (the least loaded one when several do); a capsule
needed on another worker is copied there byte-exact, as safetensors bytes through the Ray object store
(the bytes go worker to worker, never through the caller) or as a verified capsule file on disk. The
view is rebuilt from the worker's own listing whenever a worker was lost or restarted.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

from capsulert.errors import ConfigError, DuplicateCapsuleError, UnknownCapsuleError
from capsulert.orchestrator.config import name_arg, tier_arg


class CapsuleRouter:
    """Mixin of Orchestrator: needs self.workers, self._where and self._call."""

    # ------------------------------------------------------------------ routing
    def _least_loaded(self, among) -> int:
        return min(among, key=lambda i: (self.workers[i].sessions, i))

    def _holders(self, name: str) -> set[int]:
        holders = self._where.get(name)
        if not holders:
            raise UnknownCapsuleError(f"no capsule {name!r} on any worker")
        return holders

    def _worker_arg(self, worker) -> int:
        if not isinstance(worker, int) or isinstance(worker, bool) or not 0 <= worker < len(self.workers):
            raise ConfigError(f"no worker {worker!r}; there are {len(self.workers)}")
        return worker

    def _check_new_name(self, name: str) -> None:
        if name in self._reserved:
            raise DuplicateCapsuleError(f"capsule {name!r} is being made right now; capsules are immutable")
        if name in self._where:
            raise DuplicateCapsuleError(f"capsule {name!r} already exists (on worker(s) {sorted(self._where[name])}); "
                                        "capsules are immutable: delete it first")

    async def _ensure_on(self, name: str, w: int) -> None:
        if w not in self._holders(name):
            await self.migrate(name, w)

    async def migrate(self, name: str, worker: int, *, via: str = "object_store", directory: str | None = None,
                      tier: str = "gpu") -> None:
        """Copy capsule `name` to `worker`, byte-exact: as safetensors bytes through the Ray object store
        (default), or as a verified capsule file written to and read from `directory` (via="disk")."""
        name, tier = name_arg(name), tier_arg(tier)
        holders = self._holders(name)
        worker = self._worker_arg(worker)
        if worker in holders:
            return
        src = min(holders)
        if via == "object_store":
            payload = self.workers[src].handle.export_capsule.remote(name)  # stays in the object store
            await self._call(worker, "import_capsule", payload, tier)
        elif via == "disk":
            if directory is None:
                raise ConfigError("via='disk' needs a directory both workers can read")
            path = await self._call(src, "export_to_dir", name, directory)
            await self._call(worker, "import_from_file", path, tier)
            Path(path).unlink(missing_ok=True)
        else:
            raise ConfigError(f"via must be 'object_store' or 'disk', got {via!r}")
        self._where[name].add(worker)

    # ------------------------------------------------------------------ capsule verbs
    async def capsules(self) -> list[dict]:
        """Every capsule on every worker: name, tier, pinned, nbytes, boundary, workers."""
        merged: dict[str, dict] = {}
        for rows in await asyncio.gather(*(self._call(w.index, "list_capsules") for w in self.workers)):
            for r in rows:
                m = merged.setdefault(r["name"], {**r, "workers": []})
                m["workers"].append(r.pop("worker"))
        for m in merged.values():
            m.pop("worker", None)
        return [merged[k] for k in sorted(merged)]

    async def promote(self, name: str, tier: str) -> None:
        name, tier = name_arg(name), tier_arg(tier)
        await asyncio.gather(*(self._call(w, "promote", name, tier) for w in sorted(self._holders(name))))

    async def delete(self, name: str) -> None:
        """Delete capsule `name` on every worker holding it (and its persisted file)."""
        name = name_arg(name)
        holders = sorted(self._holders(name))
        await asyncio.gather(*(self._call(w, "delete", name) for w in holders))
        self._where.pop(name, None)

    async def demote(self, name: str, tier: str | None = None) -> None:
        name = name_arg(name)
        tier = None if tier is None else tier_arg(tier)
        await asyncio.gather(*(self._call(w, "demote", name, tier) for w in sorted(self._holders(name))))
