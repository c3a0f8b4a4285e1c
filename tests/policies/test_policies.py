"""Shipped capsule policies: scripted traces, invariants under a long random trace, registry."""
from __future__ import annotations

import random

import pytest

from capsulert.errors import ConfigError
from capsulert.policies import (
    TIERS,
    CapsulePolicy,
    CostAwarePolicy,
    LRUPolicy,
    PinnedLRUPolicy,
    make_policy,
    registered_policies,
)

SHIPPED = ["lru", "pinned_lru", "cost_aware"]


def _abc(policy: CapsulePolicy, tier: str = "device", nbytes: int = 10, cost: float = 1.0) -> None:
    for n in "abc":
        policy.on_insert(n, tier, nbytes, cost, False)


# -- scripted traces -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", SHIPPED)
def test_recency_order_equal_cost(name):
    # equal cost per byte: every shipped policy falls back to recency
    p = make_policy(name)
    _abc(p)
    p.on_access("a")
    assert p.choose_victims("device", 1) == ["b"]
    assert p.choose_victims("device", 10) == ["b"]
    assert p.choose_victims("device", 11) == ["b", "c"]
    assert p.choose_victims("device", 30) == ["b", "c", "a"]
    assert p.choose_victims("device", 10_000) == ["b", "c", "a"]  # not enough: all candidates
    assert p.choose_victims("device", 0) == [] and p.choose_victims("device", -5) == []
    assert p.choose_victims("host", 1) == []


@pytest.mark.parametrize("name", SHIPPED)
def test_pinned_never_a_victim(name):
    p = make_policy(name)
    _abc(p)
    p.pin("b")
    assert p.choose_victims("device", 10_000) == ["a", "c"]
    p.on_insert("d", "device", 10, 1.0, True)
    assert "d" not in p.choose_victims("device", 10_000)
    p.unpin("b")
    assert "b" in p.choose_victims("device", 10_000)


@pytest.mark.parametrize("name", SHIPPED)
def test_moves_and_tiers(name):
    p = make_policy(name)
    _abc(p)
    p.on_move("a", "host")
    assert p.choose_victims("device", 10_000) == ["b", "c"]
    assert p.choose_victims("host", 1) == ["a"]
    assert p.should_promote("a") == "device"
    assert p.should_promote("b") is None
    p.on_move("a", "disk")
    assert p.should_promote("a") == "device"
    p.on_remove("b")
    assert p.choose_victims("device", 10_000) == ["c"]


def test_lru_move_counts_as_use():
    p = LRUPolicy()
    _abc(p)
    p.on_move("a", "host")
    p.on_move("a", "device")  # promoted back: now most recent on gpu
    assert p.choose_victims("device", 10_000) == ["b", "c", "a"]


def test_lru_vs_pinned_lru_unpin():
    # a capsule held pinned while others are used: plain lru drops it first after unpin,
    # pinned_lru treats the unpin as a use and keeps it
    orders = {}
    for cls in (LRUPolicy, PinnedLRUPolicy):
        p = cls()
        _abc(p)
        p.pin("a")
        p.on_access("b")
        p.on_access("c")
        p.unpin("a")
        orders[cls] = p.choose_victims("device", 10_000)
    assert orders[LRUPolicy] == ["a", "b", "c"]
    assert orders[PinnedLRUPolicy] == ["b", "c", "a"]


def test_cost_aware_keeps_expensive_per_byte():
    p = CostAwarePolicy()
    p.on_insert("long_prefix", "device", 100, 50.0, False)  # 0.5 s per byte: older but expensive
    p.on_insert("short", "device", 100, 1.0, False)  # cheap
    assert p.choose_victims("device", 1) == ["short"]
    assert p.choose_victims("device", 200) == ["short", "long_prefix"]
    assert p.value("long_prefix") == pytest.approx(0.5)


def test_cost_aware_ties_by_time_then_name():
    p = CostAwarePolicy()
    p.on_insert("z", "host", 10, 1.0, False)
    p.on_insert("y", "host", 10, 1.0, False)
    assert p.choose_victims("host", 10_000) == ["z", "y"]
    p.on_access("z")
    assert p.choose_victims("host", 10_000) == ["y", "z"]


def test_cost_aware_zero_bytes_and_zero_cost():
    p = CostAwarePolicy()
    p.on_insert("empty", "device", 0, 1.0, False)
    p.on_insert("free", "device", 10, 0.0, False)
    assert p.choose_victims("device", 10_000) == ["free", "empty"]


def test_cost_aware_greedydual_aging():
    p = CostAwarePolicy()
    p.on_insert("expensive", "device", 1, 10.0, False)  # H = 10
    assert p.inflation == 0.0
    evicted = []
    for i in range(20):
        p.on_insert(f"cheap{i}", "device", 1, 1.0, False)  # H = L + 1
        (victim,) = p.choose_victims("device", 1)
        before = p.inflation
        p.on_remove(victim)  # the store drops the victim: L rises to its H
        assert p.inflation >= before
        evicted.append(victim)
        if victim == "expensive":
            break
    assert evicted[0] == "cheap0" and p.inflation >= 10.0
    assert evicted[-1] == "expensive"
    # cheap_i has H = i + 1; cheap9 ties expensive at H = 10 and expensive, older, goes first
    assert evicted == [f"cheap{i}" for i in range(9)] + ["expensive"]


def test_cost_aware_inflation_only_from_named_victims():
    p = CostAwarePolicy()
    p.on_insert("a", "device", 1, 5.0, False)
    p.on_insert("b", "device", 1, 7.0, False)
    p.on_remove("b")  # user delete, not a victim
    assert p.inflation == 0.0
    assert p.choose_victims("device", 1) == ["a"]
    p.on_move("a", "host")  # demotion of the named victim
    assert p.inflation == pytest.approx(5.0)
    p.on_insert("c", "device", 1, 1.0, False)
    assert p.value("c") == pytest.approx(6.0)
    p.on_access("a")
    assert p.value("a") == pytest.approx(10.0)


@pytest.mark.parametrize("name", SHIPPED)
def test_refusals(name):
    p = make_policy(name)
    p.on_insert("a", "device", 10, 1.0, False)
    with pytest.raises(ValueError, match="already inserted"):
        p.on_insert("a", "host", 10, 1.0, False)
    for call in (p.on_access, p.on_remove, p.pin, p.unpin, p.should_promote):
        with pytest.raises(KeyError, match="ghost"):
            call("ghost")
    with pytest.raises(KeyError, match="ghost"):
        p.on_move("ghost", "host")
    with pytest.raises(ValueError, match="tier"):
        p.on_move("a", "ssd")
    with pytest.raises(ValueError, match="tier"):
        p.choose_victims("ssd", 1)
    with pytest.raises(ValueError, match="tier"):
        p.on_insert("b", "ssd", 1, 1.0, False)
    with pytest.raises(ValueError):
        p.on_insert("b", "device", -1, 1.0, False)
    with pytest.raises(ValueError):
        p.on_insert("b", "device", 1, float("nan"), False)
    p.on_remove("a")
    with pytest.raises(KeyError):
        p.on_access("a")
    p.on_insert("a", "disk", 1, 1.0, False)  # a name may come back after removal


# -- invariants under a random trace -------------------------------------------------------------
def _run_trace(policy_name: str, seed: int, n_ops: int = 10_000) -> list:
    rng = random.Random(seed)
    p = make_policy(policy_name)
    live: dict[str, dict] = {}  # the test's own model of the store's facts
    decisions: list = []
    next_id = 0
    for _ in range(n_ops):
        op = rng.random()
        if op < 0.2 or not live:
            name = f"c{next_id}"
            next_id += 1
            fact = dict(tier=rng.choice(TIERS), nbytes=rng.randint(0, 1000), pinned=rng.random() < 0.15)
            p.on_insert(name, fact["tier"], fact["nbytes"], rng.uniform(0.0, 2.0), fact["pinned"])
            live[name] = fact
            continue
        name = rng.choice(sorted(live))
        fact = live[name]
        if op < 0.45:
            p.on_access(name)
            target = p.should_promote(name)
            decisions.append(("promote", name, target))
            assert target is None if fact["tier"] == "device" else target == "device"
            if target is not None and rng.random() < 0.7:
                p.on_move(name, target)
                fact["tier"] = target
        elif op < 0.55:
            tier = rng.choice(TIERS)
            p.on_move(name, tier)
            fact["tier"] = tier
        elif op < 0.62:
            p.pin(name)
            fact["pinned"] = True
        elif op < 0.70:
            p.unpin(name)
            fact["pinned"] = False
        elif op < 0.77:
            p.on_remove(name)
            del live[name]
        else:
            tier = rng.choice(TIERS)
            needed = rng.choice([-1, 0, 1, rng.randint(1, 3000), 10**9])
            victims = p.choose_victims(tier, needed)
            decisions.append(("victims", tier, needed, tuple(victims)))
            candidates = {n for n, f in live.items() if f["tier"] == tier and not f["pinned"]}
            assert len(set(victims)) == len(victims)
            assert set(victims) <= candidates
            if needed <= 0:
                assert victims == []
                continue
            total = sum(live[v]["nbytes"] for v in victims)
            if set(victims) == candidates and total < needed:
                pass  # not enough: all candidates returned, the store refuses
            else:
                assert total >= needed
                assert total - live[victims[-1]]["nbytes"] < needed  # minimal prefix
            # the store acts on a prefix: demote or drop the first victims
            for v in victims[: rng.randint(0, len(victims))]:
                if rng.random() < 0.5 and tier != "disk":
                    lower = TIERS[TIERS.index(tier) + 1]
                    p.on_move(v, lower)
                    live[v]["tier"] = lower
                else:
                    p.on_remove(v)
                    del live[v]
        if len(live) > 60:  # keep the store small enough that choose_victims stays cheap
            victim = sorted(live)[0]
            p.on_remove(victim)
            del live[victim]
    return decisions


@pytest.mark.parametrize("name", SHIPPED)
def test_random_trace_invariants_and_determinism(name):
    first = _run_trace(name, seed=1234)
    assert any(d[0] == "victims" and d[3] for d in first)
    assert first == _run_trace(name, seed=1234)


# -- registry ------------------------------------------------------------------------------------
def test_registry():
    assert set(SHIPPED) <= set(registered_policies())
    assert type(make_policy("lru")) is LRUPolicy
    assert type(make_policy("pinned_lru")) is PinnedLRUPolicy
    assert type(make_policy("cost_aware")) is CostAwarePolicy
    assert make_policy("lru") is not make_policy("lru")  # a fresh object each time
    with pytest.raises(ConfigError, match="unknown policy"):
        make_policy("mru")
    own = PinnedLRUPolicy()
    assert make_policy(own) is own

    class Mine(LRUPolicy):
        pass

    mine = Mine()
    assert make_policy(mine) is mine
