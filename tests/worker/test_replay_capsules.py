"""Replay capsules (snapshot mode "replay"): a capsule that keeps only its state at the last grid point G
and its tokens, and rebuilds the rest on restore by re-running tokens[G:] the way they were made. Every
restore must give the slot bitwise the bytes the session held at the snapshot (KV rows [0, P), live and
grid recurrent and conv state, last hidden state) and the same continuation, however the tokens past G came
(decode alone, an off-grid prompt, appends between generates, decode across a grid point, a prompt shorter
than one chunk), batched with other replays or not, from every tier and across a save/load."""
from __future__ import annotations

import asyncio

import pytest
import torch

from capsulert.engine.engine import GRID
from capsulert.engine.slot_views import grid_views
from capsulert.capsule_store import CapsuleMeta
from capsulert.capsule_store.format.meta import meta_from_json, meta_to_json
from capsulert.errors import IncompatibleCapsuleError, UnsupportedStateModeError
from capsulert.protocol.sampling import SamplingParams
from tests.models import MODELS

CHUNK = GRID  # canonical state and prefix blocks every 64 tokens, whatever the prefill_chunk (128 here)
SAMPLED = SamplingParams(temperature=0.9, seed=7)


def toks(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 4096, (n,), generator=g).tolist()


def slot_state(eng, s) -> dict[str, torch.Tensor]:
    """Every byte of the slot a forward pass reads for the session (copies)."""
    st, P = eng.state, len(s.tokens)
    return {"kv_k": st.kv_k[:, s.slot, :P].clone(), "kv_v": st.kv_v[:, s.slot, :P].clone(),
            "ssm": st.ssm[:, s.slot].clone(), "conv": st.conv[:, s.slot].clone(),
            "ssm_grid": st.ssm_grid[:, s.slot].clone(), "conv_grid": st.conv_grid[:, s.slot].clone(),
            "last_hidden": st.last_hidden[s.slot].clone(), "pos": st.pos[s.slot].clone()}


def assert_same_state(eng, s, want: dict[str, torch.Tensor]) -> None:
    got = slot_state(eng, s)
    for k in want:
        assert torch.equal(got[k], want[k]), k


# how the tokens past the last grid point were made: (prompt length, [generate n | append n] ...)
HISTORIES = {
    "decode from the grid": (256, [("gen", 20)]),
    "decode after an off-grid prompt": (290, [("gen", 20)]),
    "appends between generates": (300, [("gen", 9), ("append", 5), ("gen", 7)]),
    "decode across a grid point": (240, [("gen", 40)]),
    "shorter than one chunk": (50, [("gen", 12)]),
    "appends only": (200, [("append", 30)]),
}


def make_history(eng, prompt_len: int, steps, seed: int = 0):
    s = eng.open()
    s.append(toks(prompt_len, seed))
    for i, (kind, n) in enumerate(steps):
        if kind == "gen":
            s.generate(n, SAMPLED)
        else:
            s.append(toks(n, 100 + i))
    return s


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
@pytest.mark.parametrize("history", list(HISTORIES), ids=list(HISTORIES))
def test_a_replay_capsule_restores_bitwise_what_the_session_held(make_engine, history):
    eng = make_engine()
    s = make_history(eng, *HISTORIES[history])
    P, G = len(s.tokens), len(s.tokens) // CHUNK * CHUNK
    assert P != G
    want = slot_state(eng, s)
    ref = s.snapshot("r", mode="replay")
    info = eng.store.info("r")
    assert info.meta.replay_from == G and info.meta.boundary == P and info.meta.grid_pos == G and ref.boundary == P
    # it holds the state at G only: no KV row past G, no live state, no last hidden state
    assert ref.nbytes == sum(t.numel() * t.element_size() for t in grid_views(eng.state, s.slot, G).values())
    r = eng.restore("r")
    assert r.tokens == s.tokens
    assert_same_state(eng, r, want)
    assert list(r.generate(10, SAMPLED)) == list(s.generate(10, SAMPLED))
    assert_same_state(eng, r, slot_state(eng, s))  # and the state after it, decode-made, too


def test_on_the_grid_a_replay_snapshot_is_a_full_capsule(engine):
    s = engine.open()
    s.append(toks(2 * CHUNK, 1))
    s.snapshot("g", mode="replay")
    assert engine.store.info("g").meta.replay_from is None  # nothing to re-run at a grid point


def test_branches_kept_as_replay_capsules_share_the_context_and_replay_batched(make_engine):
    eng = make_engine(slots=12)
    ctx = eng.open()
    ctx.append(toks(8 * CHUNK, 2))
    ctx.snapshot("ctx")
    full_bytes = eng.store.stats()["device"]["bytes"]
    wants = {}
    for i, b in enumerate(eng.fork("ctx", 8)):
        b.generate(16, SamplingParams(temperature=0.9, seed=i))
        wants[f"b{i}"] = (list(b.tokens), slot_state(eng, b))
        b.snapshot(f"b{i}", mode="replay")
        b.close()
    # 8 branches of the context add only their tokens: the KV and the grid state are the context's
    assert eng.store.stats()["device"]["bytes"] == full_bytes
    # a fork of a replay capsule re-runs its tokens for all branches in batched decode steps
    for s in eng.fork("b3", 3):
        assert s.tokens == wants["b3"][0]
        assert_same_state(eng, s, wants["b3"][1])
        s.close()
    restored = [eng.restore(f"b{i}") for i in range(8)]
    for i, s in enumerate(restored):
        assert_same_state(eng, s, wants[f"b{i}"][1])


@pytest.mark.parametrize("tail", [200, 128], ids=["off the grid", "on the grid"])
def test_agents_on_a_shared_prompt_replay_from_its_state_and_hold_only_their_tokens(make_engine, tail):
    eng = make_engine(slots=6)
    base = eng.open()
    base.append(toks(8 * CHUNK, 8))
    base.snapshot("base")
    shared = eng.store.stats()["device"]["bytes"]
    wants = {}
    for i, a in enumerate(eng.fork("base", 3)):
        a.append(toks(tail, 20 + i))  # its own prompt past the shared one (crossing a grid point)
        if i:
            a.generate(4 * i, SAMPLED)
        wants[i] = slot_state(eng, a)
        ref = a.snapshot(f"agent{i}", mode="replay")
        meta = eng.store.info(f"agent{i}").meta
        # the base's KV and state (all but its last hidden state, which with an MTP head is the head's seed at
        # the grid point: part of the grid state), nothing else
        hidden = 0 if eng.runner.has_mtp else eng.state.last_hidden[0].nbytes
        assert meta.replay_from == 8 * CHUNK and ref.nbytes == shared - hidden
        a.close()
    assert eng.store.stats()["device"]["bytes"] == shared
    eng.store.delete("base")  # the agents keep the shared blocks alive
    for i in range(3):
        r = eng.restore(f"agent{i}")
        assert_same_state(eng, r, wants[i])
        r.close()


def test_a_shared_state_too_far_back_is_not_replayed_from(make_engine):
    eng = make_engine(replay_max_prefill=CHUNK)
    base = eng.open()
    base.append(toks(2 * CHUNK, 9))
    base.snapshot("base")
    a = eng.fork("base", 1)[0]
    a.append(toks(2 * CHUNK + 30, 10))
    want = slot_state(eng, a)
    a.snapshot("own", mode="replay")
    assert eng.store.info("own").meta.replay_from == 4 * CHUNK  # its own grid point: 2 chunks back is too far
    assert_same_state(eng, eng.restore("own"), want)
    b = eng.fork("base", 1)[0]
    b.append(toks(2 * CHUNK, 11))
    b.snapshot("whole", mode="replay")
    assert eng.store.info("whole").meta.replay_from is None  # on its grid point with nothing near: whole


def test_replay_capsules_restore_from_every_tier_and_across_save_and_load(make_engine, tmp_path):
    eng = make_engine(disk_dir=str(tmp_path / "disk"))
    s = make_history(eng, 300, [("gen", 9), ("append", 5), ("gen", 7)])
    want = slot_state(eng, s)
    s.snapshot("r", mode="replay")
    for tier in ("host", "disk"):
        eng.store.demote("r", tier)
        r = eng.restore("r")
        assert_same_state(eng, r, want)
        r.close()
    eng.store.save(tmp_path / "saved")
    other = make_engine()
    other.store.load(tmp_path / "saved")
    assert other.store.info("r").meta.replay_from is not None
    r = other.restore("r")
    assert_same_state(other, r, want)


def test_a_session_whose_state_is_not_this_engines_cannot_be_kept_as_replay(engine):
    s = engine.open()
    s.append(toks(300, 3))
    s.generate(5, SAMPLED)
    meta, tensors = engine.store.get(*_snap(s, "whole"))
    # the same bytes arriving from elsewhere: restored exactly, but re-running its tokens here proves nothing
    engine.store.put(meta.replace(name="foreign"), tensors, origin="cuda:another-device")
    r = engine.restore("foreign")
    before = engine.store.stats()["device"]["bytes"]
    with pytest.raises(UnsupportedStateModeError, match="replay"):
        r.snapshot("nope", mode="replay")
    assert not engine.store.contains("nope", "default") and engine.store.stats()["device"]["bytes"] == before
    r.snapshot("ok")  # full is fine


def test_a_replay_capsule_of_other_numerics_is_refused_before_any_byte_moves(engine):
    s = engine.open()
    s.append(toks(300, 4))
    s.generate(6, SAMPLED)
    meta, tensors = engine.store.get(*_snap(s, "r", mode="replay"))
    engine.store.put(meta.replace(name="elsewhere"), tensors, origin="cuda:another-device")
    target = engine.open()
    target.append(toks(40, 5))
    want = slot_state(engine, target)
    with pytest.raises(IncompatibleCapsuleError, match="replay capsule made under other numerics"):
        target.restore("elsewhere")
    assert target.tokens[:40] == toks(40, 5) and len(target.tokens) == 40
    assert_same_state(engine, target, want)


def _snap(s, name: str, mode: str = "full") -> tuple[str]:
    s.snapshot(name, mode=mode)
    return (name,)


def test_meta_records_how_the_state_was_made_and_reads_files_without_it():
    base = dict(name="m", tokens=list(range(300)), grid_pos=256, fingerprint="fp", layout_version=1,
                grid=64, nbytes=1)
    old = CapsuleMeta.build(**base)
    assert "decoded_from" not in meta_to_json(old) and "replay" not in meta_to_json(old)  # read by older builds as before
    assert meta_from_json(meta_to_json(old)) == old and old.held == 300 and old.held_grid == 256
    for R in (256, 128, 0):
        m = CapsuleMeta.build(**base, decoded_from=280, replay_from=R)
        back = meta_from_json(meta_to_json(m))
        assert back == m and back.held == back.held_grid == R and back.decoded_from == 280
    for bad in (dict(decoded_from=200), dict(decoded_from=301), dict(replay_from=256),  # replay needs decoded_from
                dict(decoded_from=280, replay_from=100), dict(decoded_from=280, replay_from=384),
                dict(decoded_from=280, replay_from=True)):
        with pytest.raises(ValueError):
            CapsuleMeta.build(**base, **bad)
    with pytest.raises(ValueError, match="replay_from"):  # re-running nothing is not a replay capsule
        CapsuleMeta.build(**{**base, "tokens": list(range(256))}, decoded_from=256, replay_from=256)


async def test_the_step_scheduler_keeps_and_restores_replay_capsules_among_other_sessions(make_engine):
    from capsulert.sessions.local import AsyncEngine

    eng = make_engine(slots=8)
    async with AsyncEngine(eng) as aeng:
        s = await aeng.open(toks(300, 6))
        await s.generate(12, SAMPLED)
        await s.snapshot("r", mode="replay")
        assert eng.store.info("r").meta.replay_from is not None
        want = await s.generate(8, SAMPLED)
        others = [await aeng.open(toks(200, 7 + i)) for i in range(3)]
        busy = [asyncio.create_task(o.generate(20, SAMPLED)) for o in others]  # decoding while it replays
        r = await aeng.restore("r")
        got = await r.generate(8, SAMPLED)
        await asyncio.gather(*busy)
    assert got.tokens == want.tokens and got.logprobs == want.logprobs
