"""CapsuleMap: the orchestrator's view of which worker holds which capsule, per namespace, and the
per-capsule locks that serialise the verbs changing it. Rebuilt from a worker's own listing whenever that
worker was lost or restarted."""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager


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


class NamespaceMap:
    """One namespace's capsules: name -> the workers holding a copy, and the name locks."""

    def __init__(self) -> None:
        self.where: dict[str, set[int]] = {}
        self.locks = NameLocks()

    def add(self, name: str, worker: int) -> None:
        self.where.setdefault(name, set()).add(worker)

    def discard(self, name: str, worker: int) -> None:
        holders = self.where.get(name)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self.where[name]

    def forget_worker(self, worker: int) -> None:
        for name in list(self.where):
            self.discard(name, worker)


class CapsuleMap:
    """Every namespace's map (shared by every handle on a namespace)."""

    def __init__(self) -> None:
        self._spaces: dict[str, NamespaceMap] = {}

    def space(self, namespace: str) -> NamespaceMap:
        return self._spaces.setdefault(namespace, NamespaceMap())

    def forget_worker(self, worker: int) -> None:
        """Worker `worker` holds nothing (it is gone, or its listing follows)."""
        for space in self._spaces.values():
            space.forget_worker(worker)

    def reload_worker(self, worker: int, listing: list[dict]) -> None:
        """Replace what the map says of `worker` by its own listing (rows with name and namespace)."""
        self.forget_worker(worker)
        for row in listing:
            self.space(row["namespace"]).add(row["name"], worker)

    def held_locks(self) -> int:
        """Name locks held or waited for, over every namespace (0 when nothing is in flight)."""
        return sum(len(s.locks) for s in self._spaces.values())
