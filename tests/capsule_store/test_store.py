import random
import threading

import pytest
import torch

from capsulert.capsule_store import CapsuleMeta, CapsuleStore, tensor_nbytes
from capsulert.capsule_store.format.names import capsule_file_name
from capsulert.capsule_store.owner import LOCK_NAME
from capsulert.errors import (BudgetExceededError, CapsuleInUseError, ConfigError, CorruptCapsuleError,
                              DuplicateCapsuleError, IncompatibleCapsuleError, InvalidCapsuleNameError,
                              TierInUseError, UnknownCapsuleError)
from capsulert.policies.base import CapsulePolicy

FP, LAYOUT = "fp-test", 2


class LocalLRU(CapsulePolicy):
    """Test-local LRU. Deliberately names pinned capsules too: the store must skip them."""

    def __init__(self):
        self.tier, self.size, self.clock, self.t = {}, {}, {}, 0

    def _tick(self, n):
        self.t += 1
        self.clock[n] = self.t

    def on_insert(self, name, tier, nbytes, cost, pinned):
        assert name not in self.tier
        self.tier[name], self.size[name] = tier, nbytes
        self._tick(name)

    def on_access(self, name):
        self._tick(name)

    def on_move(self, name, tier):
        self.tier[name] = tier
        self._tick(name)

    def on_remove(self, name):
        del self.tier[name], self.size[name], self.clock[name]

    def pin(self, name): ...

    def unpin(self, name): ...

    def choose_victims(self, tier, nbytes_needed):
        out, freed = [], 0
        for n in sorted((n for n in self.tier if self.tier[n] == tier), key=self.clock.get):
            if freed >= nbytes_needed:
                break
            out.append(n)
            freed += self.size[n]
        return out

    def should_promote(self, name):
        return None if self.tier[name] == "device" else "device"


def tensors(seed, n=16):
    """bf16 + fp32 tensors of random bit patterns (NaN payloads included): 4n + 4n bytes."""
    g = torch.Generator().manual_seed(seed)
    b16 = torch.randint(-2**15, 2**15, (n,), generator=g, dtype=torch.int16)
    b32 = torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int32)
    b16[0], b32[0] = 0x7FC3, 0x7F800005
    return {"kv": b16.view(torch.bfloat16).repeat(2), "ssm": b32.view(torch.float32)}


NB = tensor_nbytes(tensors(0))  # 128 bytes per capsule


def meta(name, t, ns="default", fp=FP, layout=LAYOUT, nbytes=None):
    return CapsuleMeta.build(name=name, namespace=ns, tokens=list(range(10)), grid_pos=8, fingerprint=fp,
                             layout_version=layout, grid=8, nbytes=tensor_nbytes(t) if nbytes is None else nbytes,
                             recompute_cost_s=0.1)


def exact(a, b):
    return sorted(a) == sorted(b) and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8))
        for k in a)


def store(tmp_path=None, **budgets):
    return CapsuleStore(device=torch.device("cpu"), fingerprint=FP, layout_version=LAYOUT, budgets=budgets or None,
                        disk_dir=tmp_path, policy=LocalLRU())


def add(s, name, seed=None, **kw):
    t = tensors(hash(name) % 1000 if seed is None else seed)
    s.put(meta(name, t), t, **kw)
    return t


def tiers(s):
    return {i.name: i.tier for i in s.list()}


def test_put_get_list_delete():
    s = store()
    t = tensors(1)
    ref = s.put(meta("sys-prompt_v1.2", t), t)
    assert (ref.name, ref.tier, ref.nbytes, ref.boundary) == ("sys-prompt_v1.2", "device", NB, 10)
    src = {k: v.clone() for k, v in t.items()}
    t["kv"].view(torch.int16).fill_(0)  # the caller's buffers change after the snapshot ...
    m, got = s.get("sys-prompt_v1.2")
    assert exact(got, src) and m.name == "sys-prompt_v1.2"  # ... the capsule does not
    s.put(meta("b", src, ns="other"), src)
    assert [(i.namespace, i.name) for i in s.list()] == [("default", "sys-prompt_v1.2"), ("other", "b")]
    assert [i.name for i in s.list("other")] == ["b"] and s.contains("b", "other") and not s.contains("b")
    assert s.info("b", "other").tier == "device"
    s.delete("sys-prompt_v1.2")
    assert not s.contains("sys-prompt_v1.2") and s.stats()["device"] == {"bytes": NB, "count": 1, "budget": None}


def test_refusals_leave_store_unchanged():
    s = store(gpu=4 * NB)
    t = add(s, "a")
    before = (s.list(), s.stats())
    with pytest.raises(DuplicateCapsuleError):
        s.put(meta("a", t), t)
    with pytest.raises(IncompatibleCapsuleError):
        s.put(meta("x", t, fp="other"), t)
    with pytest.raises(IncompatibleCapsuleError):
        s.put(meta("x", t, layout=9), t)
    with pytest.raises(ValueError):
        s.put(meta("x", t, nbytes=NB + 1), t)
    with pytest.raises(ConfigError):
        s.put(meta("x", t), t, tier="disk")  # no disk_dir
    for call in (s.get, s.delete, s.info, s.pin, lambda n: s.promote(n, "device"), s.demote):
        with pytest.raises(UnknownCapsuleError):
            call("nope")
    for bad in ("../x", "/etc/passwd", ".hidden"):
        with pytest.raises(InvalidCapsuleNameError):
            s.get(bad)
    assert (s.list(), s.stats()) == before


def test_budget_cascade_to_drop(tmp_path):
    s = store(tmp_path, gpu=2 * NB, host=2 * NB, disk=2 * NB)
    data = {f"c{i}": add(s, f"c{i}", seed=i) for i in range(7)}
    assert tiers(s) == {"c6": "device", "c5": "device", "c4": "host", "c3": "host", "c2": "disk", "c1": "disk"}
    st = s.stats()
    assert st["evictions"] == 1 and st["demotions"] == 5 + 3 and st["disk"]["bytes"] == 2 * NB
    s.flush()  # the cascade wrote c1 and c2 in the background
    assert {p.name for p in tmp_path.iterdir()} == {capsule_file_name("default", n) for n in ("c1", "c2")} | {LOCK_NAME}
    for n in ("c1", "c4", "c2"):  # promotions from disk and host cascade others down; bytes stay exact
        assert exact(s.get(n)[1], data[n])
        assert tiers(s)[n] == "device"
    for n in tiers(s):
        assert exact(s.get(n)[1], data[n])
    for t in ("device", "host", "disk"):
        assert s.stats()[t]["bytes"] <= 2 * NB


def test_pinned_never_dropped(tmp_path):
    s = store(gpu=2 * NB, host=0)
    add(s, "p", pin=True)
    for i in range(5):
        add(s, f"c{i}")
    assert "p" in tiers(s) and s.info("p").pinned
    assert s.stats()["evictions"] == 4


def test_pinned_alone_over_budget_refused_unchanged(tmp_path):
    s = store(tmp_path, gpu=2 * NB, host=NB, disk=NB)
    add(s, "p1", pin=True)
    add(s, "p2", pin=True)
    add(s, "h", tier="host", pin=True)
    add(s, "d", tier="disk")
    before = (s.list(), s.stats(), sorted(tmp_path.iterdir()))
    with pytest.raises(BudgetExceededError):
        add(s, "x")
    with pytest.raises(BudgetExceededError):
        s.promote("d", "device")
    with pytest.raises(BudgetExceededError):
        s.set_budget("device", NB)
    with pytest.raises(BudgetExceededError):
        s.put(meta("big", tensors(0, n=64)), tensors(0, n=64), tier="disk")  # bigger than the budget
    assert (s.list(), s.stats(), sorted(tmp_path.iterdir())) == before
    s.unpin("p1")
    add(s, "x")  # now p1 may leave: host is full of pins, so it goes on to disk, dropping d
    assert tiers(s) == {"p1": "disk", "p2": "device", "h": "host", "x": "device"}


def test_set_budget_shrink_demotes(tmp_path):
    s = store(tmp_path)
    data = {f"c{i}": add(s, f"c{i}", seed=i) for i in range(4)}
    s.set_budget("device", NB)
    assert tiers(s) == {"c0": "host", "c1": "host", "c2": "host", "c3": "device"}
    s.set_budget("host", 0)
    assert set(tiers(s).values()) == {"device", "disk"} and s.stats()["host"]["budget"] == 0
    s.set_budget("disk", NB)
    assert tiers(s) == {"c2": "disk", "c3": "device"} and s.stats()["evictions"] == 2
    assert exact(s.get("c2")[1], data["c2"])  # a swap: c2 comes up, c3 goes down into the freed disk slot
    assert tiers(s) == {"c2": "device", "c3": "disk"}
    assert exact(s.get("c3")[1], data["c3"]) and s.stats()["evictions"] == 2
    with pytest.raises(ConfigError):
        s.set_budget("device", -1)


def test_moves_are_exact_and_counted(tmp_path):
    s = store(tmp_path)
    t = add(s, "a")
    s.demote("a")
    assert s.info("a").tier == "host"
    s.demote("a")
    assert s.info("a").tier == "disk"
    with pytest.raises(ValueError):
        s.demote("a")
    s.promote("a", "host")
    s.prefetch("a")
    s.prefetch("a")  # already there: no second copy
    st = s.stats()
    assert (st["promotions"], st["demotions"]) == (2, 2)
    _, got = s.get("a")
    assert exact(got, t) and s.stats()["hits"] == 1 and s.stats()["misses"] == 0
    s.demote("a", "disk")
    assert exact(s.get("a")[1], t) and s.stats()["misses"] == 1 and s.info("a").tier == "device"


def test_gpu_tier_disabled_gives_transient_copy():
    s = store(gpu=0)
    with pytest.raises(ConfigError):
        add(s, "a")
    t = add(s, "a", tier="host")
    assert exact(s.get("a")[1], t) and s.info("a").tier == "host" and s.stats()["device"]["bytes"] == 0


def test_save_load_round_trip(tmp_path):
    s = store(tmp_path / "disk", host=3 * NB)
    data = {f"c{i}": add(s, f"c{i}", seed=i, tier=t) for i, t in enumerate(["device", "host", "disk", "device"])}
    s.put(meta("c9", data["c0"], ns="ns2"), data["c0"])
    assert s.save(tmp_path / "out") == 5
    s_small = store(host=3 * NB, gpu=NB)
    with pytest.raises(BudgetExceededError):  # 5 capsules cannot land in a 3-capsule host tier
        s_small.load(tmp_path / "out")
    assert s_small.list() == []
    s2 = store(host=5 * NB)
    assert s2.load(tmp_path / "out") == 5
    assert sorted((i.namespace, i.name) for i in s2.list()) == sorted((i.namespace, i.name) for i in s.list())
    assert s2.stats()["host"]["count"] == 5
    for n, t in data.items():
        assert exact(s2.get(n)[1], t)
    assert exact(s2.get("c9", "ns2")[1], data["c0"])
    with pytest.raises(DuplicateCapsuleError):
        s2.load(tmp_path / "out")
    s3 = store(host=0)
    s3.load(tmp_path / "out")
    assert {i.tier for i in s3.list()} == {"device"}


def test_load_with_corrupt_file_inserts_nothing(tmp_path):
    s = store()
    for i in range(3):
        add(s, f"c{i}", seed=i)
    s.save(tmp_path)
    victim = tmp_path / capsule_file_name("default", "c1")
    raw = bytearray(victim.read_bytes())
    raw[-3] ^= 0xFF
    victim.write_bytes(bytes(raw))
    s2 = store()
    add(s2, "keep")
    before = (s2.list(), s2.stats())
    with pytest.raises(CorruptCapsuleError):
        s2.load(tmp_path)
    assert (s2.list(), s2.stats()) == before
    s3 = CapsuleStore(device="cpu", fingerprint="other", layout_version=LAYOUT, policy=LocalLRU())
    victim.unlink()
    with pytest.raises(IncompatibleCapsuleError):
        s3.load(tmp_path)
    assert s3.list() == []


def test_reading_blocks_delete_and_eviction():
    s = store(gpu=2 * NB, host=0)
    t = add(s, "a")
    with s.reading("a") as (m, got):
        assert exact(got, t) and m.name == "a"
        with pytest.raises(CapsuleInUseError):
            s.delete("a")
        add(s, "b")
        with pytest.raises(BudgetExceededError):  # a is being read: it may not leave, dropping b is not enough
            s.set_budget("device", NB // 2)
        add(s, "c")  # drops b, not a
        assert set(tiers(s)) == {"a", "c"}
    s.delete("a")
    assert not s.contains("a")


def test_a_tier_that_can_make_room_only_once_a_read_ends_refuses_as_in_use_and_changes_nothing():
    """A promote whose room is held by a capsule being read is refused with TierInUseError: a CapsuleInUseError
    (retry after the read) that callers handling a full tier also catch as a BudgetExceededError. Once the read
    ends the same promote goes through. Room held by a pinned capsule is the plain BudgetExceededError."""
    s = store(gpu=NB, host=2 * NB)
    add(s, "a")
    add(s, "b", tier="host")
    with s.reading("a"):
        before = (tiers(s), s.stats())
        with pytest.raises(TierInUseError) as refused:
            s.promote("b", "device")
        assert isinstance(refused.value, CapsuleInUseError) and isinstance(refused.value, BudgetExceededError)
        assert "being read" in str(refused.value)
        assert (tiers(s), s.stats()) == before
    s.promote("b", "device")
    assert tiers(s) == {"a": "host", "b": "device"}
    s.pin("b")
    with pytest.raises(BudgetExceededError) as full:
        s.promote("a", "device")
    assert not isinstance(full.value, CapsuleInUseError)
    assert tiers(s) == {"a": "host", "b": "device"}


def test_default_policy_resolves():
    s = CapsuleStore(device="cpu", fingerprint=FP, layout_version=LAYOUT)
    assert isinstance(s.policy, CapsulePolicy)
    with pytest.raises(ConfigError):
        CapsuleStore(device="cpu", fingerprint=FP, layout_version=LAYOUT, policy="no_such_policy")
    with pytest.raises(ConfigError):
        CapsuleStore(device="cpu", fingerprint=FP, layout_version=LAYOUT, budgets={"ram": 1})


def test_concurrent_put_get_delete(tmp_path):
    budgets = {"device": 5 * NB, "host": 4 * NB, "disk": 6 * NB}
    s = store(tmp_path, **budgets)
    data = {f"n{i}": tensors(i) for i in range(40)}
    errors = []

    def check():
        with s._lock:  # a consistent view: both under the store lock
            st, infos = s.stats(), s.list()
        for t, b in budgets.items():
            # a capsule promoted out of disk keeps its file there (on_disk), counted in the disk tier
            held = sum(i.tier == t or (t == "disk" and i.on_disk) for i in infos)
            assert st[t]["bytes"] <= b and st[t]["bytes"] == NB * held
        assert sum(st[t]["count"] for t in budgets) == len(infos)

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(60):
                n = rng.choice(list(data))
                op = rng.random()
                try:
                    if op < 0.4:
                        s.put(meta(n, data[n]), data[n], tier=rng.choice(["device", "host", "disk"]), pin=rng.random() < 0.05)
                    elif op < 0.75:
                        assert exact(s.get(n)[1], data[n])
                    elif op < 0.9:
                        s.delete(n)
                    else:
                        s.unpin(n)
                except (UnknownCapsuleError, DuplicateCapsuleError, BudgetExceededError, CapsuleInUseError):
                    pass
                check()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    check()
    s.flush()
    on_disk = {p.name for p in tmp_path.iterdir()} - {LOCK_NAME}
    # the disk tier's files, and those of capsules promoted out of it (their file stays: on_disk), nothing else
    assert on_disk == {capsule_file_name(i.namespace, i.name) for i in s.list() if i.on_disk}


@pytest.mark.parametrize("policy", ["lru", "pinned_lru", "cost_aware"])
def test_shipped_policies_keep_invariants(tmp_path, policy):
    budgets = {"device": 3 * NB, "host": 2 * NB, "disk": 2 * NB}
    s = CapsuleStore(device="cpu", fingerprint=FP, layout_version=LAYOUT, budgets=budgets, disk_dir=tmp_path,
                     policy=policy)
    rng, data, pinned = random.Random(7), {f"n{i}": tensors(i) for i in range(12)}, set()
    for _ in range(300):
        n, op = rng.choice(list(data)), rng.random()
        try:
            if op < 0.4:
                s.put(meta(n, data[n]), data[n], tier=rng.choice(["device", "host", "disk"]), pin=rng.random() < 0.1)
                if s.info(n).pinned:
                    pinned.add(n)
            elif op < 0.7:
                assert exact(s.get(n)[1], data[n])
            elif op < 0.8:
                s.demote(n)
            elif op < 0.9:
                s.unpin(n)
                pinned.discard(n)
            else:
                s.delete(n)
                pinned.discard(n)
        except (UnknownCapsuleError, DuplicateCapsuleError, BudgetExceededError, ValueError):
            pass
        st = s.stats()
        assert all(st[t]["bytes"] <= b for t, b in budgets.items())
        assert pinned <= {i.name for i in s.list()}  # pinned capsules are never dropped


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tiers_exact_and_async(tmp_path):
    dev = torch.device("cuda")
    s = CapsuleStore(device=dev, fingerprint=FP, layout_version=LAYOUT, budgets={"device": 2 * NB, "host": 2 * NB},
                     disk_dir=tmp_path, policy=LocalLRU())
    data = {f"c{i}": tensors(i) for i in range(6)}
    for n, t in data.items():
        live = {k: v.to(dev) for k, v in t.items()}
        s.put(meta(n, t), live)
        for v in live.values():
            v.view(torch.uint8).fill_(0)  # the slot moves on; the capsule must not
    assert s.info("c0").tier == "disk" and s.info("c3").tier == "host"
    s.prefetch("c0")
    s.prefetch("c0")
    assert s.stats()["promotions"] == 1
    for n in ["c0", "c3", "c1", "c5"]:
        _, got = s.get(n)
        assert all(v.is_cuda for v in got.values())
        assert exact({k: v.cpu() for k, v in got.items()}, data[n])
    assert s.save(tmp_path / "out") == len(s.list())
    s2 = CapsuleStore(device=dev, fingerprint=FP, layout_version=LAYOUT, policy=LocalLRU())
    s2.load(tmp_path / "out")
    assert all(i.tier == "host" for i in s2.list())
    for i in s2.list():
        assert exact({k: v.cpu() for k, v in s2.get(i.name)[1].items()}, data[i.name])
