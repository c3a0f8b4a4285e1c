"""The block-deduplicated store with synthetic capsules (no engine): blocks held once per tier and counted
by reference, pinned capsules pin their blocks, tier moves and budgets on unique bytes, the disk layout
(each block file once per directory, verified, orphans swept, crash-safe order) and `capsules rm`."""
from __future__ import annotations

import pytest
import torch

from capsulert.capsule_store import CapsuleMeta, CapsuleStore, capsule_file_name
from capsulert.capsule_store.format import inspect as inspect_dir
from capsulert.capsule_store.format.blockfiles import BLOCK_SUFFIX, block_file_name
from capsulert.capsule_store.blocks import BlockLayout
from capsulert.capsule_store.format.disk import read_header_refs
from capsulert.errors import CorruptCapsuleError

FP, LAYOUT, ROWS, ORIGIN = "fp-blocks", 2, 8, "test-origin"
BLOCKS = BlockLayout(("kv",), token_dim=1, origin=ORIGIN, complete="hidden")
ROW_BYTES = 2 * 4 * 4  # kv: [2, P, 4] float32


def tokens(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 1000, (n,), generator=g).tolist()


def kv_for(toks: list[int]) -> torch.Tensor:
    """Canonical rows: a row depends only on the prefix up to it (as the engine's grid state does)."""
    rows = [torch.full((2, 1, 4), float(sum(toks[:i + 1]) % 9973)) for i in range(len(toks))]
    return torch.cat(rows, dim=1)


def capsule(name: str, toks: list[int], ns: str = "default"):
    t = {"kv": kv_for(toks), "state": torch.full((16,), float(len(toks)))}
    nbytes = sum(x.numel() * x.element_size() for x in t.values())
    meta = CapsuleMeta.build(name=name, namespace=ns, tokens=toks, grid_pos=len(toks) // ROWS * ROWS, fingerprint=FP,
                             layout_version=LAYOUT, grid=ROWS, nbytes=nbytes, recompute_cost_s=0.01 * len(toks))
    return meta, t


def store(**kw) -> CapsuleStore:
    return CapsuleStore(device="cpu", fingerprint=FP, layout_version=LAYOUT, blocks=BLOCKS, **kw)


def put(s: CapsuleStore, name: str, toks: list[int], **kw):
    meta, t = capsule(name, toks, kw.pop("ns", "default"))
    return s.put(meta, t, origin=ORIGIN, **kw), t


def exact(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


SHARED = tokens(40)  # 5 blocks of 8 rows


def test_shared_prefix_is_held_once_and_counted_by_reference():
    s = store()
    _, ta = put(s, "a", SHARED + tokens(5, 1))
    _, tb = put(s, "b", SHARED + tokens(13, 2))  # 5 shared blocks + 1 of its own
    st = s.stats()
    assert st["blocks"]["device"] == 6
    own = sum(i.nbytes for i in s.list())
    assert st["device"]["bytes"] == own + 6 * ROWS * ROW_BYTES
    assert s.info("a").nbytes == 5 * ROW_BYTES + 64 and s.info("a").blocks == 5
    assert exact(s.get("a")[1], ta) and exact(s.get("b")[1], tb)  # whole tensors, byte-exact
    s.delete("a")  # the shared blocks stay: b references them
    assert s.stats()["blocks"]["device"] == 6 and exact(s.get("b")[1], tb)
    s.delete("b")
    st = s.stats()
    assert st["device"]["bytes"] == 0 and st["blocks"]["device"] == 0


def test_a_put_of_new_blocks_allocates_them_in_slabs_and_copies_once(monkeypatch):
    """A put whose blocks the tier lacks allocates them in slabs of SLAB_BLOCKS consecutive blocks (one
    allocation per slab, each block a view of its row, made when first asked for) and copies everything in one grouped copy, a slab
    as one pair from the rows of the whole tensor; a put that shares blocks allocates and copies only its
    own pieces and the blocks the tier lacks."""
    from capsulert.capsule_store import transfer

    calls, real = [], transfer.copy_pairs

    def spy(pairs):
        calls.append([tuple(d.shape) for d, _ in pairs])
        return real(pairs)

    monkeypatch.setattr(transfer, "copy_pairs", spy)
    s = store()
    n = transfer.SLAB_BLOCKS + 4
    long = tokens(n * ROWS + 5, 3)
    _, ta = put(s, "a", long)
    assert len(calls) == 1  # one grouped copy: own tensors and two slabs
    assert sorted(calls[0]) == sorted([(transfer.SLAB_BLOCKS, 2, ROWS, 4), (4, 2, ROWS, 4), (2, 5, 4), (16,)])
    records = list(s._tiers.pools["device"].records.values())
    assert all(r.tensors is None for r in records)  # no per-block views made by the put: made when asked for
    held = [r.block_tensors()["kv"] for r in records]
    assert len(held) == n and len({t.data_ptr() for t in held}) == n
    storages = [t.untyped_storage().data_ptr() for t in held]
    assert len(set(storages[:transfer.SLAB_BLOCKS])) == 1 and len(set(storages[transfer.SLAB_BLOCKS:])) == 1
    assert held[0].untyped_storage().nbytes() == transfer.SLAB_BLOCKS * ROWS * ROW_BYTES
    calls.clear()
    _, tb = put(s, "b", long[:n * ROWS] + tokens(13, 2))  # n shared blocks, 1 of its own and 5 rows
    assert len(calls) == 1 and sorted(calls[0]) == sorted([(1, 2, ROWS, 4), (2, 5, 4), (16,)])
    assert exact(s.get("a")[1], ta) and exact(s.get("b")[1], tb)
    s.delete("a")
    assert exact(s.get("b")[1], tb)


def test_capsules_of_other_origins_or_namespaces_share_nothing():
    s = store()
    put(s, "a", SHARED)
    put(s, "a", SHARED, ns="acme")  # keys carry the namespace
    meta, t = capsule("foreign", SHARED)
    s.put(meta, t)  # no origin: held whole
    assert s.stats()["blocks"]["device"] == 10
    assert s.info("foreign").blocks == 0 and s.info("foreign").nbytes == meta.nbytes


def test_pinned_capsule_pins_its_blocks():
    s = store()
    ref, ta = put(s, "a", SHARED + tokens(3, 1), pin=True)
    _, tb = put(s, "b", SHARED + tokens(3, 2))
    shared = 5 * ROWS * ROW_BYTES
    s.set_budget("device", ref.nbytes)  # room for a alone: b leaves, the blocks stay with the pinned a
    assert s.info("a").tier == "device" and s.info("b").tier == "host"
    st = s.stats()
    assert st["device"]["bytes"] == ref.nbytes and st["blocks"] == {"device": 5, "host": 5, "disk": 0}
    assert st["host"]["bytes"] == s.info("b").nbytes + shared  # host holds its own copy of the blocks
    assert exact(s.get("b")[1], tb) and exact(s.get("a")[1], ta)


def test_a_victim_sharing_blocks_frees_only_its_own_bytes():
    s = store()
    put(s, "a", SHARED + tokens(3, 1))
    ref_b, _ = put(s, "b", SHARED + tokens(3, 2))
    st = s.stats()["device"]["bytes"]
    s.set_budget("device", st - 1)  # moving the LRU one (a) out frees only its own bytes: enough
    assert {i.name: i.tier for i in s.list()} == {"a": "host", "b": "device"}
    assert s.stats()["device"]["bytes"] == st - s.info("a").nbytes


def test_disk_tier_and_save_hold_each_block_once(tmp_path):
    s = store(disk_dir=tmp_path / "disk")
    want = {}
    for i, name in enumerate("abc"):
        _, want[name] = put(s, name, SHARED + tokens(4 + i, i), tier="disk" if i else "device")
    s.demote("a", "disk")
    blocks = sorted(p.name for p in (tmp_path / "disk").glob("*" + BLOCK_SUFFIX))
    assert len(blocks) == 5
    assert s.save(tmp_path / "saved") == 3
    assert sorted(p.name for p in (tmp_path / "saved").glob("*" + BLOCK_SUFFIX)) == blocks
    fresh = store()
    assert fresh.load(tmp_path / "saved") == 3
    assert fresh.stats()["blocks"]["host"] == 5
    for name, t in want.items():
        assert exact(fresh.get(name)[1], t) and exact(s.get(name)[1], t)  # promotions read the block files
    plain = CapsuleStore(device="cpu", fingerprint=FP, layout_version=LAYOUT)  # a store that cuts nothing loads them too
    assert plain.load(tmp_path / "saved") == 3 and exact(plain.get("b")[1], want["b"])
    # all promoted, and promotion copies: the disk tier still holds each block once
    assert sorted(p.name for p in (tmp_path / "disk").glob("*" + BLOCK_SUFFIX)) == blocks
    assert all(i.on_disk and i.tier != "disk" for i in s.list())
    for name in "abc":
        s.demote(name, "disk")
    assert sorted(p.name for p in (tmp_path / "disk").glob("*" + BLOCK_SUFFIX)) == blocks
    s.delete("a")
    s.delete("b")
    assert len(list((tmp_path / "disk").glob("*" + BLOCK_SUFFIX))) == 5  # c still references them
    s.delete("c")
    assert list((tmp_path / "disk").glob("*" + BLOCK_SUFFIX)) == []


def test_altered_or_missing_blocks_are_refused(tmp_path):
    s = store()
    put(s, "a", SHARED + tokens(3, 1))
    s.save(tmp_path)
    block = tmp_path / block_file_name(s._tiers.entries["default", "a"].blocks.keys[2])
    raw = block.read_bytes()
    block.write_bytes(raw[:-3] + bytes([raw[-3] ^ 1]) + raw[-2:])
    with pytest.raises(CorruptCapsuleError, match="checksum"):
        store().load(tmp_path)
    block.unlink()
    with pytest.raises(CorruptCapsuleError, match="missing"):
        store().load(tmp_path)


def test_orphan_blocks_are_swept_and_referenced_ones_kept(tmp_path):
    disk = tmp_path / "disk"
    s = store(disk_dir=disk)
    put(s, "a", SHARED, tier="disk")
    s.close()
    (disk / block_file_name("ab" * 32)).write_bytes(b"left by a crash between a block and its capsule file")
    # the orphan goes when a store takes the directory; a's blocks stay for its file, which this store leaves
    # unindexed until load(disk_dir) (reindex=False: by default a store indexes its files at start)
    again = store(disk_dir=disk, reindex=False)
    assert len(list(disk.glob("*" + BLOCK_SUFFIX))) == 5
    put(again, "b", SHARED + tokens(9, 3))  # shares a's blocks (not indexed yet): they must survive b's delete
    again.delete("b")
    assert again.load(disk) == 1 and again.get("a")[1]["kv"].shape[1] == 40


def test_background_cascade_writes_blocks_before_capsules(tmp_path):
    s = store(disk_dir=tmp_path, budgets={"device": 1, "host": 0})
    with pytest.raises(Exception):
        put(s, "too-big", SHARED)
    s.set_budget("device", None)
    refs = [put(s, n, SHARED + tokens(3, i))[0] for i, n in enumerate("abcd")]
    s.set_budget("device", refs[0].nbytes)  # three of them cascade to disk, written in the background
    s.flush()
    assert sorted(i.tier for i in s.list()).count("disk") == 3
    for p in tmp_path.glob("*.capsule.safetensors"):
        _, _, r = read_header_refs(p)
        assert all((tmp_path / block_file_name(k)).is_file() for k in r.keys)


def test_capsules_rm_removes_blocks_no_capsule_references(tmp_path):
    s = store()
    put(s, "a", SHARED + tokens(3, 1))
    put(s, "b", SHARED + tokens(11, 2))
    s.save(tmp_path)
    listed = {c.name: c for c in inspect_dir.scan(tmp_path)[0]}
    assert listed["b"].blocks == 6 and listed["b"].nbytes + listed["b"].shared_nbytes == s.info("b").meta.nbytes
    inspect_dir.delete(tmp_path, "b")
    assert len(list(tmp_path.glob("*" + BLOCK_SUFFIX))) == 5
    inspect_dir.delete(tmp_path, "a")
    assert list(tmp_path.glob("*" + BLOCK_SUFFIX)) == [] and not (tmp_path / capsule_file_name("default", "a")).exists()


def keep(s: CapsuleStore, toks: list[int], cost: float = 1.0) -> bool:
    meta, t = capsule("prefix", toks)
    return s.keep_prefix(meta.replace(recompute_cost_s=cost), t)


def test_prefix_entries_are_capped_evicted_first_and_never_displace_capsules():
    one = 5 * ROWS * ROW_BYTES + 64  # a 40-token checkpoint of its own prefix: 5 blocks + state
    s = store(prefix_bytes=2 * one)
    assert keep(s, tokens(40, 1)) and keep(s, tokens(40, 2))
    assert not keep(s, tokens(40, 2))  # the checkpoint exists
    assert keep(s, tokens(40, 3), cost=5.0)  # worth more per byte: displaces the cheapest one
    hit = s.match_prefix("default", FP, tokens(40, 2) + [7], ROWS)
    with s.reading_prefix(hit):  # a hit refreshes its value (GreedyDual: L + cost / bytes)
        pass
    assert not keep(s, tokens(40, 4), cost=0.001)  # worth less than every entry it would displace
    st = s.stats()["prefix"]
    assert (st["entries"], st["bytes"], st["evicted"], st["refused"]) == (2, 2 * one, 1, 1)
    assert s.list() == [] and s.stats()["device"]["count"] == 0  # never listed
    ref, _ = put(s, "named", tokens(40, 9))
    s.set_budget("device", ref.nbytes + one + one // 2)  # a named capsule's room comes from prefix entries first
    assert s.stats()["prefix"]["entries"] == 1 and s.info("named").tier == "device"
    assert keep(s, tokens(40, 10), cost=100.0)  # displaces the other prefix entry, not the named capsule
    s.set_budget("device", ref.nbytes + one // 2)
    assert s.stats()["prefix"]["entries"] == 0 and s.info("named").tier == "device"
    assert not keep(s, tokens(40, 11), cost=100.0)  # no room without displacing the named capsule
    assert s.info("named").tier == "device" and s.stats()["prefix"]["entries"] == 0


def test_prefix_match_walks_the_namespaces_own_trie():
    s = store(prefix_bytes=None)
    base = tokens(64, 5)
    assert keep(s, base[:32]) and keep(s, base[:56])
    m = s.match_prefix("default", FP, base, ROWS)
    assert (m.grid, m.shared, sorted(m.checkpoints)) == (56, 56, [32, 56])
    assert s.match_prefix("default", FP, base, ROWS, after=56).grid == 0
    assert s.match_prefix("other", FP, base, ROWS).grid == 0  # another namespace: another trie
    assert s.match_prefix("default", FP + "@w1", base, ROWS).grid == 0  # other weights: other keys
    assert s.match_prefix("default", FP, base[:56], ROWS).grid == 32  # ends at 56: needs a complete one
    with s.reading_prefix(m) as (meta, parts):
        assert meta.boundary == 56 and len(parts.blocks) == 7
    assert s.stats()["prefix"]["hits"] == 1


def test_block_runs_join_consecutive_rows_of_one_slab_only():
    from capsulert.capsule_store.blocks import SlabRow, block_runs
    a, b = {"kv": torch.arange(6.0).view(6, 1)}, {"kv": torch.arange(3.0).view(3, 1)}
    rows = [SlabRow(a, 2), SlabRow(a, 3), SlabRow(a, 5), SlabRow(b, 0), SlabRow(b, 1), SlabRow(a, 4)]
    runs = block_runs(rows)
    assert [(r.first, r.count) for r in runs] == [(0, 2), (2, 1), (3, 2), (5, 1)]  # a gap, another slab, back
    assert [r.tensors["kv"].flatten().tolist() for r in runs] == [[2.0, 3.0], [5.0], [0.0, 1.0], [4.0]]
    assert block_runs(rows[:2] + [None]) is None  # a block whose place is unknown: no runs at all
    assert block_runs([]) == ()


def test_the_chain_key_memo_gives_every_key_chain_keys_gives():
    """ChainKeys reuses the keys of the whole blocks a sequence shares with a chain it computed before (a
    repeat, an extension, a branch, a shorter look-up) and hashes the rest: the keys are chain_keys' in every
    case, under any seed, after evictions and after the caller's list changes."""
    from capsulert.capsule_store.blocks import ChainKeys, chain_keys, chain_seed

    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 5000, (64 * 40 + 17,), generator=g).tolist()
    branch = base[:64 * 25 + 3] + [7] + base[64 * 25 + 4:]  # differs inside block 25
    seeds = [chain_seed(ns, "f" * 64, 4, 64, "origin") for ns in ("a", "b")]
    memo = ChainKeys(capacity=2)
    cases = [base, base, base[:64 * 10], base + [1] * 200, branch, branch[:64 * 30], base[:63], base[:64],
             base[64:], base]
    for seed in seeds:
        for tokens in cases:
            for n in (None, len(tokens) // 64 // 2):
                assert memo.keys(seed, tokens, 64, n) == chain_keys(seed, tokens, 64, n)
    mutable = list(base)
    memo.keys(seeds[0], mutable, 64)
    mutable[5] += 1  # the memo holds its own copy of the tokens it hashed
    assert memo.keys(seeds[0], mutable, 64) == chain_keys(seeds[0], mutable, 64)
    assert memo.keys(seeds[0], base, 64) == chain_keys(seeds[0], base, 64)
    assert len(memo) == 2


def test_a_put_hashes_only_the_blocks_its_earlier_puts_did_not(monkeypatch):
    """A session snapshotted turn after turn: each put's block keys come from the store's chain memo, so only the
    blocks past the previous put's are hashed (and the first, which finds the chain); the capsules are whole."""
    from capsulert.capsule_store import blocks

    hashed = []
    extend = blocks._extend_chain

    def counting(prev, toks, rows, start, n):
        hashed.append(n - start)
        return extend(prev, toks, rows, start, n)
    monkeypatch.setattr(blocks, "_extend_chain", counting)
    s = store()
    turns = SHARED + tokens(40, 3)  # 10 blocks
    _, first = put(s, "t1", turns[:40])
    assert sum(hashed) == 5
    hashed.clear()
    _, second = put(s, "t2", turns)
    assert sum(hashed) == 1 + 5  # the first block finds the chain; blocks 5-9 are new
    assert exact(s.get("t1")[1], first) and exact(s.get("t2")[1], second)


@pytest.mark.parametrize("indices", [[], [0], list(range(5)), list(range(3, 3 + 2 * 7 + 1)), list(range(16)),
                                     [0, 1, 2, 5, 6, 9], [4, 6, 7, 8, 9, 10, 11, 12, 13, 20]],
                         ids=["none", "one", "short-run", "runs-cut-at-the-limit", "two-whole-slabs", "gaps",
                              "gap-then-long-run"])
def test_slab_ranges_cut_consecutive_indices_into_runs_of_at_most_the_limit(indices):
    """slab_ranges (the slabs a put allocates) takes a fast path for one consecutive run of indices, a new
    chain's blocks; whichever path runs, the ranges are those of a plain walk over the indices."""
    from capsulert.capsule_store.moves import slab_ranges

    limit = 7
    want: list[tuple[int, int]] = []
    for i in indices:
        if want and want[-1][0] + want[-1][1] == i and want[-1][1] < limit:
            want[-1] = (want[-1][0], want[-1][1] + 1)
        else:
            want.append((i, 1))
    assert slab_ranges(indices, limit) == want
    assert [i for first, count in want for i in range(first, first + count)] == indices


def test_a_plans_enter_gives_the_bytes_it_adds_to_the_tier():
    """Plan.enter returns what the capsule adds to its tier: its own bytes and the blocks the tier lacks
    (a put checks its budget against it); entering again adds only the own bytes."""
    s = store()
    put(s, "a", tokens(5 * ROWS + 3))
    tiers = s._tiers
    e = tiers.entries[("default", "a")]
    plan = tiers.new_plan()
    before = plan.used["host"]
    added = plan.enter("host", e.own_nbytes, e.blocks)
    assert added == e.own_nbytes + 5 * ROWS * ROW_BYTES + e.blocks.state_nbytes
    assert plan.used["host"] - before == added
    assert plan.enter("host", e.own_nbytes, e.blocks) == e.own_nbytes  # its blocks are counted there already
