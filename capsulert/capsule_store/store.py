"""CapsuleStore: capsules in three tiers (gpu = device memory, host = pinned memory, disk = files),
with byte budgets, moves between tiers, and a policy that names victims.

Every budget-driven change is planned first (simulated against the budgets, asking the policy for
victims) and only then applied, so a refusal (BudgetExceededError) leaves the store unchanged.
Victims cascade gpu -> host -> disk -> dropped; disabled tiers (budget 0, or disk without disk_dir)
are skipped. Pinned capsules and capsules with a live reader are never moved out by budget pressure.
One RLock guards all bookkeeping. On CUDA, tier moves run on a dedicated copy stream and record an
event; readers make their current stream wait on it, so decode on the default stream is not blocked.
"""
from __future__ import annotations

import importlib
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from capsulert.capsule_store.capsule import CapsuleInfo, CapsuleMeta, CapsuleRef, tensor_nbytes, validate_name
from capsulert.capsule_store.disk import list_capsule_files, read_capsule, write_capsule_with_meta
from capsulert.errors import (BudgetExceededError, CapsuleInUseError, ConfigError, DuplicateCapsuleError,
                              IncompatibleCapsuleError, InvalidRequestError, UnknownCapsuleError)
from capsulert.policies.base import TIERS, CapsulePolicy, make_policy, registered_policies

_RANK = {t: i for i, t in enumerate(TIERS)}  # gpu 0 (fastest) .. disk 2
Key = tuple[str, str]  # (namespace, name)


@dataclass
class _Entry:
    meta: CapsuleMeta
    tier: str
    tensors: dict[str, torch.Tensor] | None  # None while on disk
    path: Path | None  # the file while on disk
    pinned: bool
    last_used: float
    readers: int = 0
    event: Any = None  # CUDA event of the last copy into `tensors`


class _Plan:
    """A simulation of moves: where each touched capsule would be, bytes per tier, ordered actions."""

    def __init__(self, used: dict[str, int]):
        self.where: dict[Key, str | None] = {}
        self.used = dict(used)
        self.actions: list[tuple[Key, str | None]] = []

    def snapshot(self) -> tuple:
        return dict(self.where), dict(self.used), len(self.actions)

    def restore(self, snap: tuple) -> None:
        self.where, self.used, n = dict(snap[0]), dict(snap[1]), snap[2]
        del self.actions[n:]


def _pkey(key: Key) -> str:
    return f"{key[0]}/{key[1]}"  # '/' is refused in names and namespaces, so this is unambiguous


def _resolve_policy(policy: str | CapsulePolicy) -> CapsulePolicy:
    if isinstance(policy, str) and policy not in registered_policies() and policy.isidentifier():
        try:
            importlib.import_module(f"capsulert.policies.{policy}")
        except ImportError:
            pass
    return make_policy(policy)


class CapsuleStore:
    def __init__(self, *, device: torch.device | str, fingerprint: str, layout_version: int,
                 budgets: dict[str, int | None] | None = None, disk_dir: str | Path | None = None,
                 policy: str | CapsulePolicy = "pinned_lru"):
        self.device = torch.device(device)
        self.fingerprint, self.layout_version = fingerprint, layout_version
        self._cuda = self.device.type == "cuda"
        self._pin_host = torch.cuda.is_available()
        self._budgets: dict[str, int | None] = {t: None for t in TIERS}
        for t, b in (budgets or {}).items():
            self._check_budget(t, b)
            self._budgets[t] = b
        self._disk_dir = Path(disk_dir) if disk_dir is not None else None
        if self._disk_dir is not None:
            self._disk_dir.mkdir(parents=True, exist_ok=True)
        self._policy = _resolve_policy(policy)
        self._entries: dict[Key, _Entry] = {}
        self._used = {t: 0 for t in TIERS}
        self._counters = dict(hits=0, misses=0, promotions=0, demotions=0, evictions=0)
        self._lock = threading.RLock()
        self._stream = torch.cuda.Stream(device=self.device) if self._cuda else None

    @property
    def policy(self) -> CapsulePolicy:
        return self._policy

    # -- helpers ---------------------------------------------------------------------------------
    @staticmethod
    def _check_budget(tier: str, nbytes: int | None) -> None:
        if tier not in TIERS:
            raise ConfigError(f"unknown tier {tier!r}; tiers are {TIERS}")
        if nbytes is not None and (not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0):
            raise ConfigError(f"budget for tier {tier!r} must be None (unlimited) or an int >= 0, got {nbytes!r}")

    def _usable(self, tier: str) -> bool:
        return self._budgets[tier] != 0 and (tier != "disk" or self._disk_dir is not None)

    def _require_usable(self, tier: str) -> None:
        if tier not in TIERS:
            raise ConfigError(f"unknown tier {tier!r}; tiers are {TIERS}")
        if not self._usable(tier):
            why = "no disk_dir was given" if tier == "disk" and self._disk_dir is None else "its budget is 0"
            raise ConfigError(f"tier {tier!r} is disabled: {why}")

    def _lookup(self, name: str, namespace: str) -> tuple[Key, _Entry]:
        key = (validate_name(namespace, "namespace"), validate_name(name))
        e = self._entries.get(key)
        if e is None:
            raise UnknownCapsuleError(f"no capsule {name!r} in namespace {namespace!r}")
        return key, e

    # -- planning (no side effects on the store) --------------------------------------------------
    def _make_room(self, plan: _Plan, tier: str, need: int, protect: frozenset) -> None:
        budget = self._budgets[tier]
        if budget is None:
            return
        excess = plan.used[tier] + need - budget
        if excess <= 0:
            return
        if need > budget:
            raise BudgetExceededError(f"a capsule of {need} bytes cannot fit tier {tier!r} (budget {budget})")
        # the policy may name capsules we must skip (pinned, in use, already moved by this plan):
        # each skipped one's bytes are asked for again, until the policy has nothing new to offer
        freed, asked, seen = 0, excess, set()
        while True:
            fresh = [pk for pk in self._policy.choose_victims(tier, asked) if pk not in seen]
            if not fresh:
                break
            for pk in fresh:
                seen.add(pk)
                key = tuple(pk.split("/", 1))
                e = self._entries.get(key)  # type: ignore[arg-type]
                if e is None or key in protect or e.pinned or e.readers or plan.where.get(key, e.tier) != tier:
                    asked += e.meta.nbytes if e is not None else 0
                    continue
                self._plan_victim(plan, key, tier, protect)  # type: ignore[arg-type]
                freed += e.meta.nbytes
                if freed >= excess:
                    return
        raise BudgetExceededError(
            f"tier {tier!r} cannot take {need} bytes: budget {budget}, {plan.used[tier]} in use, and only "
            f"{freed} bytes may be moved out (pinned and in-use capsules stay); unpin capsules or raise the budget")

    def _plan_victim(self, plan: _Plan, key: Key, tier: str, protect: frozenset) -> None:
        n = self._entries[key].meta.nbytes
        for dest in TIERS[_RANK[tier] + 1:]:
            if not self._usable(dest):
                continue
            snap = plan.snapshot()
            try:
                self._make_room(plan, dest, n, protect | {key})
            except BudgetExceededError:
                plan.restore(snap)
                continue
            self._plan_move(plan, key, tier, dest)
            return
        self._plan_move(plan, key, tier, None)  # dropped

    def _plan_move(self, plan: _Plan, key: Key, src: str, dest: str | None) -> None:
        n = self._entries[key].meta.nbytes
        plan.where[key] = dest
        plan.used[src] -= n
        if dest is not None:
            plan.used[dest] += n
        plan.actions.append((key, dest))

    def _plan_to(self, key: Key, dest: str) -> _Plan:
        """Plan moving an existing capsule to `dest`, room made first; raises before any change."""
        e = self._entries[key]
        plan = _Plan(self._used)
        # its old place counts as free, so a victim may swap into it (that tier holds both for a moment)
        plan.where[key], plan.used[e.tier] = dest, plan.used[e.tier] - e.meta.nbytes
        self._make_room(plan, dest, e.meta.nbytes, frozenset({key}))
        plan.used[dest] += e.meta.nbytes
        plan.actions.append((key, dest))
        return plan

    # -- acting -----------------------------------------------------------------------------------
    def _copy(self, tensors: dict[str, torch.Tensor], tier: str, *, wait: Any = None,
              copy_stream: bool = True) -> tuple[dict[str, torch.Tensor], Any]:
        dev = self.device if tier == "gpu" else torch.device("cpu")
        pin = tier == "host" and self._pin_host
        dst = {k: torch.empty(t.shape, dtype=t.dtype, device=dev, pin_memory=pin) for k, t in tensors.items()}
        srcs, dsts = [t.detach() for t in tensors.values()], list(dst.values())
        if not srcs:
            return dst, None
        if not torch.cuda.is_available() or not (self._cuda or any(t.is_cuda for t in srcs)):
            torch._foreach_copy_(dsts, srcs)
            return dst, None
        cur = torch.cuda.current_stream(self.device)
        stream = self._stream if (copy_stream and self._stream is not None) else cur
        if stream is not cur:
            stream.wait_stream(cur)  # sources / fresh allocations are ordered on the current stream
        if wait is not None:
            stream.wait_event(wait)
        with torch.cuda.stream(stream):
            if all(d.device == s.device for d, s in zip(dsts, srcs)):
                torch._foreach_copy_(dsts, srcs, non_blocking=True)  # one fused launch on device
            else:
                for d, s in zip(dsts, srcs):
                    d.copy_(s, non_blocking=True)
        if stream is not cur:
            for t in srcs + dsts:
                if t.is_cuda:
                    t.record_stream(stream)  # the allocator must not reuse them before the copy ends
        ev = torch.cuda.Event()
        ev.record(stream)
        return dst, ev

    def _move(self, key: Key, dest: str | None, preloaded: dict | None = None) -> None:
        e = self._entries[key]
        src, n = e.tier, e.meta.nbytes
        if dest is None:
            if e.path is not None:
                e.path.unlink(missing_ok=True)
            del self._entries[key]
            self._used[src] -= n
            self._counters["evictions"] += 1
            self._policy.on_remove(_pkey(key))
            return
        if dest == "disk":
            if e.event is not None:
                e.event.synchronize()
            e.path, e.meta = write_capsule_with_meta(self._disk_dir, e.meta, e.tensors)  # type: ignore[arg-type]
            e.tensors, e.event = None, None
        else:
            if e.tensors is None:
                data = preloaded if preloaded is not None else self._read(e)
                e.tensors, e.event = self._copy(data, dest)
                e.path.unlink(missing_ok=True)  # type: ignore[union-attr]
                e.path = None
            else:
                e.tensors, e.event = self._copy(e.tensors, dest, wait=e.event)
        e.tier = dest
        self._used[src] -= n
        self._used[dest] += n
        self._counters["promotions" if _RANK[dest] < _RANK[src] else "demotions"] += 1
        self._policy.on_move(_pkey(key), dest)

    def _apply(self, plan: _Plan, preloaded: dict | None = None) -> None:
        for key, dest in plan.actions:
            self._move(key, dest, (preloaded or {}).get(key))

    def _read(self, e: _Entry) -> dict[str, torch.Tensor]:
        return read_capsule(e.path, self.fingerprint, self.layout_version, e.meta.nbytes)[1]  # type: ignore[arg-type]

    def _acquire(self, key: Key, e: _Entry) -> dict[str, torch.Tensor]:
        """Device tensors of a capsule for reading (promoting it to gpu when that tier is usable)."""
        if e.tier == "gpu":
            self._counters["hits"] += 1
        else:
            self._counters["misses"] += 1
            if self._usable("gpu"):
                self._try_promote(key, "gpu")
        pk = _pkey(key)
        self._policy.on_access(pk)
        e.last_used = time.time()
        want = self._policy.should_promote(pk)
        if want in TIERS and _RANK[want] < _RANK[e.tier] and self._usable(want):
            self._try_promote(key, want)
        if e.tier == "gpu":
            tensors = e.tensors
        else:
            # the gpu tier is disabled, or pinned capsules leave it no room: the read is served from a
            # transient device copy (not counted in any budget) and the capsule stays where it is
            src = self._read(e) if e.tensors is None else e.tensors
            tensors, ev = self._copy(src, "gpu", wait=e.event, copy_stream=False)
        ev = e.event if e.tier == "gpu" else ev
        if ev is not None and self._cuda:
            torch.cuda.current_stream(self.device).wait_event(ev)
        return tensors  # type: ignore[return-value]

    def _try_promote(self, key: Key, tier: str) -> bool:
        """Promote if room can be made; a refusal (pins fill the tier) moves nothing and returns False."""
        try:
            self._promote(key, tier)
        except BudgetExceededError:
            return False
        return True

    def _promote(self, key: Key, tier: str) -> None:
        e = self._entries[key]
        preloaded = {key: self._read(e)} if e.tier == "disk" else None  # verify the file before any move
        self._apply(self._plan_to(key, tier), preloaded)

    # -- public API ---------------------------------------------------------------------------------
    def put(self, meta: CapsuleMeta, tensors: dict[str, torch.Tensor], *, tier: str = "gpu",
            pin: bool = False) -> CapsuleRef:
        """Store a copy of `tensors` (never aliases them) as capsule meta.name in `tier`."""
        key = (validate_name(meta.namespace, "namespace"), validate_name(meta.name))
        if meta.fingerprint != self.fingerprint or meta.layout_version != self.layout_version:
            raise IncompatibleCapsuleError(
                f"capsule {meta.name!r} is for model {meta.fingerprint!r} layout {meta.layout_version}; this "
                f"store serves {self.fingerprint!r} layout {self.layout_version}")
        n = tensor_nbytes(tensors)
        if n != meta.nbytes:
            raise ValueError(f"capsule {meta.name!r}: meta.nbytes={meta.nbytes} but the tensors hold {n} bytes")
        with self._lock:
            self._require_usable(tier)
            if key in self._entries:
                raise DuplicateCapsuleError(f"capsule {meta.name!r} already exists in namespace "
                                            f"{meta.namespace!r}; capsules are immutable: delete it first")
            plan = _Plan(self._used)
            self._make_room(plan, tier, n, frozenset({key}))
            self._apply(plan)
            path, data, event = None, None, None
            if tier == "disk":
                path, meta = write_capsule_with_meta(self._disk_dir, meta, tensors)  # type: ignore[arg-type]
            else:  # on the current stream: ordered after the work that wrote the slot buffers
                data, event = self._copy(tensors, tier, copy_stream=False)
            self._entries[key] = _Entry(meta, tier, data, path, bool(pin), time.time(), event=event)
            self._used[tier] += n
            self._policy.on_insert(_pkey(key), tier, n, meta.recompute_cost_s, bool(pin))
            return CapsuleRef(meta.name, meta.namespace, tier, n, meta.boundary)

    def get(self, name: str, namespace: str = "default") -> tuple[CapsuleMeta, dict[str, torch.Tensor]]:
        """The capsule's tensors on `device` (promoted to gpu first). Treat them as read-only."""
        with self._lock:
            key, e = self._lookup(name, namespace)
            tensors = self._acquire(key, e)
            return e.meta, tensors

    @contextmanager
    def reading(self, name: str, namespace: str = "default") -> Iterator[tuple[CapsuleMeta, dict[str, torch.Tensor]]]:
        """Like get, holding a read reference for the block: delete refuses, budget moves skip it."""
        with self._lock:
            key, e = self._lookup(name, namespace)
            tensors = self._acquire(key, e)
            e.readers += 1
        try:
            yield e.meta, tensors
        finally:
            with self._lock:
                e.readers -= 1

    def contains(self, name: str, namespace: str = "default") -> bool:
        with self._lock:
            return (validate_name(namespace, "namespace"), validate_name(name)) in self._entries

    def _info(self, e: _Entry) -> CapsuleInfo:
        return CapsuleInfo(e.meta, e.tier, e.pinned, e.last_used)

    def info(self, name: str, namespace: str = "default") -> CapsuleInfo:
        with self._lock:
            return self._info(self._lookup(name, namespace)[1])

    def list(self, namespace: str | None = None) -> list[CapsuleInfo]:
        with self._lock:
            if namespace is not None:
                validate_name(namespace, "namespace")
            return [self._info(self._entries[k]) for k in sorted(self._entries)
                    if namespace is None or k[0] == namespace]

    def promote(self, name: str, tier: str, namespace: str = "default") -> None:
        with self._lock:
            key, e = self._lookup(name, namespace)
            self._require_usable(tier)
            if _RANK[tier] > _RANK[e.tier]:
                raise InvalidRequestError(f"cannot promote {name!r} from {e.tier!r} to slower tier {tier!r}; use demote")
            if tier != e.tier:
                self._promote(key, tier)

    def prefetch(self, name: str, tier: str = "gpu", namespace: str = "default") -> None:
        """Start promoting toward `tier`; returns once queued (CUDA) or done (CPU). The bookkeeping moves at
        once, so a second prefetch while the copy is in flight finds it there and copies nothing."""
        with self._lock:
            key, e = self._lookup(name, namespace)
            self._require_usable(tier)
            if _RANK[tier] < _RANK[e.tier]:
                self._promote(key, tier)

    def demote(self, name: str, tier: str | None = None, namespace: str = "default") -> None:
        """Move to a slower tier (None: the next usable slower one), making room there per policy."""
        with self._lock:
            key, e = self._lookup(name, namespace)
            if tier is None:
                tier = next((t for t in TIERS[_RANK[e.tier] + 1:] if self._usable(t)), None)
                if tier is None:
                    raise InvalidRequestError(f"capsule {name!r} is in {e.tier!r}; no usable slower tier (delete it instead)")
            self._require_usable(tier)
            if _RANK[tier] < _RANK[e.tier]:
                raise InvalidRequestError(f"cannot demote {name!r} from {e.tier!r} to faster tier {tier!r}; use promote")
            if tier == e.tier:
                return
            if e.readers:
                raise CapsuleInUseError(f"capsule {name!r} is being read; demote it after the restore ends")
            self._apply(self._plan_to(key, tier))

    def pin(self, name: str, namespace: str = "default") -> None:
        """A pinned capsule is never dropped nor moved out by budget pressure (it counts in budgets)."""
        self._set_pin(name, namespace, True)

    def unpin(self, name: str, namespace: str = "default") -> None:
        self._set_pin(name, namespace, False)

    def _set_pin(self, name: str, namespace: str, flag: bool) -> None:
        with self._lock:
            key, e = self._lookup(name, namespace)
            e.pinned = flag
            (self._policy.pin if flag else self._policy.unpin)(_pkey(key))

    def delete(self, name: str, namespace: str = "default") -> None:
        with self._lock:
            key, e = self._lookup(name, namespace)
            if e.readers:
                raise CapsuleInUseError(f"capsule {name!r} is being read by {e.readers} restore(s); retry after")
            if e.path is not None:
                e.path.unlink(missing_ok=True)
            del self._entries[key]
            self._used[e.tier] -= e.meta.nbytes
            self._policy.on_remove(_pkey(key))

    def set_budget(self, tier: str, nbytes: int | None) -> None:
        """Change a tier's budget; shrinking moves capsules out at once (or refuses, changing nothing)."""
        self._check_budget(tier, nbytes)
        with self._lock:
            old, self._budgets[tier] = self._budgets[tier], nbytes
            try:
                plan = _Plan(self._used)
                self._make_room(plan, tier, 0, frozenset())
            except BaseException:
                self._budgets[tier] = old
                raise
            self._apply(plan)

    def stats(self) -> dict:
        with self._lock:
            out: dict = {t: {"bytes": self._used[t], "budget": self._budgets[t],
                             "count": sum(1 for e in self._entries.values() if e.tier == t)} for t in TIERS}
            out.update(self._counters)
            return out

    def save(self, directory: str | Path) -> int:
        """Write every capsule (any tier) as a verified capsule file into `directory`; returns the count."""
        directory = Path(directory)
        with self._lock:
            for e in self._entries.values():
                if e.tensors is None:
                    if e.path is not None and e.path.parent.resolve() == directory.resolve():
                        continue
                    data = self._read(e)
                else:
                    if e.event is not None:
                        e.event.synchronize()
                    data = e.tensors
                _, e.meta = write_capsule_with_meta(directory, e.meta, data)
            return len(self._entries)

    def load(self, directory: str | Path) -> int:
        """Read every capsule file in `directory` into the host tier (gpu if host is disabled). All files
        are verified first; any bad file raises its typed error and nothing is inserted. Partial temp
        files left by an interrupted write are skipped with a logged warning (the index is rebuilt from
        the complete files alone)."""
        files = list_capsule_files(directory, warn_partial=True)
        loaded = [read_capsule(p, self.fingerprint, self.layout_version) for p in files]
        tier = next((t for t in ("host", "gpu") if self._usable(t)), None)
        if tier is None:
            raise ConfigError("load needs the host or the gpu tier; both have budget 0")
        keys = [(m.namespace, m.name) for m, _ in loaded]  # distinct: file names derive from them
        with self._lock:
            for k in keys:
                if k in self._entries:
                    raise DuplicateCapsuleError(f"capsule {k[1]!r} in namespace {k[0]!r} already exists")
            plan, protect = _Plan(self._used), frozenset(keys)
            for m, _ in loaded:
                self._make_room(plan, tier, m.nbytes, protect)
                plan.used[tier] += m.nbytes
            self._apply(plan)
            for (meta, data), key in zip(loaded, keys):
                tensors, event = self._copy(data, tier)
                self._entries[key] = _Entry(meta, tier, tensors, None, False, time.time(), event=event)
                self._used[tier] += meta.nbytes
                self._policy.on_insert(_pkey(key), tier, meta.nbytes, meta.recompute_cost_s, False)
            return len(loaded)
