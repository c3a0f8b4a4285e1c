"""The grid-state block: a canonical capsule's recurrent and conv state at its grid point G (a pure function
of tokens[:G], like the KV rows [0, G)) is one more refcounted block, keyed by the prefix, so capsules of the
same prefix hold one copy. Engine tests (default model, real sessions: best-of-8 branches of one context)
check sharing, bitwise restores, deletes, pins and tiers, save/load, namespaces and origins, and capsule
files loaded back (ImportFromFile, the pinned-capsule reload); synthetic store tests check the disk side
(crash-safe write order, orphan sweep, `capsules rm`, altered headers)."""
from __future__ import annotations

import pytest
import torch

from capsulert.engine.engine import GRID
from capsulert.engine.slot_views import capsule_views, tail_views
from capsulert.capsule_store import (CapsuleMeta, CapsuleStore, capsule_file_name, read_capsule_origin,
                                     write_capsule_with_meta)
from capsulert.capsule_store.format import inspect as inspect_dir
from capsulert.capsule_store.format.blockfiles import BLOCK_SUFFIX, block_file_name
from capsulert.capsule_store.blocks import BlockLayout, state_key
from capsulert.capsule_store.format.names import FILE_SUFFIX
from capsulert.capsule_store.format.headers import parse_file, read_header_refs
from capsulert.errors import CorruptCapsuleError
from capsulert.protocol.sampling import SamplingParams
from capsulert.engine.state import LAYOUT_VERSION

CHUNK = GRID  # canonical state and prefix blocks every 64 tokens, whatever the prefill_chunk (128 here)
BLOCKS = 256 // CHUNK + 1  # a context of 256 to 319 tokens: its KV blocks [0, 256) and one grid-state block


def toks(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 4096, (n,), generator=g).tolist()


def slot_bytes(eng, s) -> dict[str, torch.Tensor]:
    """What a snapshot of s stores (copies of the slot's bytes)."""
    P = len(s.tokens)
    G = P // CHUNK * CHUNK
    end = eng.table.replayable_end(s)
    views = {**capsule_views(eng.state, s.slot, P, G), **tail_views(eng.state, s.slot, end - G)}
    if G < end < P and eng.state.keeps_tail_seed:  # decoded tokens follow the tail: the MTP head's seed at its end
        views["tail_hidden"] = eng.state.tail_hidden[s.slot]
    return {k: v.clone() for k, v in views.items()}


def snap(eng, s, name: str, namespace: str = "default") -> dict[str, torch.Tensor]:
    want = slot_bytes(eng, s)
    s.snapshot(name, namespace=namespace)
    return want


def assert_restores(eng, name: str, want: dict[str, torch.Tensor], namespace: str = "default") -> None:
    """The capsule reads back (get) and restores into a slot bitwise as it was snapshotted."""
    got = eng.store.get(name, namespace)[1]
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    r = eng.restore(name, namespace)
    try:
        mine = slot_bytes(eng, r)
        if "tail_in" in want:  # written back whatever numerics made them (replayed only under their own)
            mine.update(tail_views(eng.state, r.slot, want["tail_in"].shape[1]))
        if "tail_hidden" in want:  # and so is the MTP head's seed at the tail's end
            mine["tail_hidden"] = eng.state.tail_hidden[r.slot]
        for k in want:
            assert torch.equal(mine[k], want[k]), k
        if "ssm_grid" not in want:  # on the grid the slot's grid checkpoint is the live state
            assert torch.equal(eng.state.ssm_grid[:, r.slot], want["ssm"])
    finally:
        r.close()


def branches(eng, ctx_len: int, n: int = 8, namespace: str = "default") -> dict[str, dict]:
    """A context capsule `ctx` and n branches forked from it, each a few sampled tokens further (all with
    the grid point 256): what each one stored."""
    s = eng.open()
    s.append(toks(ctx_len, 1))
    want = {"ctx": snap(eng, s, "ctx", namespace)}
    s.close()
    for i in range(n):  # one at a time: the fixture's engine has 4 slots
        b = eng.fork("ctx", 1, namespace)[0]
        b.generate(1 + i, SamplingParams(temperature=0.8, seed=i, ignore_eos=True))
        want[f"b{i}"] = snap(eng, b, f"b{i}", namespace)
        b.close()
    return want


def state_of(eng, name: str, namespace: str = "default") -> str:
    return eng.store._tiers.entries[namespace, name].blocks.state


def grid_state_nbytes(eng) -> int:
    """The recurrent and conv state at the grid point and, with an MTP head, the head's seed there."""
    seed = eng.state.grid_hidden[0].nbytes if eng.runner.has_mtp else 0
    return eng.state.ssm[:, 0].nbytes + eng.state.conv[:, 0].nbytes + seed


# ------------------------------------------------------------------------------------------- engine
@pytest.mark.parametrize("ctx_len", [256, 300])  # the context on its grid point (live state) or past it
def test_branches_share_one_grid_state_block_and_restore_bitwise(engine, ctx_len):
    eng = engine
    want = branches(eng, ctx_len)
    key = state_of(eng, "b0")
    assert key is not None and {state_of(eng, n) for n in want} == {key}
    pool = eng.store._tiers.pools["device"]
    assert pool.records[key].refs == 9 and pool.records[key].nbytes == grid_state_nbytes(eng)
    st = eng.store.stats()
    assert st["blocks"]["device"] == 256 // CHUNK + 1  # the KV blocks [0, 256) and one grid-state block
    infos = eng.store.list()
    shared = infos[0].shared_nbytes
    assert {(i.blocks, i.shared_nbytes) for i in infos} == {(BLOCKS, shared)}
    assert st["device"]["bytes"] == sum(i.nbytes for i in infos) + shared  # the unique bytes: each block once
    # every branch holds alone only what it computed past the grid point: its live state, last hidden
    # state, KV rows [256, P) and, past the context's prefilled tail, that tail's exact-replay rows (kept
    # where the engine replays tails; with an MTP head a branch that decoded past the tail keeps the head's seed
    # at the tail's end too), the MTP head's rows [256, P) too
    tails = {"tail_in", "tail_gates"} if ctx_len > 256 and eng.runner.tail_replay else set()
    own = {"kv_k", "kv_v", "ssm", "conv", "last_hidden"} | set(eng.state.layout.block_tensors)
    for n in want:
        if n != "ctx" or ctx_len != 256:
            kept = tails | ({"tail_hidden"} if tails and n != "ctx" and eng.runner.has_mtp else set())
            assert set(eng.store._tiers.entries["default", n].tensors) == own | kept, n
    for name, w in want.items():
        assert_restores(eng, name, w)
    for name in ["ctx"] + [f"b{i}" for i in range(7)]:
        eng.store.delete(name)
    assert pool.records[key].refs == 1 and eng.store.stats()["blocks"]["device"] == BLOCKS
    assert_restores(eng, "b7", want["b7"])
    r = eng.restore("b7")  # restore + append over the next grid point == a cold prefill (canonical grid state)
    cold = eng.open(namespace=None)
    more = toks(150, 9)
    assert torch.equal(r.append(more), cold.append(list(r.tokens[:-len(more)]) + more))
    r.close()
    cold.close()
    eng.store.delete("b7")
    assert eng.store.stats()["device"]["bytes"] == 0 and eng.store.stats()["blocks"]["device"] == 0


def test_pinned_capsule_pins_its_state_block_across_tiers(make_engine, tmp_path):
    disk = tmp_path / "disk"
    eng = make_engine(disk_dir=str(disk))
    want = branches(eng, 300, n=4)
    eng.store.delete("ctx")
    del want["ctx"]
    key = state_of(eng, "b0")
    eng.store.pin("b0")
    eng.store.demote("b1", "host")
    eng.store.demote("b2", "disk")
    eng.store.demote("b3", "disk")
    assert eng.store.stats()["blocks"] == {"device": BLOCKS, "host": BLOCKS, "disk": BLOCKS}  # each tier holds the state once
    assert eng.store._tiers.pools["disk"].records[key].refs == 2 and (disk / block_file_name(key)).is_file()
    assert len(list(disk.glob("*" + BLOCK_SUFFIX))) == BLOCKS
    eng.store.promote("b1", "device")
    eng.store.set_budget("device", eng.store.info("b0").meta.nbytes)  # room for the pinned b0 alone
    assert {i.name: i.tier for i in eng.store.list()} == {"b0": "device", "b1": "host", "b2": "disk", "b3": "disk"}
    assert eng.store.stats()["device"]["bytes"] == eng.store.info("b0").meta.nbytes  # its blocks stay with the pin
    assert eng.store._tiers.pools["device"].records[key].refs == 1
    for name, w in want.items():  # b1..b3 through transient device copies: the pin fills the gpu tier
        assert_restores(eng, name, w)
    eng.store.set_budget("device", None)
    eng.store.promote("b3", "host")
    assert (disk / block_file_name(key)).is_file()  # b2 still references it on disk, and b3's disk copy
    eng.store.delete("b2")
    assert (disk / block_file_name(key)).is_file()  # promotion copies: b3's file and blocks stay on disk
    eng.store.delete("b3")
    assert list(disk.glob("*" + BLOCK_SUFFIX)) == []
    want.pop("b3")
    eng.store.promote("b1", "device")
    assert eng.store.stats()["blocks"] == {"device": BLOCKS, "host": 0, "disk": 0}
    for name in ("b0", "b1"):
        assert_restores(eng, name, want[name])
    eng.close()


def test_directory_save_and_load_hold_the_state_block_once(make_engine, tmp_path):
    eng = make_engine()
    want = branches(eng, 300)
    key = state_of(eng, "b0")
    saved = tmp_path / "saved"
    assert eng.store.save(saved) == 9
    blocks = sorted(p.name for p in saved.glob("*" + BLOCK_SUFFIX))
    assert len(blocks) == BLOCKS and block_file_name(key) in blocks
    for p in saved.glob("*" + FILE_SUFFIX):
        _, md, _ = parse_file(p)
        assert md["capsulert.format"] == "3" and read_header_refs(p)[2].state == key
    listed = inspect_dir.scan(saved)[0]
    assert {(c.blocks, c.nbytes + c.shared_nbytes == eng.store.info(c.name).meta.nbytes) for c in listed} == {(BLOCKS, True)}
    fresh = make_engine()
    assert fresh.store.load(saved) == 9
    assert fresh.store.stats()["blocks"]["host"] == BLOCKS
    for name, w in want.items():
        assert_restores(fresh, name, w)
    fresh.close()
    # the disk tier across a restart: the store that takes the directory keeps the state block file (a capsule
    # file references it) and indexes the files in place, at start
    disk = tmp_path / "disk"
    first = make_engine(disk_dir=str(disk))
    first.store.load(saved)
    for name in want:
        first.store.demote(name, "disk")
    first.close()
    again = make_engine(disk_dir=str(disk))
    assert (disk / block_file_name(key)).is_file()
    assert again.store.reindexed == 9 and again.store.stats()["blocks"]["disk"] == BLOCKS
    assert again.store.load(disk) == 0  # all of them indexed already
    for name, w in want.items():
        assert_restores(again, name, w)
    again.close()
    state = saved / block_file_name(key)  # an altered or missing state block is refused
    raw = state.read_bytes()
    state.write_bytes(raw[:-3] + bytes([raw[-3] ^ 1]) + raw[-2:])
    with pytest.raises(CorruptCapsuleError, match="checksum"):
        make_engine().store.load(saved)
    state.unlink()
    with pytest.raises(CorruptCapsuleError, match="missing"):
        make_engine().store.load(saved)


def test_other_namespaces_or_origins_never_share_the_state_block(engine):
    eng = engine
    ctx = toks(300, 3)
    want = {}
    for ns in ("a", "b"):
        s = eng.open(namespace=ns)
        s.append(ctx)
        want[ns] = snap(eng, s, "c", ns)
        s.close()
    assert state_of(eng, "c", "a") != state_of(eng, "c", "b")  # the namespace is in the key
    assert eng.store.stats()["blocks"]["device"] == 2 * BLOCKS
    meta, full = eng.store.get("c", "a")
    eng.store.put(meta.replace(name="elsewhere"), full, origin="cuda:another-device")  # another origin: whole
    eng.store.put(meta.replace(name="unknown"), full)  # no origin: whole
    assert eng.store.info("elsewhere", "a").blocks == 0 and eng.store.info("unknown", "a").blocks == 0
    assert eng.store.stats()["blocks"]["device"] == 2 * BLOCKS
    for name in ("c", "elsewhere", "unknown"):
        assert_restores(eng, name, want["a"], "a")
    assert_restores(eng, "c", want["b"], "b")


def test_a_capsule_file_of_the_same_origin_shares_its_blocks_when_loaded(engine, tmp_path):
    eng = engine
    want = branches(eng, 300, n=2)
    key = state_of(eng, "b0")
    path = eng.store.export_file("b0", tmp_path / "export")  # one self-contained file, recording its origin
    _, md, _ = parse_file(path)
    assert md["capsulert.format"] == "1" and md["capsulert.origin"] == eng.store.block_origin
    assert list((tmp_path / "export").glob("*" + BLOCK_SUFFIX)) == []
    eng.store.delete("b0")
    before = eng.store.stats()
    # ImportFromFile after a disk migration: the origin read back is passed to put
    meta, tensors, origin = read_capsule_origin(path, eng.fingerprint, LAYOUT_VERSION)
    assert origin == eng.store.block_origin
    eng.store.put(meta, tensors, origin=origin)
    assert eng.store.info("b0").blocks == BLOCKS and state_of(eng, "b0") == key
    assert eng.store.stats()["blocks"] == before["blocks"]
    assert eng.store.stats()["device"]["bytes"] == before["device"]["bytes"] + eng.store.info("b0").nbytes
    assert_restores(eng, "b0", want["b0"])
    # the pinned-capsule reload after a worker restart: load of the directory
    eng.store.delete("b0")
    assert eng.store.load(tmp_path / "export") == 1
    assert eng.store.info("b0").tier == "host" and eng.store.info("b0").blocks == BLOCKS and state_of(eng, "b0") == key
    assert_restores(eng, "b0", want["b0"])
    # a file that records no origin (written before), or another origin, stays whole
    old = tmp_path / "old"
    write_capsule_with_meta(old, meta.replace(name="no-origin"), tensors)
    write_capsule_with_meta(old, meta.replace(name="other-origin"), tensors, origin="cuda:another-device")
    assert eng.store.load(old) == 2
    for name in ("no-origin", "other-origin"):
        assert eng.store.info(name).blocks == 0
        assert_restores(eng, name, want["b0"])


# -------------------------------------------------------------------------------- synthetic store
FP, ROWS, ORIGIN = "fp-grid-state", 8, "test-origin"
LAYOUT = BlockLayout(("kv",), token_dim=1, origin=ORIGIN, complete="hidden", grid_state=(("st", "st_grid"),))


def capsule(name: str, t: list[int]):
    """Canonical synthetic bytes: KV row i and the grid state depend only on the tokens before them."""
    G = len(t) // ROWS * ROWS
    kv = torch.stack([torch.full((2, 4), float(sum(t[:i + 1]) % 9973)) for i in range(len(t))], dim=1)
    tensors = {"kv": kv, "st": torch.full((16,), float(sum(t) % 997)), "hidden": torch.full((4,), float(len(t)))}
    if G != len(t):
        tensors["st_grid"] = torch.full((16,), float(sum(t[:G]) % 997))
    nbytes = sum(x.numel() * x.element_size() for x in tensors.values())
    meta = CapsuleMeta.build(name=name, tokens=t, grid_pos=G, fingerprint=FP, layout_version=1, grid=ROWS,
                             nbytes=nbytes)
    return meta, tensors


def store(**kw) -> CapsuleStore:
    return CapsuleStore(device="cpu", fingerprint=FP, layout_version=1, blocks=LAYOUT, **kw)


BASE = toks(24, 5)  # 3 blocks


def put(s: CapsuleStore, name: str, t: list[int], **kw):
    meta, tensors = capsule(name, t)
    s.put(meta, tensors, origin=ORIGIN, **kw)
    return tensors


def exact(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_on_and_off_grid_capsules_share_the_state_at_their_grid_point():
    s = store()
    want = {"on": put(s, "on", BASE), "off1": put(s, "off1", BASE + [1, 2]), "off2": put(s, "off2", BASE + [3])}
    keys = {n: s._tiers.entries["default", n].blocks for n in want}
    assert {r.state for r in keys.values()} == {state_key(keys["on"].keys[-1])}
    assert s.stats()["blocks"]["device"] == 4  # 3 KV blocks + 1 grid-state block
    assert set(s._tiers.entries["default", "on"].tensors) == {"kv", "hidden"}  # its live state is the grid state
    assert set(s._tiers.entries["default", "off1"].tensors) == {"kv", "st", "hidden"}  # live state: its own
    for n, t in want.items():
        assert exact(s.get(n)[1], t)
    short = put(s, "short", BASE[:5])  # shorter than a block: no grid point past 0, nothing shared
    assert s._tiers.entries["default", "short"].blocks.state is None and exact(s.get("short")[1], short)


def test_state_blocks_on_disk_crash_order_orphans_and_rm(tmp_path):
    disk = tmp_path / "disk"
    s = store(disk_dir=disk, budgets={"host": 0})
    want = {n: put(s, n, BASE + [i + 1]) for i, n in enumerate("abcd")}
    key = s._tiers.entries["default", "a"].blocks.state
    s.set_budget("device", s.info("a").meta.nbytes)  # three cascade to disk, written in the background
    s.flush()
    assert len(list(disk.glob("*" + FILE_SUFFIX))) == 3 and s.stats()["blocks"]["disk"] == 4
    on_disk = [i.name for i in s.list() if i.tier == "disk"]
    for p in disk.glob("*" + FILE_SUFFIX):  # every capsule file finds every block it names
        _, _, r = read_header_refs(p)
        assert r.state == key and all((disk / block_file_name(k)).is_file() for k in r.all_keys)
    s.close()
    (disk / block_file_name("cd" * 32)).write_bytes(b"an orphan left by a crash")
    again = store(disk_dir=disk, reindex=False)  # the orphan goes; the referenced state block stays, unindexed
    named = {k for p in disk.glob("*" + FILE_SUFFIX) for k in read_header_refs(p)[2].all_keys}
    assert key in named and sorted(p.name for p in disk.glob("*" + BLOCK_SUFFIX)) == sorted(map(block_file_name, named))
    assert again.load(disk) == 3
    for n in on_disk:
        assert exact(again.get(n)[1], want[n])
    again.save(tmp_path / "saved")
    again.close()
    for n in on_disk[:2]:
        inspect_dir.delete(tmp_path / "saved", n)
    assert (tmp_path / "saved" / block_file_name(key)).is_file()  # the last one still references it
    inspect_dir.delete(tmp_path / "saved", on_disk[2])
    assert list((tmp_path / "saved").glob("*" + BLOCK_SUFFIX)) == []


def test_a_capsule_file_naming_a_foreign_state_block_is_refused(tmp_path):
    s = store()
    put(s, "a", BASE + [1])
    put(s, "b", toks(24, 6) + [1])
    s.save(tmp_path)
    a = tmp_path / capsule_file_name("default", "a")
    raw = a.read_bytes()
    ka, kb = (s._tiers.entries["default", n].blocks.state for n in "ab")
    a.write_bytes(raw.replace(ka.encode(), kb.encode()))  # a's header now names b's state block
    with pytest.raises(CorruptCapsuleError, match="grid-state"):
        store().load(tmp_path)
