"""TierCore: the machinery under the store's public verbs: budgets, the policy, planning moves.

Every budget-driven change is planned first (simulated against the budgets, asking the policy for
victims) and only then applied (moves.py), so a refusal (BudgetExceededError) leaves the store unchanged.
Victims cascade gpu -> host -> disk -> dropped; disabled tiers (budget 0, or disk without disk_dir)
are skipped. Pinned capsules and capsules with a live reader are never moved out by budget pressure.
A capsule dropped because every slower tier is full is logged and counted (`dropped` in stats()).

Bytes are counted as the tiers hold them: a capsule's own tensors, plus each prefix block once per tier
however many capsules there reference it (block_pool.py). So a victim that shares its blocks frees only
what it holds alone, and the plan asks the policy for more. Anonymous prefix entries (the prefix cache)
are victims before any named capsule, are never demoted (dropped instead) and never displace a named one.

Disk writes of a cascade run on a background DiskWriter (see writer.py): the move is booked at once
and the capsule stays readable from its source bytes until its file is durable. Writes the caller
asked for (put into disk, demote to disk) stay synchronous: they are durable when the verb returns.
One RLock guards all bookkeeping; the writer thread takes it only to rename and to finish a job.
"""
from __future__ import annotations

import importlib
import logging
import threading
from pathlib import Path

import torch

from capsulert.capsule_store.block_pool import BlockPool
from capsulert.capsule_store.blocks import BlockLayout
from capsulert.capsule_store.capsule import validate_name
from capsulert.capsule_store.plan import Entry, Key, Plan
from capsulert.capsule_store.prefix_index import PrefixIndex
from capsulert.errors import BudgetExceededError, ConfigError, UnknownCapsuleError
from capsulert.policies.base import TIERS, CapsulePolicy, make_policy, registered_policies

log = logging.getLogger("capsulert.capsule_store.store")

RANK = {t: i for i, t in enumerate(TIERS)}  # gpu 0 (fastest) .. disk 2
MEMORY_TIERS = ("gpu", "host")


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
                 budgets: dict[str, int | None] | None, disk_dir: Path | None, policy: str | CapsulePolicy,
                 blocks: BlockLayout | None = None, prefix_policy: str | CapsulePolicy = "cost_aware"):
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
        self._anon_policy = _resolve_policy(prefix_policy)  # orders the anonymous prefix entries
        self._layout = blocks
        self._entries: dict[Key, Entry] = {}
        self._pools = {t: BlockPool(t) for t in TIERS}
        self._index = PrefixIndex(blocks)
        self._used = {t: 0 for t in TIERS}
        self._counters = dict(hits=0, misses=0, promotions=0, demotions=0, evictions=0, dropped=0,
                              dropped_bytes=0, disk_write_errors=0)
        self._write_errors: list[str] = []  # since the last flush()
        self._lock = threading.RLock()
        self._stream = torch.cuda.Stream(device=self.device) if self._cuda else None

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

    def _policy_of(self, e: Entry) -> CapsulePolicy:
        return self._anon_policy if e.anonymous else self._policy

    def _new_plan(self) -> Plan:
        return Plan(self._used, lambda tier, key: self._pools[tier].count(key))

    # -- planning (no side effects on the store) --------------------------------------------------
    def _make_room(self, plan: Plan, tier: str, protect: frozenset, *, anon_only: bool = False) -> None:
        """Plan moves until what the plan puts in `tier` fits its budget; BudgetExceededError if it cannot."""
        budget = self._budgets[tier]
        if budget is None or plan.used[tier] <= budget:
            return
        for policy in (self._anon_policy,) if anon_only else (self._anon_policy, self._policy):
            if self._evict(plan, tier, protect, policy):
                return
        raise BudgetExceededError(
            f"tier {tier!r} cannot hold {plan.used[tier]} bytes within its budget of {budget}: pinned and in-use "
            f"capsules stay{' (and prefix entries never displace capsules)' if anon_only else ''}; unpin "
            "capsules or raise the budget")

    def _evict(self, plan: Plan, tier: str, protect: frozenset, policy: CapsulePolicy) -> bool:
        """Plan moving `policy`'s victims out of `tier` until it fits; whether it does."""
        budget = self._budgets[tier]
        # the policy may name capsules we must skip (pinned, in use, already moved by this plan), and a
        # victim that shares blocks frees less than its size: the shortfall is asked for again, until the
        # policy has nothing new to offer
        asked, seen = plan.used[tier] - budget, set()  # type: ignore[operator]
        while True:
            fresh = [pk for pk in policy.choose_victims(tier, asked) if pk not in seen]
            if not fresh:
                return False
            for pk in fresh:
                seen.add(pk)
                key = tuple(pk.split("/", 1))
                e = self._entries.get(key)  # type: ignore[arg-type]
                if e is None or key in protect or e.pinned or e.readers or plan.where.get(key, e.tier) != tier:
                    asked += e.meta.nbytes if e is not None else 0
                    continue
                before = plan.used[tier]
                self._plan_victim(plan, key, tier, protect)  # type: ignore[arg-type]
                asked += e.meta.nbytes - (before - plan.used[tier])
                if plan.used[tier] <= budget:  # type: ignore[operator]
                    return True

    def _plan_victim(self, plan: Plan, key: Key, tier: str, protect: frozenset) -> None:
        e = self._entries[key]
        for dest in () if e.anonymous else TIERS[RANK[tier] + 1:]:
            if not self._usable(dest):
                continue
            snap = plan.snapshot()
            self._book(plan, key, tier, dest)
            try:
                self._make_room(plan, dest, protect | {key})
            except BudgetExceededError:
                plan.restore(snap)
                continue
            plan.actions.append((key, dest))  # after the moves that make room for it
            return
        self._book(plan, key, tier, None)  # dropped
        plan.actions.append((key, None))

    def _book(self, plan: Plan, key: Key, src: str, dest: str | None) -> None:
        e = self._entries[key]
        plan.where[key] = dest
        plan.leave(src, e.own_nbytes, e.blocks)
        if dest is not None:
            plan.enter(dest, e.own_nbytes, e.blocks)

    def _plan_to(self, key: Key, dest: str) -> Plan:
        """Plan moving an existing capsule to `dest`, room made first; raises before any change."""
        e = self._entries[key]
        plan = self._new_plan()
        # its old place counts as free, so a victim may swap into it (that tier holds both for a moment)
        self._book(plan, key, e.tier, dest)
        self._make_room(plan, dest, frozenset({key}))
        plan.actions.append((key, dest))
        return plan
