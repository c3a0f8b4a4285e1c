"""Prefix sharing and automatic prefix reuse at the engine level (default model, real sessions).

Every reuse is compared with a cold prefill of the same tokens on the same engine (a session opened with
namespace=None takes no part in the prefix cache): next-token logits and the slot's whole state (KV rows,
recurrent and conv state, grid checkpoint, last hidden state) with torch.equal, and a greedy continuation.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from safetensors.torch import load_file

from capsulert.errors import StaleSessionError
from capsulert.sessions.local import AsyncEngine
from capsulert.engine.engine import GRID
from capsulert.protocol.sampling import SamplingParams
from capsulert.protocol.requests import Close
from tests.models import MODELS
from tests.worker.pieces import count_pieces

CHUNK = GRID  # checkpoints every 64 tokens (the fixture prefills in pieces of 128)
LONG = SamplingParams(ignore_eos=True)  # greedy, through the grid points whatever the random model emits


@pytest.fixture
def cached(make_engine):
    return make_engine(prefix_cache=True)


def toks(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 4096, (n,), generator=g).tolist()


def slot_state(eng, s) -> dict[str, torch.Tensor]:
    st, slot, P = eng.state, s.slot, len(s.tokens)
    names = ("ssm", "conv", "ssm_grid", "conv_grid", "last_hidden") + (("grid_hidden",) if st.layout.mtp_layers else ())
    out = {k: st.slot_view(k, slot).clone() for k in names}
    out.update({k: st.buffers[k][:, slot, :P].clone() for k in st.layout.block_tensors}, pos=st.pos[slot].clone())
    return out


def assert_cold_equal(eng, s, generate: int = 8) -> None:
    """s (however it was made) is bitwise a cold prefill of its tokens, and continues like one."""
    cold = eng.open(namespace=None)
    try:
        want = cold.append(list(s.tokens))
        assert torch.equal(s.logits(), want)
        mine, ref = slot_state(eng, s), slot_state(eng, cold)
        for k in ref:
            assert torch.equal(mine[k], ref[k]), k
        assert s.generate(generate, LONG) == cold.generate(generate, LONG)
    finally:
        cold.close()


def hits(eng) -> tuple[int, int]:
    p = eng.store.stats()["prefix"]
    return p["hits"], p["hit_tokens"]


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_reuse_is_bitwise_a_cold_prefill(cached):
    eng = cached
    base = toks(700, 1)
    s = eng.open(prompt=base[:500])  # keeps its prompt's last grid point (448)
    s.close()
    for prompt in (base[:600], base[:448], base[:449], base[:500], base + toks(30, 2)):
        before = hits(eng)
        r = eng.open(prompt=prompt)
        assert hits(eng)[0] == before[0] + 1, len(prompt)  # every one of them starts from a checkpoint
        assert_cold_equal(eng, r)
        r.close()
    assert eng.store.list() == []  # anonymous entries are never listed


def test_a_checkpoint_kept_inside_a_piece_gives_the_logits_of_its_grid_point(cached, monkeypatch):
    """A prefill piece crosses its last grid point, and the append is not cut there: the checkpoint kept at 448
    takes the hidden state before it from the piece, so a prompt of exactly 448 tokens is served from it, with
    the logits of a cold prefill, and the append ran in one piece."""
    eng = cached
    base = toks(500, 9)
    with monkeypatch.context() as m:
        passes = count_pieces(eng, m)
        s = eng.open(prompt=base)  # pieces of 128: the last one, [384, 500), crosses 448
    assert passes == [128, 128, 128, 116], passes
    s.close()
    before = hits(eng)
    r = eng.open(prompt=base[:448])
    assert hits(eng) == (before[0] + 1, before[1] + 448)  # all of it from the checkpoint, nothing re-run
    assert_cold_equal(eng, r)


def test_append_to_a_live_session_reuses_past_its_own_grid_point(cached):
    eng = cached
    base = toks(900, 3)
    eng.open(prompt=base[:800]).close()  # keeps 768
    s = eng.open(prompt=base[:200])
    before = hits(eng)
    s.append(base[200:800])  # the cached checkpoint at 768 is past the session's own grid point
    assert hits(eng)[1] - before[1] == 768 - 192  # from the session's own grid point, 192
    assert_cold_equal(eng, s)


def test_reuse_after_decode_crossed_a_grid_point(cached):
    eng = cached
    s = eng.open(prompt=toks(200, 4))
    s.generate(120, LONG)  # decode crosses 256 and 320: the engine re-derives them through the prefill path
    history = list(s.tokens)
    s.close()  # keeps the last grid point, 320, made by decode
    before = hits(eng)
    r = eng.open(prompt=history + toks(50, 5))
    assert hits(eng)[1] - before[1] == 320
    assert_cold_equal(eng, r)


def test_reuse_after_fork(cached):
    eng = cached
    s = eng.open(prompt=toks(300, 6))
    s.snapshot("c")
    s.close()
    branches = eng.fork("c", 2)
    histories = []
    for i, b in enumerate(branches):
        b.append(toks(90 + 40 * i, 7 + i))
        b.generate(30, LONG)
        histories.append(list(b.tokens))
        b.close()
    for i, h in enumerate(histories):
        r = eng.open(prompt=h + toks(20, 20 + i))
        assert_cold_equal(eng, r)
        r.close()


def test_reuse_from_named_capsules_after_tier_moves_and_a_disk_round_trip(make_engine, tmp_path):
    eng = make_engine(prefix_cache=True, disk_dir=str(tmp_path / "disk"))
    base = toks(800, 8)
    s = eng.open(prompt=base[:700], namespace=None)  # no anonymous entries: only the named capsule serves
    s.snapshot("named")  # off the grid: its grid checkpoint is at 640
    s.close()
    for tier in ("host", "disk"):
        eng.store.demote("named", tier)
        before = hits(eng)
        r = eng.open(prompt=base[:690], namespace="default")  # past 640, short of the next grid point
        assert hits(eng)[1] - before[1] == 640
        assert_cold_equal(eng, r)
        r.close()
    eng.store.demote("named", "disk")
    eng.store.save(tmp_path / "saved")
    other = make_engine(prefix_cache=True)  # another store of the same numerics loads and serves it
    assert other.store.load(tmp_path / "saved") == 1
    r = other.open(prompt=base[:660])
    assert hits(other) == (1, 640)
    assert_cold_equal(other, r)


def test_namespaces_isolate_the_prefix_cache(cached):
    eng = cached
    prompt = toks(400, 9)
    eng.open(prompt=prompt, namespace="acme").close()
    assert hits(eng) == (0, 0)
    g = eng.open(prompt=prompt, namespace="globex")  # the same prompt in another namespace: no hit
    assert hits(eng) == (0, 0)
    assert_cold_equal(eng, g)
    g.close()
    a = eng.open(prompt=prompt, namespace="acme")
    assert hits(eng)[0] == 1
    a.close()
    n = eng.open(prompt=prompt, namespace=None)  # no namespace: no part in the cache
    assert hits(eng)[0] == 1
    n.close()


def test_named_capsules_share_prefix_blocks_and_refcounts(engine):
    eng = engine  # prefix cache off: sharing between named capsules is always on
    prefix = toks(1024, 10)
    refs, tails = [], []
    for i in range(20):
        s = eng.open()
        s.append(prefix + toks(40, 100 + i))
        refs.append(s.snapshot(f"c{i}"))
        tails.append(s.logits())
        s.close()
    st = eng.store.stats()
    infos = eng.store.list()
    shared = infos[0].shared_nbytes  # the prefix's KV blocks and its grid-state block: the same for all 20
    assert {(i.blocks, i.shared_nbytes) for i in infos} == {(1024 // CHUNK + 1, shared)}
    unique = sum(i.nbytes for i in infos) + shared
    assert st["device"]["bytes"] == unique  # each block once: ~1x the unique bytes
    assert sum(r.nbytes for r in refs) - unique == 19 * shared  # per-capsule copies held 19 more
    for i in range(19):
        eng.store.delete(f"c{i}")  # the shared blocks stay for the last one
    assert eng.store.stats()["blocks"]["device"] == 1024 // CHUNK + 1
    r = eng.restore("c19")
    assert torch.equal(r.logits(), tails[19])
    assert_cold_equal(eng, r)
    r.close()
    eng.store.delete("c19")
    assert eng.store.stats()["device"]["bytes"] == 0 and eng.store.stats()["blocks"]["device"] == 0


def test_pinned_capsule_pins_its_blocks(engine):
    eng = engine
    prefix = toks(512, 11)
    s = eng.open()
    s.append(prefix + toks(10, 12))
    pinned = s.snapshot("pinned", pin=True)
    s.close()
    s = eng.open()
    s.append(prefix + toks(20, 13))
    s.snapshot("other")
    want = s.logits()
    s.close()
    eng.store.set_budget("device", pinned.nbytes)  # the unpinned one leaves; the shared blocks stay with the pin
    assert {i.name: i.tier for i in eng.store.list()} == {"pinned": "device", "other": "host"}
    assert eng.store.stats()["device"]["bytes"] == pinned.nbytes
    r = eng.restore("other")  # a transient device copy: the pin fills the gpu tier
    assert torch.equal(r.logits(), want)


def test_sessions_restored_from_foreign_capsules_are_not_served_nor_kept(cached, tmp_path):
    eng = cached
    s = eng.open(prompt=toks(300, 14), namespace=None)
    s.snapshot("mine")
    ref_meta, full = eng.store.get("mine")
    eng.store.put(ref_meta.replace(name="foreign"), full)  # no origin (an import): held whole, not canonical
    s.close()
    r = eng.restore("foreign")
    kept = eng.store.stats()["prefix"]["kept"]
    r.append(toks(200, 15))  # crosses 384: a canonical session would keep it
    r.snapshot("from-foreign")
    r.close()
    assert eng.store.stats()["prefix"]["kept"] == kept
    assert eng.store.info("from-foreign").blocks == 0  # its bytes are never shared


def test_second_turn_through_the_scheduler_hits_and_matches(cached):
    eng = cached

    async def chat():
        async with AsyncEngine(eng) as aeng:
            system = toks(300, 16)
            s = await aeng.open()
            first = await s.turn(system + toks(20, 17), 24, LONG)
            history = system + toks(20, 17) + list(first) + toks(15, 18)
            await aeng.submit(Close(s.id))
            t = await aeng.open()
            second = await t.turn(history, 24, LONG)
            return first, second, history

    first, second, history = asyncio.run(chat())
    assert first.cached_tokens == 0 and second.cached_tokens >= 256
    cold = eng.open(namespace=None)
    cold.append(history)
    assert list(second) == list(cold.generate(24, LONG))


def test_a_weight_update_retires_the_cache(cached, default_model_dir):
    eng = cached
    prompt = toks(400, 19)
    eng.open(prompt=prompt).close()
    live = eng.open(prompt=prompt[:300])
    weights = load_file(str(default_model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    eng.update_weights({k: (v + 0.05 * torch.randn(v.shape, generator=g) * v.abs().mean()) for k, v in weights.items()})
    before, kept = hits(eng), eng.store.stats()["prefix"]["kept"]
    with pytest.raises(StaleSessionError):  # its state would mix both weights: refused, neither served nor kept
        live.append(toks(200, 20))
    live.close()
    assert eng.store.stats()["prefix"]["kept"] == kept
    r = eng.open(prompt=prompt)  # keys carry the weights version: the old entries never match
    assert hits(eng) == before
    assert_cold_equal(eng, r)
