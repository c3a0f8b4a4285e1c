"""A seeded random trace of 10,000 operations against a real CapsuleStore, for each shipped policy.

The budgets are a few capsules wide, so the cascade gpu -> host -> disk -> dropped runs on most
operations. The test keeps its own model of what the store should hold (every capsule it put, with a
private copy of the bytes and its pin flag) and after every operation checks:

- no tier holds more bytes than its budget; list() and stats() agree on counts and bytes per tier;
  every live capsule is in exactly one tier, and the disk tier's capsules are exactly the capsule
  files in disk_dir (no stale file left behind by a promotion, no temp file);
- the live set equals the model minus the capsules the store dropped, and the number of drops equals
  the `evictions` counter delta; a pinned capsule is never dropped;
- the `promotions` / `demotions` deltas equal the number of capsules that moved to a faster / slower
  tier, and hits / misses count gets from gpu / from a slower tier;
- a refusal (BudgetExceededError, ConfigError, ValueError, Duplicate/Unknown) happens exactly when
  the store's contract says so (pinned capsules alone do not leave room, a disabled tier, a wrong
  direction, ...) and changes nothing at all;
- every get() returns tensors byte-identical (dtype, shape, raw bytes, NaN payloads included) to the
  tensors that were put, which the trace overwrites right after put (the store must not alias them).

Tensors are tiny (bytes, not megabytes): the bookkeeping is what is under test. fsync is turned
off in the disk module for speed (crash safety is tested in test_disk.py); everything else is real.
"""
from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass

import pytest
import torch

import capsulert.capsule_store.format.staging as staging_mod
from capsulert.capsule_store import CapsuleMeta, CapsuleStore, tensor_nbytes
from capsulert.capsule_store.format.names import capsule_file_name
from capsulert.capsule_store.format.disk import list_capsule_files
from capsulert.capsule_store.owner import LOCK_NAME
from capsulert.errors import (BudgetExceededError, CapsuleInUseError, ConfigError, DuplicateCapsuleError,
                              UnknownCapsuleError)
from capsulert.policies import registered_policies
from capsulert.policies.base import TIERS

FP, LAYOUT, NS = "fp-trace", 3, "default"
N_OPS = 10_000
NAMES = [f"c{i:02d}" for i in range(80)]
BASE = {"device": 700, "host": 1100, "disk": 1800}  # capsules average ~130 bytes: ~5 / ~8 / ~14 of them
RANK = {t: i for i, t in enumerate(TIERS)}
DTYPES = [torch.bfloat16, torch.bfloat16, torch.float32, torch.float16, torch.uint8, torch.int64]
SHIPPED = ["lru", "pinned_lru", "cost_aware"]


class _NoSyncOS:
    """`os` for the staging module (crash-safe writes) with fsync a no-op (speed only; every other call is the real one)."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def fsync(fd):
        return None


def raw(t: torch.Tensor) -> torch.Tensor:
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())  # fresh strides (1-element views keep odd ones)
    return dense.reshape(-1).view(torch.uint8)


def same_bytes(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return sorted(got) == sorted(want) and all(
        got[k].dtype == want[k].dtype and got[k].shape == want[k].shape and torch.equal(raw(got[k]), raw(want[k]))
        for k in want)


def random_tensors(rng: random.Random, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """1-3 tensors of random bit patterns and varied dtypes/shapes; some empty, some non-contiguous."""
    out = {}
    for j in range(rng.randint(1, 3)):
        dt = rng.choice(DTYPES)
        size = torch.tensor([], dtype=dt).element_size()
        numel = rng.choice([0, 1, 2, 5, 8, 16, 24, 40, 64])
        if numel and rng.random() < 0.3:  # a strided view, like a slot's kv_k[:, slot, :G]
            base = torch.randint(0, 256, (2 * numel * size,), dtype=torch.uint8, generator=gen).view(dt)
            t = base.reshape(numel, 2)[:, 1]
        else:
            t = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=gen).view(dt)
            if numel % 8 == 0 and numel:
                t = t.reshape(-1, 4)
        out[f"t{j}"] = t
    return out


def make_meta(name: str, tensors: dict[str, torch.Tensor], rng: random.Random) -> CapsuleMeta:
    n_tok = rng.randint(1, 24)
    return CapsuleMeta.build(name=name, namespace=NS, tokens=[rng.randrange(4096) for _ in range(n_tok)],
                             grid_pos=n_tok // 8 * 8, fingerprint=FP, layout_version=LAYOUT, grid=8,
                             nbytes=tensor_nbytes(tensors), recompute_cost_s=round(rng.uniform(0.0, 2.0), 4))


@dataclass
class Rec:
    tensors: dict[str, torch.Tensor]  # private copy of what was put
    nbytes: int
    pinned: bool


class Trace:
    def __init__(self, store: CapsuleStore, disk_dir, budgets: dict):
        self.s, self.disk_dir, self.budgets = store, disk_dir, dict(budgets)
        self.model: dict[str, Rec] = {}
        self.counts = {k: 0 for k in ("put", "get", "promote", "demote", "prefetch", "pin", "unpin", "delete",
                                      "set_budget", "reading", "refused", "dropped", "refused_budget_shrink")}
        self.inflation = 0.0
        self.observed = 0
        self.live, self.st = self.observe()

    # -- observing and checking ---------------------------------------------------------------------
    def observe(self):
        infos = self.s.list()
        names = [i.name for i in infos]
        assert len(names) == len(set(names)), "a capsule is listed twice"
        st = self.s.stats()
        for t in TIERS:
            mine = [i for i in infos if i.tier == t]
            assert st[t]["count"] == len(mine), (t, st[t], len(mine))
            # a capsule promoted out of disk keeps its file there, counted in the disk tier (on_disk)
            held = [i for i in infos if i.tier == t or (t == "disk" and i.on_disk)]
            assert st[t]["bytes"] == sum(i.nbytes for i in held), (t, st[t])
            assert st[t]["budget"] == self.budgets[t], (t, st[t]["budget"], self.budgets[t])
            if st[t]["budget"] is not None:
                assert st[t]["bytes"] <= st[t]["budget"], f"tier {t} over budget: {st[t]}"
        assert sum(st[t]["count"] for t in TIERS) == len(infos)
        # cascade writes run in the background: at any moment every capsule file is a disk-tier capsule
        # (never a file the index does not hold); once flushed, they are exactly the disk tier
        disk_tier = {capsule_file_name(i.namespace, i.name) for i in infos if i.on_disk}
        assert all(i.on_disk for i in infos if i.tier == "disk")
        assert {p.name for p in list_capsule_files(self.disk_dir)} <= disk_tier
        self.observed += 1
        if self.observed % 5 == 0:
            self.s.flush()
            assert {p.name for p in list_capsule_files(self.disk_dir)} == disk_tier
            hidden = [p.name for p in self.disk_dir.iterdir() if p.name.startswith(".")]
            assert hidden == [LOCK_NAME], f"temp files left behind: {hidden}"
        return {i.name: (i.tier, i.pinned, i.nbytes) for i in infos}, st

    def settle(self, op: str) -> None:
        """After a successful operation: reconcile the model with the store and check the counters."""
        live, st = self.observe()
        assert set(live) <= set(self.model), f"{op}: capsules appeared from nowhere: {set(live) - set(self.model)}"
        dropped = set(self.model) - set(live)
        assert st["evictions"] - self.st["evictions"] == len(dropped), (op, dropped, st, self.st)
        for n in dropped:
            assert not self.model[n].pinned, f"{op}: pinned capsule {n} was dropped"
            del self.model[n]
        self.counts["dropped"] += len(dropped)
        moved_up = moved_down = 0
        for n, (tier, pinned, nbytes) in live.items():
            rec = self.model[n]
            assert pinned == rec.pinned and nbytes == rec.nbytes, (op, n, live[n], rec.pinned, rec.nbytes)
            if n in self.live:
                d = RANK[tier] - RANK[self.live[n][0]]
                moved_up += d < 0
                moved_down += d > 0
        assert st["promotions"] - self.st["promotions"] == moved_up, (op, st, self.st)
        assert st["demotions"] - self.st["demotions"] == moved_down, (op, st, self.st)
        self.check_policy_in_sync()
        self.live, self.st = live, st

    def check_policy_in_sync(self) -> None:
        """The policy's bookkeeping is exactly the store's: same capsules, tiers and pins (shipped policies
        keep per-capsule entries); cost_aware's inflation value L never decreases."""
        pol = self.s.policy
        live = {f"{NS}/{n}": v for n, v in self.s_live().items()}
        assert len(pol) == len(live) and all(k in pol for k in live), "policy lost track of capsules"
        entries = getattr(pol, "_entries", None)
        if entries is not None:
            mine = {k: (e.tier, e.pinned, e.nbytes) for k, e in entries.items()}
            assert mine == live, "policy bookkeeping differs from the store"
        if hasattr(pol, "inflation"):
            assert pol.inflation >= self.inflation
            self.inflation = pol.inflation

    def s_live(self) -> dict:
        return {i.name: (i.tier, i.pinned, i.nbytes) for i in self.s.list()}

    def unchanged(self, op: str) -> None:
        """After a refusal: nothing moved, nothing counted."""
        live, st = self.observe()
        assert live == self.live, f"refused {op} changed the store"
        assert st == self.st, f"refused {op} changed the stats: {self.st} -> {st}"
        self.check_policy_in_sync()
        self.counts["refused"] += 1

    # -- contract helpers -----------------------------------------------------------------------------
    def usable(self, tier: str) -> bool:
        return self.budgets[tier] != 0

    def pinned_bytes(self, tier: str, exclude: str | None = None) -> int:
        return sum(nb for n, (t, p, nb) in self.live.items() if t == tier and p and n != exclude)

    def fits(self, tier: str, nbytes: int, exclude: str | None = None) -> bool:
        """The contract: room can be made unless pinned capsules alone leave too little."""
        b = self.budgets[tier]
        return b is None or self.pinned_bytes(tier, exclude) + nbytes <= b

    def expect_refusal(self, op: str, exc: type, fn) -> None:
        with pytest.raises(exc):
            fn()
        self.unchanged(op)

    def check_get(self, name: str, tensors: dict) -> None:
        assert same_bytes(tensors, self.model[name].tensors), f"capsule {name} is not byte-identical"


def run_trace(policy: str, tmp_path, seed: int) -> Trace:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    s = CapsuleStore(device="cpu", fingerprint=FP, layout_version=LAYOUT, budgets=BASE, disk_dir=tmp_path,
                     policy=policy)
    tr = Trace(s, tmp_path, BASE)
    ops = ["put"] * 26 + ["get"] * 20 + ["promote"] * 7 + ["demote"] * 10 + ["prefetch"] * 7 + ["pin"] * 4 + \
          ["unpin"] * 6 + ["delete"] * 6 + ["set_budget"] * 8 + ["reading"] * 3 + ["unknown"] * 1
    for step in range(N_OPS):
        op = rng.choice(ops)
        existing = sorted(tr.model)
        if op not in ("put", "set_budget", "unknown") and not existing:
            op = "put"
        tr.counts[op] = tr.counts.get(op, 0) + 1
        ctx = f"step {step} {op}"
        if op == "put":
            name, tier, pin = rng.choice(NAMES), rng.choice(TIERS), rng.random() < 0.12
            t = random_tensors(rng, gen)
            meta, nb = make_meta(name, t, rng), tensor_nbytes(t)
            if not tr.usable(tier):
                tr.expect_refusal(ctx, ConfigError, lambda: s.put(meta, t, tier=tier, pin=pin))
            elif name in tr.model:
                tr.expect_refusal(ctx, DuplicateCapsuleError, lambda: s.put(meta, t, tier=tier, pin=pin))
            elif not tr.fits(tier, nb):
                tr.expect_refusal(ctx, BudgetExceededError, lambda: s.put(meta, t, tier=tier, pin=pin))
            else:
                keep = {k: v.clone() for k, v in t.items()}
                ref = s.put(meta, t, tier=tier, pin=pin)
                assert (ref.name, ref.tier, ref.nbytes) == (name, tier, nb)
                for v in t.values():  # the caller's buffers move on; the capsule must not
                    v.zero_()
                tr.model[name] = Rec(keep, nb, pin)
                tr.settle(ctx)
                assert tr.live[name][0] == tier
        elif op in ("get", "reading"):
            name = rng.choice(existing)
            tier, nb = tr.live[name][0], tr.model[name].nbytes
            promotes = tier != "device" and tr.usable("device") and tr.fits("device", nb, exclude=name)
            if tier != "device" and tr.usable("device") and not promotes:
                # pins leave the gpu tier no room: served from a transient copy, the capsule stays put
                tr.counts["get_unpromotable"] = tr.counts.get("get_unpromotable", 0) + 1
            if tier != "device" and not tr.usable("device"):
                tr.counts["get_transient"] = tr.counts.get("get_transient", 0) + 1  # gpu tier disabled
            hits, misses = tr.st["hits"], tr.st["misses"]
            if op == "get":
                meta, got = s.get(name)
                tr.check_get(name, got)
            else:
                with s.reading(name) as (meta, got):
                    tr.check_get(name, got)
                    with pytest.raises(CapsuleInUseError):
                        s.delete(name)
                    assert s.contains(name)
            assert meta.name == name and meta.nbytes == nb
            tr.settle(ctx)
            assert (tr.st["hits"] - hits, tr.st["misses"] - misses) == ((1, 0) if tier == "device" else (0, 1))
            want = "device" if promotes else tier
            assert tr.live[name][0] == want, (ctx, tier, tr.live[name])
        elif op in ("promote", "prefetch"):
            name, target = rng.choice(existing), rng.choice(TIERS)
            tier, nb = tr.live[name][0], tr.model[name].nbytes
            fn = (lambda: s.promote(name, target)) if op == "promote" else (lambda: s.prefetch(name, target))
            if not tr.usable(target):
                tr.expect_refusal(ctx, ConfigError, fn)
            elif RANK[target] > RANK[tier] and op == "promote":
                tr.expect_refusal(ctx, ValueError, fn)
            elif RANK[target] < RANK[tier] and not tr.fits(target, nb, exclude=name):
                tr.expect_refusal(ctx, BudgetExceededError, fn)
            else:
                fn()
                tr.settle(ctx)
                assert tr.live[name][0] == (target if RANK[target] < RANK[tier] else tier)
            if op == "prefetch" and RANK[target] < RANK[tier] and tr.live[name][0] == target:
                before = dict(tr.st)
                s.prefetch(name, target)  # already there: a second prefetch copies nothing
                tr.settle(ctx + " (again)")
                assert tr.st["promotions"] == before["promotions"]
        elif op == "demote":
            name = rng.choice(existing)
            tier, nb = tr.live[name][0], tr.model[name].nbytes
            target = rng.choice([None, *TIERS])
            if target is None:
                dest = next((t for t in TIERS[RANK[tier] + 1:] if tr.usable(t)), None)
                if dest is None:
                    tr.expect_refusal(ctx, ValueError, lambda: s.demote(name))
                    continue
            else:
                dest = target
            if not tr.usable(dest):
                tr.expect_refusal(ctx, ConfigError, lambda: s.demote(name, target))
            elif RANK[dest] < RANK[tier]:
                tr.expect_refusal(ctx, ValueError, lambda: s.demote(name, target))
            elif dest != tier and not tr.fits(dest, nb, exclude=name):
                tr.expect_refusal(ctx, BudgetExceededError, lambda: s.demote(name, target))
            else:
                s.demote(name, target)
                tr.settle(ctx)
                assert tr.live[name][0] == dest
        elif op in ("pin", "unpin"):
            name = rng.choice(existing)
            getattr(s, op)(name)
            tr.model[name].pinned = op == "pin"
            tr.settle(ctx)
        elif op == "delete":
            name = rng.choice(existing)
            s.delete(name)
            del tr.model[name]
            tr.settle(ctx)
            assert not s.contains(name)
        elif op == "unknown":
            name = rng.choice([n for n in NAMES if n not in tr.model] or ["zz"])
            for fn in (lambda: s.get(name), lambda: s.promote(name, "device"), lambda: s.demote(name),
                       lambda: s.prefetch(name), lambda: s.pin(name), lambda: s.delete(name)):
                tr.expect_refusal(ctx, UnknownCapsuleError, fn)
        elif op == "set_budget":
            tier, r = rng.choice(TIERS), rng.random()
            pinned = tr.pinned_bytes(tier)
            if r < 0.15 and pinned:
                value = rng.randint(0, pinned - 1)  # a shrink the pins must refuse
            elif r < 0.30:
                value = 0  # disable the tier; half the time release its pins first so that it can succeed
                if rng.random() < 0.5:
                    for n in sorted(n for n, (t, p, _) in tr.live.items() if t == tier and p):
                        s.unpin(n)
                        tr.model[n].pinned = False
                        tr.settle(ctx + f" unpin {n}")
                    pinned = 0
            elif r < 0.35:
                value = None
            elif r < 0.70:
                value = int(BASE[tier] * rng.uniform(0.3, 1.0))
            else:
                value = int(BASE[tier] * rng.uniform(1.0, 1.5))
            if value is not None and pinned > value:
                tr.expect_refusal(ctx, BudgetExceededError, lambda: s.set_budget(tier, value))
                tr.counts["refused_budget_shrink"] += 1
            else:
                s.set_budget(tier, value)
                tr.budgets[tier] = value
                tr.settle(ctx)
        else:  # pragma: no cover
            raise AssertionError(op)
    # final sweep: every survivor still reads back byte-identical
    for name in sorted(tr.model):
        tier = tr.live[name][0]
        if tier != "device" and tr.usable("device") and not tr.fits("device", tr.model[name].nbytes, exclude=name):
            continue
        tr.check_get(name, s.get(name)[1])
        tr.settle(f"final get {name}")
    return tr


def test_shipped_policies_are_registered():
    assert set(SHIPPED) <= set(registered_policies())


@pytest.mark.parametrize("policy", SHIPPED)
def test_random_trace_keeps_invariants(policy, tmp_path, monkeypatch):
    monkeypatch.setattr(staging_mod, "os", _NoSyncOS())
    t0 = time.perf_counter()
    tr = run_trace(policy, tmp_path, seed=1234 + SHIPPED.index(policy))
    dt = time.perf_counter() - t0
    st = tr.st
    print(f"\n{policy}: {N_OPS} ops in {dt:.1f}s; ops {tr.counts}; stats {st}")
    # the trace must actually exercise what it claims to: constant cascades, drops, refusals, promotions
    assert tr.counts["dropped"] > 200 and st["evictions"] == tr.counts["dropped"]
    assert st["demotions"] > 500 and st["promotions"] > 500 and st["hits"] > 100 and st["misses"] > 100
    assert tr.counts["refused_budget_shrink"] > 10 and tr.counts["refused"] > 200
    assert tr.counts.get("get_transient", 0) > 5 and tr.counts.get("get_unpromotable", 0) > 5


def test_get_when_pins_fill_the_gpu_tier_serves_a_transient_copy(tmp_path):
    t = {"a": torch.arange(16, dtype=torch.float32)}  # 64 bytes each
    s = CapsuleStore(device="cpu", fingerprint=FP, layout_version=LAYOUT, budgets={"device": 64, "host": 64},
                     disk_dir=tmp_path, policy="pinned_lru")
    s.put(make_meta("p", t, random.Random(0)), t, tier="device", pin=True)
    s.put(make_meta("h", t, random.Random(1)), t, tier="host")
    before = s.stats()
    _, got = s.get("h")  # the gpu tier holds only the pinned capsule: no room to promote
    assert torch.equal(got["a"], t["a"])
    assert s.info("h").tier == "host" and s.info("p").tier == "device"
    assert s.stats() == {**before, "misses": before["misses"] + 1}
