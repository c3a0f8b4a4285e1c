"""TierCore: the machinery under the store's public verbs: budgets, the policy, planning moves, making them.

Every budget-driven change is planned first (simulated against the budgets, asking the policy for
victims) and only then applied, so a refusal (BudgetExceededError) leaves the store unchanged.
Victims cascade gpu -> host -> disk -> dropped; disabled tiers (budget 0, or disk without disk_dir)
are skipped. Pinned capsules and capsules with a live reader are never moved out by budget pressure.
A capsule dropped because every slower tier is full is logged and counted (`dropped` in stats()).

Disk writes of a cascade run on a background DiskWriter (see writer.py): the move is booked at once
and the capsule stays readable from its source bytes until its file is durable. Writes the caller
asked for (put into disk, demote to disk) stay synchronous: they are durable when the verb returns.
One RLock guards all bookkeeping; the writer thread takes it only to rename and to finish a job.
"""
from __future__ import annotations

import importlib
import logging
import threading
import time
from pathlib import Path

import torch

from capsulert.capsule_store.disk import StagedWrite, fsync_dir, read_capsule, stage_capsule
from capsulert.capsule_store.plan import Entry, Key, Plan
from capsulert.capsule_store.capsule import validate_name
from capsulert.capsule_store.transfer import copy_tensors
from capsulert.capsule_store.writer import DiskJob, DiskWriter, WriterHooks
from capsulert.errors import BudgetExceededError, CapsuleIOError, ConfigError, UnknownCapsuleError
from capsulert.policies.base import TIERS, CapsulePolicy, make_policy, registered_policies

log = logging.getLogger("capsulert.capsule_store.store")

RANK = {t: i for i, t in enumerate(TIERS)}  # gpu 0 (fastest) .. disk 2


def pkey(key: Key) -> str:
    return f"{key[0]}/{key[1]}"  # '/' is refused in names and namespaces, so this is unambiguous


def _resolve_policy(policy: str | CapsulePolicy) -> CapsulePolicy:
    if isinstance(policy, str) and policy not in registered_policies() and policy.isidentifier():
        try:
            importlib.import_module(f"capsulert.policies.{policy}")
        except ImportError:
            pass
    return make_policy(policy)


# "device" names the engine device's own memory (GPU memory on CUDA, CPU memory on a CPU engine); "gpu",
# its older name, is how the store keys it internally
TIER_ALIASES = {"device": "gpu"}


def tier_name(tier: str) -> str:
    return TIER_ALIASES.get(tier, tier) if isinstance(tier, str) else tier


def check_budget(tier: str, nbytes: int | None) -> None:
    if tier not in TIERS:
        raise ConfigError(f"unknown tier {tier!r}; tiers are {TIERS}")
    if nbytes is not None and (not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0):
        raise ConfigError(f"budget for tier {tier!r} must be None (unlimited) or an int >= 0, got {nbytes!r}")


class TierCore:
    def __init__(self, *, device: torch.device | str, fingerprint: str, layout_version: int,
                 budgets: dict[str, int | None] | None, disk_dir: Path | None, policy: str | CapsulePolicy):
        self.device = torch.device(device)
        self.fingerprint, self.layout_version = fingerprint, layout_version
        self._cuda = self.device.type == "cuda"
        self._pin_host = torch.cuda.is_available()
        self._budgets: dict[str, int | None] = {t: None for t in TIERS}
        for t, b in (budgets or {}).items():
            check_budget(t, b)
            self._budgets[t] = b
        self._disk_dir = disk_dir
        self._policy = _resolve_policy(policy)
        self._entries: dict[Key, Entry] = {}
        self._used = {t: 0 for t in TIERS}
        self._counters = dict(hits=0, misses=0, promotions=0, demotions=0, evictions=0, dropped=0,
                              dropped_bytes=0, disk_write_errors=0)
        self._write_errors: list[str] = []  # since the last flush()
        self._lock = threading.RLock()
        self._stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        self._writer = DiskWriter(WriterHooks(self._job_wanted, self._job_staged, self._job_durable, self._job_failed))

    # -- helpers ---------------------------------------------------------------------------------
    def _usable(self, tier: str) -> bool:
        return self._budgets[tier] != 0 and (tier != "disk" or self._disk_dir is not None)

    def _require_usable(self, tier: str) -> None:
        if tier not in TIERS:
            raise ConfigError(f"unknown tier {tier!r}; tiers are {TIERS}")
        if not self._usable(tier):
            why = "no disk_dir was given" if tier == "disk" and self._disk_dir is None else "its budget is 0"
            raise ConfigError(f"tier {tier!r} is disabled: {why}")

    def _lookup(self, name: str, namespace: str) -> tuple[Key, Entry]:
        key = (validate_name(namespace, "namespace"), validate_name(name))
        e = self._entries.get(key)
        if e is None:
            raise UnknownCapsuleError(f"no capsule {name!r} in namespace {namespace!r}")
        return key, e

    # -- planning (no side effects on the store) --------------------------------------------------
    def _make_room(self, plan: Plan, tier: str, need: int, protect: frozenset) -> None:
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

    def _plan_victim(self, plan: Plan, key: Key, tier: str, protect: frozenset) -> None:
        n = self._entries[key].meta.nbytes
        for dest in TIERS[RANK[tier] + 1:]:
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

    def _plan_move(self, plan: Plan, key: Key, src: str, dest: str | None) -> None:
        n = self._entries[key].meta.nbytes
        plan.where[key] = dest
        plan.used[src] -= n
        if dest is not None:
            plan.used[dest] += n
        plan.actions.append((key, dest))

    def _plan_to(self, key: Key, dest: str) -> Plan:
        """Plan moving an existing capsule to `dest`, room made first; raises before any change."""
        e = self._entries[key]
        plan = Plan(self._used)
        # its old place counts as free, so a victim may swap into it (that tier holds both for a moment)
        plan.where[key], plan.used[e.tier] = dest, plan.used[e.tier] - e.meta.nbytes
        self._make_room(plan, dest, e.meta.nbytes, frozenset({key}))
        plan.used[dest] += e.meta.nbytes
        plan.actions.append((key, dest))
        return plan

    # -- acting -----------------------------------------------------------------------------------
    def _copy(self, tensors: dict[str, torch.Tensor], tier: str, *, wait=None, copy_stream: bool = True):
        dev = self.device if tier == "gpu" else torch.device("cpu")
        return copy_tensors(tensors, dev, pin=tier == "host" and self._pin_host, wait=wait,
                            stream=self._stream if copy_stream else None)

    def _stage(self, e: Entry) -> StagedWrite:
        """The capsule's file, written and fsynced under its temp name (nothing renamed yet)."""
        if e.tensors is None:
            raise AssertionError("only a capsule held in memory is staged")
        if e.event is not None:
            e.event.synchronize()
        return stage_capsule(self._disk_dir, e.meta, e.tensors)  # type: ignore[arg-type]

    def _settle_on_disk(self, e: Entry, staged: StagedWrite) -> None:
        """Rename a staged file into place: from now on the file alone holds the capsule."""
        staged.commit()
        fsync_dir(staged.final.parent)
        e.path, e.meta, e.tensors, e.event, e.pending = staged.final, staged.meta, None, None, None

    def _forget_file(self, e: Entry) -> None:
        """The capsule leaves the disk tier: cancel its pending write, unlink its file."""
        e.pending = None
        if e.path is not None:
            e.path.unlink(missing_ok=True)
            e.path = None

    def _drop(self, key: Key, e: Entry) -> None:
        self._forget_file(e)
        del self._entries[key]
        self._used[e.tier] -= e.meta.nbytes
        self._counters["evictions"] += 1
        self._counters["dropped"] += 1
        self._counters["dropped_bytes"] += e.meta.nbytes
        self._policy.on_remove(pkey(key))
        log.warning("dropped capsule %s/%s (%d bytes, unpinned) from tier %r: every slower tier is full or "
                    "disabled; raise a budget, or pin the capsules that must stay", key[0], key[1],
                    e.meta.nbytes, e.tier)

    def _move(self, key: Key, dest: str | None, preloaded: dict | None = None,
              staged: StagedWrite | None = None) -> None:
        e = self._entries[key]
        src, n = e.tier, e.meta.nbytes
        if dest is None:
            self._drop(key, e)
            return
        if dest == "disk":
            if staged is not None:  # a write the caller asked for: durable before the verb returns
                self._settle_on_disk(e, staged)
            else:  # a cascade: written in the background, readable from its bytes until durable
                e.pending = DiskJob(key, e.meta, e.tensors, e.event, self._disk_dir)  # type: ignore[arg-type]
                self._writer.submit(e.pending)
        else:
            if e.tensors is None:
                data = preloaded if preloaded is not None else self._read(e)
                e.tensors, e.event = self._copy(data, dest)
            else:
                e.tensors, e.event = self._copy(e.tensors, dest, wait=e.event)
            self._forget_file(e)
        e.tier = dest
        self._used[src] -= n
        self._used[dest] += n
        self._counters["promotions" if RANK[dest] < RANK[src] else "demotions"] += 1
        self._policy.on_move(pkey(key), dest)

    def _apply(self, plan: Plan, preloaded: dict | None = None, staged: dict | None = None) -> None:
        for key, dest in plan.actions:
            self._move(key, dest, (preloaded or {}).get(key), (staged or {}).get(key) if dest == "disk" else None)

    def _read(self, e: Entry) -> dict[str, torch.Tensor]:
        return read_capsule(e.path, self.fingerprint, self.layout_version, e.meta.nbytes)[1]  # type: ignore[arg-type]

    def _acquire(self, key: Key, e: Entry) -> dict[str, torch.Tensor]:
        """Device tensors of a capsule for reading (promoting it to gpu when that tier is usable)."""
        if e.tier == "gpu":
            self._counters["hits"] += 1
        else:
            self._counters["misses"] += 1
            if self._usable("gpu"):
                self._try_promote(key, "gpu")
        pk = pkey(key)
        self._policy.on_access(pk)
        e.last_used = time.time()
        want = self._policy.should_promote(pk)
        if want in TIERS and RANK[want] < RANK[e.tier] and self._usable(want):
            self._try_promote(key, want)
        if e.tier == "gpu":
            tensors, ev = e.tensors, e.event
        else:
            # the gpu tier is disabled, or pinned capsules leave it no room: the read is served from a
            # transient device copy (not counted in any budget) and the capsule stays where it is
            src = self._read(e) if e.tensors is None else e.tensors
            tensors, ev = self._copy(src, "gpu", wait=e.event, copy_stream=False)
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
        preloaded = {key: self._read(e)} if e.tensors is None else None  # verify the file before any move
        self._apply(self._plan_to(key, tier), preloaded)

    # -- the background writer's side (see writer.py) ----------------------------------------------
    def _current(self, job: DiskJob) -> Entry | None:
        e = self._entries.get(job.key)
        return e if e is not None and e.pending is job else None

    def _job_wanted(self, job: DiskJob) -> bool:
        with self._lock:
            return self._current(job) is not None

    def _job_staged(self, job: DiskJob, staged: StagedWrite) -> bool:
        # renamed under the lock: a capsule deleted, moved or replaced meanwhile never gets this file
        with self._lock:
            e = self._current(job)
            if e is None:
                staged.discard()
                return False
            try:
                staged.commit()
            except CapsuleIOError as err:
                self._write_failed(e, err)
                return False
            e.path, e.meta = staged.final, staged.meta  # its bytes still serve reads until durable
            return True

    def _job_durable(self, job: DiskJob, staged: StagedWrite) -> None:
        with self._lock:
            e = self._current(job)
            if e is not None:
                e.tensors, e.event, e.pending = None, None, None

    def _job_failed(self, job: DiskJob, err: BaseException) -> None:
        with self._lock:
            e = self._current(job)
            if e is not None:
                self._write_failed(e, err)

    def _write_failed(self, e: Entry, err: BaseException) -> None:
        # the capsule stays readable from its bytes in memory; flush() reports the failure, and an
        # explicit demote to disk (or the next move) writes it again
        e.pending = None
        self._counters["disk_write_errors"] += 1
        self._write_errors.append(f"{e.meta.namespace}/{e.meta.name}: {err}")
        log.error("background write of capsule %s/%s to disk failed (%s); it stays readable from memory",
                  e.meta.namespace, e.meta.name, err)
