"""TierBook: the store's bookkeeping and planning: its entries, the bytes each tier holds (own tensors and
pooled blocks), the budgets, the policies, the prefix index, the counters; and planning moves against them.
It moves no byte (moves.py acts on what it plans).

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
One RLock (the store's, held by the caller of every method here) guards all of it; the writer thread
takes it only to rename and to finish a job.
"""
from __future__ import annotations

import importlib
import logging
import warnings
from pathlib import Path

from capsulert.capsule_store.block_pool import BlockPool, BlockRecord
from capsulert.capsule_store.blocks import BlockLayout, ChainKeys
from capsulert.protocol.names import validate_name
from capsulert.capsule_store.plan import DROP_DISK_COPY, Entry, Key, Plan
from capsulert.capsule_store.prefix_index import PrefixIndex
from capsulert.errors import (BudgetExceededError, CapsuleError, ConfigError, DuplicateCapsuleError,
                              TierInUseError, UnknownCapsuleError)
from capsulert.policies.base import TIERS, CapsulePolicy, make_policy, registered_policies

log = logging.getLogger("capsulert.capsule_store.store")

RANK = {t: i for i, t in enumerate(TIERS)}  # gpu 0 (fastest) .. disk 2
MEMORY_TIERS = ("device", "host")


def pkey(key: Key) -> str:
    return f"{key[0]}/{key[1]}"  # '/' is refused in names and namespaces, so this is unambiguous


def _resolve_policy(policy: str | CapsulePolicy) -> CapsulePolicy:
    if isinstance(policy, str) and policy not in registered_policies() and policy.isidentifier():
        try:
            importlib.import_module(f"capsulert.policies.{policy}")
        except ImportError:
            pass
    return make_policy(policy)


# "device" names the engine device's own memory (GPU memory on CUDA, CPU memory on a CPU engine); "gpu" is
# its older name, still taken (with a DeprecationWarning) where a caller names a tier
TIER_ALIASES = {"gpu": "device"}


def tier_name(tier: str) -> str:
    """The tier a caller's name means: "gpu" is taken for "device", with a DeprecationWarning."""
    if isinstance(tier, str) and tier in TIER_ALIASES:
        warnings.warn(f"tier {tier!r} is the older name of {TIER_ALIASES[tier]!r}; say {TIER_ALIASES[tier]!r}",
                      DeprecationWarning, stacklevel=3)
        return TIER_ALIASES[tier]
    return tier


def check_budget(tier: str, nbytes: int | None) -> None:
    if tier not in TIERS:
        raise ConfigError(f"unknown tier {tier!r}; tiers are {TIERS}")
    if nbytes is not None and (not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0):
        raise ConfigError(f"budget for tier {tier!r} must be None (unlimited) or an int >= 0, got {nbytes!r}")


class TierBook:
    def __init__(self, *, budgets: dict[str, int | None] | None, disk_dir: Path | None,
                 policy: str | CapsulePolicy, blocks: BlockLayout | None = None,
                 prefix_policy: str | CapsulePolicy = "cost_aware"):
        self.budgets: dict[str, int | None] = {t: None for t in TIERS}
        for t, b in (budgets or {}).items():
            t = tier_name(t)
            check_budget(t, b)
            self.budgets[t] = b
        self.disk_dir = disk_dir
        self.policy = _resolve_policy(policy)
        self.anon_policy = _resolve_policy(prefix_policy)  # orders the anonymous prefix entries
        self.layout = blocks
        self.entries: dict[Key, Entry] = {}
        self.pools = {t: BlockPool(t) for t in TIERS}
        self.index = PrefixIndex(blocks)
        self.chains = ChainKeys()  # the block keys of recent token sequences (puts and prefix lookups)
        self.used = {t: 0 for t in TIERS}
        self.counters = dict(hits=0, misses=0, promotions=0, demotions=0, evictions=0, dropped=0,
                             dropped_bytes=0, disk_write_errors=0)
        self.prefix_counters = dict(kept=0, evicted=0, lookups=0, hits=0, hit_tokens=0, refused=0)
        self.closed = False

    # -- lookups ---------------------------------------------------------------------------------
    def usable(self, tier: str) -> bool:
        return self.budgets[tier] != 0 and (tier != "disk" or self.disk_dir is not None)

    def require_usable(self, tier: str) -> None:
        if tier not in TIERS:
            raise ConfigError(f"unknown tier {tier!r}; tiers are {TIERS}")
        if not self.usable(tier):
            why = "no disk_dir was given" if tier == "disk" and self.disk_dir is None else "its budget is 0"
            raise ConfigError(f"tier {tier!r} is disabled: {why}")

    def check_open(self) -> None:
        if self.closed:
            raise CapsuleError("this capsule store was closed; make a new one")

    def lookup(self, name: str, namespace: str) -> tuple[Key, Entry]:
        key = (validate_name(namespace, "namespace"), validate_name(name))
        e = self.entries.get(key)
        if e is None:
            raise UnknownCapsuleError(f"no capsule {name!r} in namespace {namespace!r}")
        return key, e

    def refuse_known(self, keys: list[Key]) -> None:
        for k in keys:
            if k in self.entries:
                raise DuplicateCapsuleError(f"capsule {k[1]!r} in namespace {k[0]!r} already exists")

    def policy_of(self, e: Entry) -> CapsulePolicy:
        return self.anon_policy if e.anonymous else self.policy

    def anon_nbytes(self) -> int:
        """Bytes anonymous entries hold alone: their own tensors and the blocks only they reference."""
        own = sum(e.own_nbytes for e in self.entries.values() if e.anonymous)
        return own + sum(self.pools[t].anon_only_nbytes() for t in MEMORY_TIERS)

    # -- booking (what a move changes in the books; the bytes move in moves.py) ---------------------
    def insert(self, key: Key, e: Entry) -> None:
        """Index an entry whose bytes (and block references) its tier holds already."""
        self.entries[key] = e
        self.used[e.tier] += e.own_nbytes
        self.policy_of(e).on_insert(pkey(key), e.tier, e.meta.nbytes, e.meta.recompute_cost_s, e.pinned)
        self.index.add(key, e)

    def forget(self, key: Key, e: Entry) -> None:
        """Take an entry out of the books (its tier's block references are dropped by the caller; those of
        its disk copy here)."""
        del self.entries[key]
        self.used[e.tier] -= e.own_nbytes
        self.forget_disk_copy(e)
        self.policy_of(e).on_remove(pkey(key))
        self.index.remove(key, e)

    def forget_disk_copy(self, e: Entry) -> None:
        """Take e's disk copy out of the books (its file is unlinked by the caller)."""
        if e.disk_copy:
            self.unref("disk", e)
            self.used["disk"] -= e.own_nbytes
            e.disk_copy = False

    def ref(self, tier: str, e: Entry) -> None:
        """e references each of its blocks in `tier` (the disk tier records a block it lacks, no file yet)."""
        if tier == "disk":
            for k in e.block_keys:
                self.pools[tier].add(k, BlockRecord(e.blocks.nbytes_of(k)))  # type: ignore[union-attr]
        self.used[tier] += self.pools[tier].ref(e.block_keys, e.anonymous)

    def unref(self, tier: str, e: Entry) -> None:
        self.used[tier] -= self.pools[tier].unref(e.block_keys, e.anonymous)

    def moved(self, key: Key, e: Entry, dest: str) -> None:
        """Book e's move from its tier to `dest` (its block references in `dest` are taken already). With
        e.disk_copy the disk tier keeps counting it: a promotion out of disk leaves its file there, and a
        demotion back to disk finds it there."""
        src, n = e.tier, e.own_nbytes
        if not (src == "disk" and e.disk_copy):
            self.unref(src, e)
            self.used[src] -= n
        e.tier = dest
        if not (dest == "disk" and e.disk_copy):
            self.used[dest] += n
        self.counters["promotions" if RANK[dest] < RANK[src] else "demotions"] += 1
        self.policy_of(e).on_move(pkey(key), dest)

    def close(self) -> None:
        """Forget every entry and block, and refuse further use."""
        for key, e in self.entries.items():
            e.pending = None  # a write still running finds itself cancelled and removes its temp file
            self.policy_of(e).on_remove(pkey(key))
        self.entries.clear()
        for pool in self.pools.values():
            pool.clear()
        self.index.clear()
        self.used = {t: 0 for t in TIERS}
        self.closed = True

    # -- planning (no side effects on the books) ---------------------------------------------------
    def new_plan(self) -> Plan:
        return Plan(self.used, lambda tier: self.pools[tier].records)

    def plan_budget(self, tier: str, nbytes: int | None) -> Plan:
        """Set a tier's budget and plan the moves that make it hold; the budget is put back if it cannot."""
        old, self.budgets[tier] = self.budgets[tier], nbytes
        try:
            plan = self.new_plan()
            self.make_room(plan, tier, frozenset())
        except BaseException:
            self.budgets[tier] = old
            raise
        return plan

    def make_room(self, plan: Plan, tier: str, protect: frozenset, *, anon_only: bool = False) -> None:
        """Plan moves until what the plan puts in `tier` fits its budget; BudgetExceededError if it cannot,
        TierInUseError if it could once the capsules being read now are not."""
        budget = self.budgets[tier]
        if budget is None or plan.used[tier] <= budget:
            return
        if tier == "disk" and not anon_only and self._drop_disk_copies(plan):
            return
        busy: set[Key] = set()  # victims passed over only because a restore or a move reads them now
        for policy in (self.anon_policy,) if anon_only else (self.anon_policy, self.policy):
            if self._evict(plan, tier, protect, policy, busy):
                return
        if sum(self.entries[k].meta.nbytes for k in busy) >= plan.used[tier] - budget:
            raise TierInUseError(
                f"tier {tier!r} cannot hold {plan.used[tier]} bytes within its budget of {budget} while "
                f"{len(busy)} capsule(s) it would move out are being read; retry after the reads end")
        raise BudgetExceededError(
            f"tier {tier!r} cannot hold {plan.used[tier]} bytes within its budget of {budget}: pinned and in-use "
            f"capsules stay{' (and prefix entries never displace capsules)' if anon_only else ''}; unpin "
            "capsules or raise the budget")

    def _evict(self, plan: Plan, tier: str, protect: frozenset, policy: CapsulePolicy, busy: set[Key]) -> bool:
        """Plan moving `policy`'s victims out of `tier` until it fits; whether it does. Victims passed over
        only because they are being read go into `busy`."""
        budget = self.budgets[tier]
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
                e = self.entries.get(key)  # type: ignore[arg-type]
                movable = e is not None and key not in protect and not e.pinned and plan.where.get(key, e.tier) == tier
                if not movable or e.readers:  # type: ignore[union-attr]
                    asked += e.meta.nbytes if e is not None else 0
                    if movable:
                        busy.add(key)  # type: ignore[arg-type]
                    continue
                before = plan.used[tier]
                self._plan_victim(plan, key, tier, protect)  # type: ignore[arg-type]
                asked += e.meta.nbytes - (before - plan.used[tier])
                if plan.used[tier] <= budget:  # type: ignore[operator]
                    return True

    def _drop_disk_copies(self, plan: Plan) -> bool:
        """Plan removing the disk copies of capsules held (or promoted by this plan) in memory, unpinned ones
        first, least recently used first, until the disk tier fits: memory holds the capsule, so nothing is
        lost but the file that would outlive a restart. Whether it fits."""
        budget = self.budgets["disk"]
        dropped = {k for k, d in plan.actions if d == DROP_DISK_COPY}
        copies = [(e.pinned, e.last_used, key) for key, e in self.entries.items()
                  if (e.disk_copy or e.tier == "disk") and key not in dropped
                  and plan.where.get(key, e.tier) in MEMORY_TIERS]
        for _, _, key in sorted(copies):
            e = self.entries[key]
            plan.leave("disk", e.own_nbytes, e.blocks)
            plan.actions.append((key, DROP_DISK_COPY))
            if plan.used["disk"] <= budget:  # type: ignore[operator]
                return True
        return False

    def _plan_victim(self, plan: Plan, key: Key, tier: str, protect: frozenset) -> None:
        e = self.entries[key]
        for dest in () if e.anonymous else TIERS[RANK[tier] + 1:]:
            if not self.usable(dest):
                continue
            snap = plan.snapshot()
            self._book(plan, key, tier, dest)
            try:
                self.make_room(plan, dest, protect | {key})
            except BudgetExceededError:
                plan.restore(snap)
                continue
            plan.actions.append((key, dest))  # after the moves that make room for it
            return
        self._book(plan, key, tier, None)  # dropped
        plan.actions.append((key, None))

    def _book(self, plan: Plan, key: Key, src: str, dest: str | None) -> None:
        """Book a move in `plan`. A capsule's file stays in disk_dir while it is anywhere (Entry.disk_copy):
        leaving disk for memory frees no disk bytes, and going back to disk costs none."""
        e = self.entries[key]
        plan.where[key] = dest
        copy = e.disk_copy and (key, DROP_DISK_COPY) not in plan.actions
        has_file = src == "disk" or copy
        if src != "disk" or dest is None:
            plan.leave(src, e.own_nbytes, e.blocks)
        if dest is None and copy:
            plan.leave("disk", e.own_nbytes, e.blocks)
        if dest is not None and not (dest == "disk" and has_file):
            plan.enter(dest, e.own_nbytes, e.blocks)

    def plan_to(self, key: Key, dest: str) -> Plan:
        """Plan moving an existing capsule to `dest`, room made first; raises before any change."""
        e = self.entries[key]
        plan = self.new_plan()
        # its old place counts as free, so a victim may swap into it (that tier holds both for a moment)
        self._book(plan, key, e.tier, dest)
        self.make_room(plan, dest, frozenset({key}))
        plan.actions.append((key, dest))
        return plan
