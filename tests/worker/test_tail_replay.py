"""The exact-replay buffer (engine/tail_replay.py): an append to a session, or to a restored capsule, whose
prefilled tokens end past a grid point runs only its new tokens through the model; the tokens past the grid
point are replayed in the linear-attention layers from the rows kept for them. Bitwise a cold prefill: the
logits and the slot's whole state (KV rows included: the tail's KV rows are the ones the capsule or the
session kept, never recomputed). The engines ask for tail_replay (the default) explicitly, so that
`--device cuda` runs test the CUDA graphs of the replaying pieces."""
from __future__ import annotations

import pytest
import torch

from capsulert.engine.engine import GRID
from tests.models import MODELS
from tests.worker.pieces import count_pieces
from tests.worker.test_grid64 import NOEOS, assert_same, state_of, toks

pytestmark = pytest.mark.parametrize("model_dir", MODELS, indirect=True)  # dense and MoE


def cold(eng, tokens):
    s = eng.open()
    logits = s.append(list(tokens)).clone()
    state = state_of(eng, s)
    s.close()
    return logits, state


def split_append(eng, t: list[int], P: int, monkeypatch) -> int:
    """Append t[:P], then t[P:], checking the result bitwise against a cold prefill of t; the rows the second
    append ran through the model."""
    want, want_state = cold(eng, t)
    s = eng.open()
    s.append(t[:P])
    pieces = count_pieces(eng, monkeypatch)
    got = s.append(t[P:])
    assert torch.equal(got, want)
    assert_same(want_state, state_of(eng, s), f"append at {P}")
    s.close()
    return sum(pieces)


@pytest.mark.parametrize("P,n", [(150, 5), (150, 40), (191, 1), (200, 100), (130, 200)],
                         ids=["short", "crosses-192", "one-row-tail", "crosses-two", "longer-than-a-piece"])
def test_an_append_past_a_grid_point_runs_only_the_new_tokens(make_engine, P, n, monkeypatch):
    ran = split_append(make_engine(prefill_chunk=128, tail_replay=True), toks(P + n, 1), P, monkeypatch)
    assert ran == n, f"ran {ran} rows for {n} new tokens past a tail of {P % GRID}"


def test_without_tail_replay_the_tail_is_rerun_with_the_same_bits(make_engine, monkeypatch):
    P, n = 150, 40
    assert split_append(make_engine(prefill_chunk=128, tail_replay=False), toks(P + n, 2), P, monkeypatch) == P % GRID + n


def test_decoded_tokens_past_the_tail_are_rerun_and_the_tail_replayed(make_engine, monkeypatch):
    """Prefilled to 150 (tail [128, 150) kept), 20 tokens decoded (no grid point crossed): the append replays
    the 22 prefilled rows and re-runs the 20 decoded ones with the new ones, as a cold prefill computes them.
    With an MTP head (the default model has one) the head's re-run rows start from the hidden state at 150,
    which the slot keeps for its tail (state.tail_hidden): the head's KV rows are compared too."""
    eng = make_engine(prefill_chunk=128, tail_replay=True)
    assert eng.runner.has_mtp == eng.state.keeps_tail_seed
    s = eng.open()
    s.append(toks(150, 3))
    s.generate(20, NOEOS)
    new = toks(30, 4)
    want, want_state = cold(eng, list(s.tokens) + new)
    pieces = count_pieces(eng, monkeypatch)
    got = s.append(new)
    assert sum(pieces) == 20 + 30
    assert torch.equal(got, want)
    assert_same(want_state, state_of(eng, s), "decoded tail")
    s.generate(5, NOEOS)  # and the turn after: the new tail's seed
    more = toks(10, 10)
    want, want_state = cold(eng, list(s.tokens) + more)
    assert torch.equal(s.append(more), want)
    assert_same(want_state, state_of(eng, s), "decoded tail, second turn")


def test_a_restored_capsule_that_decodes_replays_its_tail_on_the_next_append(make_engine, monkeypatch):
    """A capsule's tail ends where the capsule does, so its seed there is the capsule's last hidden state: a
    restore writes it as the slot's tail seed, and each fork (the fan-out copy included) that decodes and then
    appends replays the capsule's tail bitwise as a cold prefill."""
    eng = make_engine(prefill_chunk=128, tail_replay=True)
    s = eng.open()
    s.append(toks(150, 11))
    s.snapshot("c")
    s.close()
    forks = eng.fork("c", 2)
    for i, f in enumerate(forks):
        eng.state.last_hidden[f.slot] = 1.0  # nothing a restore reads
        if eng.state.keeps_tail_seed:
            eng.state.tail_hidden[f.slot] = float(i + 2)
    eng.restore_into_many(forks, ["c", "c"])
    eng.generate(forks, 12, [NOEOS, NOEOS])
    new = toks(20, 12)
    for f in forks:
        want, want_state = cold(eng, list(f.tokens) + new)
        pieces = count_pieces(eng, monkeypatch)
        assert torch.equal(f.append(new), want)
        assert sum(pieces) == 12 + 20, "the decoded tokens re-run with the new ones, the capsule's tail replayed"
        assert_same(want_state, state_of(eng, f), "restored, decoded, appended")
        monkeypatch.undo()


def test_turn_after_turn_each_append_replays_the_last_tail(make_engine, monkeypatch):
    eng = make_engine(prefill_chunk=128, tail_replay=True)
    t = toks(400, 5)
    s = eng.open()
    s.append(t[:150])
    pieces = count_pieces(eng, monkeypatch)
    at = 150
    for n in (10, 10, 50, 3, 1, 120):
        s.append(t[at:at + n])
        at += n
    assert sum(pieces) == at - 150
    want, want_state = cold(eng, t[:at])
    assert torch.equal(eng.logits(s), want)
    assert_same(want_state, state_of(eng, s), "turns")


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_a_capsule_keeps_its_tail_rows_on_every_tier_and_its_forks_replay_them(make_engine, tier, tmp_path,
                                                                             monkeypatch):
    eng = make_engine(prefill_chunk=128, disk_dir=str(tmp_path), tail_replay=True)
    t = toks(230, 6)
    s = eng.open()
    s.append(t[:200])
    ref = s.snapshot("c", tier=tier)
    s.close()
    assert eng.store.info("c").meta.boundary == 200
    want, want_state = cold(eng, t)
    forks = eng.fork("c", 2)
    pieces = count_pieces(eng, monkeypatch)
    for f in forks:
        assert torch.equal(f.append(t[200:]), want)
        assert_same(want_state, state_of(eng, f), f"fork from {tier}")
    assert sum(pieces) == 2 * 30, "each fork ran its 30 new tokens only"
    assert ref.nbytes > 0


@pytest.mark.parametrize("tier", ["device", "disk"])
def test_a_capsule_after_generate_keeps_the_prefilled_part_of_its_tail(make_engine, tier, tmp_path, monkeypatch):
    eng = make_engine(prefill_chunk=128, disk_dir=str(tmp_path), tail_replay=True)
    s = eng.open()
    s.append(toks(150, 7))
    s.generate(20, NOEOS)  # [128, 150) prefilled, [150, 170) decoded
    s.snapshot("g", tier=tier)
    meta = eng.store.info("g").meta
    new = toks(10, 8)
    want, want_state = cold(eng, list(s.tokens) + new)
    r = eng.restore("g")
    pieces = count_pieces(eng, monkeypatch)
    assert torch.equal(r.append(new), want)
    assert sum(pieces) == 20 + 10, "the decoded tokens re-run, the prefilled ones replayed"
    assert_same(want_state, state_of(eng, r), "after generate")
    assert meta.boundary == 170 and meta.decoded_from == 150
    # with an MTP head the capsule holds the head's seed at the tail's end, which the re-run of the decoded
    # tokens starts from (the restored slot's last hidden state is the capsule's, at 170)
    assert ("tail_hidden" in eng.store.get("g")[1]) == eng.runner.has_mtp


def test_a_capsule_whose_tail_rows_do_not_fit_its_length_is_refused(make_engine):
    """Tail rows are at most the tokens past the grid point: a capsule claiming more is refused, typed, before
    any byte of the slot changes."""
    from capsulert.capsule_store.capsule import TensorSpec
    from capsulert.errors import IncompatibleCapsuleError

    eng = make_engine(prefill_chunk=128, tail_replay=True)
    s = eng.open()
    s.append(toks(150, 9))
    s.snapshot("c")
    meta = eng.store.info("c").meta
    bad = {"tail_in": TensorSpec((eng.state.tail_in.shape[0], 40, eng.state.tail_in.shape[-1]), eng.dtype)}
    with pytest.raises(IncompatibleCapsuleError, match="tail rows"):
        eng.capsules._check_compatible(meta, bad)


def test_an_engine_without_tail_replay_stores_no_tail_and_reruns_a_restored_one(make_engine, monkeypatch):
    t = toks(180, 10)
    nbytes, engines = {}, {}
    for replay in (True, False):
        eng = engines[replay] = make_engine(prefill_chunk=128, tail_replay=replay)
        s = eng.open()
        s.append(t[:150])
        s.snapshot("c")
        s.close()
        nbytes[replay] = eng.store.info("c").meta.nbytes
    st = engines[True].state
    tail_row = st.tail_in.shape[0] * (st.tail_in.shape[-1] + st.tail_gates.shape[-1]) * st.tail_in.element_size()
    assert nbytes[True] - nbytes[False] == (150 % GRID) * tail_row  # the 22 tail rows, only where replayed
    want, _ = cold(eng, t)
    r = eng.restore("c")
    pieces = count_pieces(eng, monkeypatch)
    assert torch.equal(r.append(t[150:]), want)
    assert sum(pieces) == 150 % GRID + 30


def test_a_capsule_of_other_numerics_reruns_its_tail_in_full(make_engine, monkeypatch):
    """Tail rows computed under other numerics (another device or torch) are written back byte-exact but not
    replayed: the append re-runs the tail with this engine's arithmetic."""
    eng = make_engine(prefill_chunk=128, tail_replay=True)
    t = toks(180, 11)
    s = eng.open()
    s.append(t[:150])
    s.snapshot("c")
    s.close()
    meta, full = eng.store.get("c")
    assert "tail_in" in full
    eng.store.put(meta.replace(name="elsewhere"), full, origin="cuda:another-device")
    want, _ = cold(eng, t)
    r = eng.restore("elsewhere")
    pieces = count_pieces(eng, monkeypatch)
    assert torch.equal(r.append(t[150:]), want)
    assert sum(pieces) == 150 % GRID + 30


def test_every_graph_shape_runs_on_the_warm_up_inputs(make_engine):
    """Capture first runs each shape eagerly on the static warm-up inputs (a grid point and a replayed row one
    token in). Run here on the CPU, an index they leave out of range raises; on a GPU it is a device-side
    assert at engine start (a grid point 64 tokens into a 16-token replay piece once was)."""
    from capsulert.engine.graphs import GraphPlans

    eng = make_engine(device="cpu", prefill_chunk=256, tail_replay=True)
    plans = GraphPlans(eng.model, eng.state, eng.runner.scratch_slot, eng.config.max_seq, eng.chunk, (1, 2), eng.grid,
                       tail_replay=True)
    plans.warm_inputs()
    keys = plans.shape_keys()
    assert {k.phase for k in keys} == {"decode", "verify", "prefill", "prefill_grid", "prefill_replay",
                                       "prefill_grid_replay"}
    for key in keys:
        plans.run_shape(key)


def test_tail_replay_is_on_by_default_and_an_engine_without_it_holds_no_tail_buffers(make_engine):
    from capsulert.config.engine import EngineConfig
    from capsulert.engine.graphs import GraphPlans

    assert EngineConfig().tail_replay is True  # on every device: a crowd's batched turns replay their tails
    assert make_engine(device="cpu").runner.tail_replay
    eng = make_engine(device="cpu", tail_replay=False)
    assert "tail_in" not in eng.state.buffers and "tail_gates" not in eng.state.buffers
    plans = GraphPlans(eng.model, eng.state, eng.runner.scratch_slot, eng.config.max_seq, eng.chunk, (1,), eng.grid)
    assert not any(k.replays for k in plans.shape_keys())


def test_a_capsule_with_tail_rows_restores_on_an_engine_without_tail_replay(make_engine, tmp_path, monkeypatch):
    """The engine that keeps no tails restores the rest of the capsule and re-runs its tail: the same bits."""
    t = toks(190, 12)
    eng = make_engine(prefill_chunk=128, tail_replay=True)
    s = eng.open()
    s.append(t[:150])
    s.snapshot("c")
    eng.store.save(tmp_path / "caps")
    plain = make_engine(prefill_chunk=128, tail_replay=False)
    assert plain.store.load(tmp_path / "caps") == 1
    want, want_state = cold(plain, t)
    r = plain.restore("c")
    pieces = count_pieces(plain, monkeypatch)
    assert torch.equal(r.append(t[150:]), want)
    assert sum(pieces) == 150 % GRID + 40
    assert_same(want_state, state_of(plain, r), "restored without tail replay")


def test_a_capsule_whose_decoded_tail_lacks_the_heads_seed_is_refused(make_engine):
    """On a model with an MTP head a capsule whose tail decoded tokens follow holds the head's seed at the tail's
    end; one without it (or with a seed of another shape) is refused, typed, before any byte of a slot changes."""
    from capsulert.capsule_store.capsule import TensorSpec
    from capsulert.errors import IncompatibleCapsuleError

    eng = make_engine(prefill_chunk=128, tail_replay=True)
    assert eng.runner.has_mtp
    s = eng.open()
    s.append(toks(150, 13))
    s.generate(5, NOEOS)
    s.snapshot("g")
    meta, tensors = eng.store.get("g")
    specs = {k: TensorSpec(tuple(v.shape), v.dtype) for k, v in tensors.items()}
    eng.capsules._check_compatible(meta, specs)  # as stored: accepted
    with pytest.raises(IncompatibleCapsuleError, match="tail_hidden"):
        eng.capsules._check_compatible(meta, {k: v for k, v in specs.items() if k != "tail_hidden"})
    with pytest.raises(IncompatibleCapsuleError, match="tail_hidden"):
        eng.capsules._check_compatible(meta, {**specs, "tail_hidden": TensorSpec((3,), specs["tail_hidden"].dtype)})


@pytest.mark.parametrize("drafter", ["ngram", "mtp"])
def test_speculative_tokens_past_the_tail_then_a_batched_append_replay_the_tail(make_engine, drafter, monkeypatch):
    """Speculative steps (drafts verified and rolled back) write the MTP head's rows and seed past the tail and
    never its tail seed: a batched append after them replays each session's tail, bitwise a cold prefill."""
    from capsulert.protocol.sampling import SamplingParams

    eng = make_engine(prefill_chunk=128, tail_replay=True, slots=6)
    spec = SamplingParams(ignore_eos=True, speculate=3, speculate_drafter=drafter)
    sessions = [eng.open(toks(150, 14)), eng.open(toks(100, 15))]
    eng.generate(sessions, 20, [spec, spec])
    new = [toks(30, 16), toks(9, 17)]
    wants = [cold(eng, list(s.tokens) + n) for s, n in zip(sessions, new)]
    pieces = []
    forward = eng.model.forward

    def counted(*a, **k):
        pieces.append(k["valid"].tolist())
        return forward(*a, **k)
    if eng.graphs is None:  # the rows each session ran through the model (CUDA: one graph of the batch's shape)
        monkeypatch.setattr(eng.model, "forward", counted)
    got = eng.append_many(sessions, new)
    monkeypatch.undo()
    if eng.graphs is None:
        assert pieces == [[20 + 30, 20 + 9]]
    for s, g, (want, want_state) in zip(sessions, got, wants):
        assert torch.equal(g, want)
        assert_same(want_state, state_of(eng, s), f"{drafter} then a batched append")
