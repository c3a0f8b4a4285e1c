"""Batched capsule copies: many restores and forks in two grouped copies, each slot bitwise what a restore of
its capsule alone writes (every buffer of the state set); refusals write nothing; a snapshot is immutable
from the moment it returns."""
import pytest
import torch

from capsulert.engine import capsules
from capsulert.engine.default_model import CORPUS_PATH
from capsulert.engine.slot_views import kv_pairs
from capsulert.errors import InvalidRequestError, UnknownCapsuleError
from capsulert.kernels.triton_copy import Strided, as_tensor, plan_runs

ON, OFF = 256, 301


def corpus_of(engine):
    return engine.tokenize(CORPUS_PATH.read_text()[:20000])


@pytest.fixture
def corpus(engine):
    return corpus_of(engine)


def wipe(engine, slot):
    for name in engine.state.buffers:
        engine.state.slot_view(name, slot).zero_()


def slot_bytes(engine, slot):
    """Every buffer of the state set, the slot's whole view (what a restore did not write is zero)."""
    return {name: engine.state.slot_view(name, slot).clone() for name in engine.state.buffers}


def assert_slots_equal(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def alone(engine, name):
    """The slot bytes and tokens one restore of the capsule writes into a zeroed slot."""
    s = engine.open()
    wipe(engine, s.slot)
    s.restore(name)
    out = slot_bytes(engine, s.slot), list(s.tokens)
    s.close()
    return out


def capsules_of(engine, corpus):
    """On the grid, off it, and a decoded tail (no exact-replay rows past the prefilled ones)."""
    for name, n in (("on", ON), ("off", OFF)):
        s = engine.open()
        s.append(corpus[:n])
        s.snapshot(name)
        s.close()
    s = engine.open()
    s.append(corpus[:200])
    s.generate(5)
    s.snapshot("decoded")
    s.close()
    return {name: alone(engine, name) for name in ("on", "off", "decoded")}


def count_copies(monkeypatch):
    calls = []
    real = capsules.copy_pairs

    def spy(pairs):
        calls.append(len(pairs))
        return real(pairs)

    monkeypatch.setattr(capsules, "copy_pairs", spy)
    return calls


def free_slots(engine, n):
    """Open n sessions, zero their slots and close them: the next n sessions taken get these slots."""
    sessions = [engine.open() for _ in range(n)]
    for s in sessions:
        wipe(engine, s.slot)
        s.close()


@pytest.mark.parametrize("name", ["on", "off", "decoded"])
def test_fork_writes_every_slot_bitwise_as_a_restore_alone_in_two_copies(engine, corpus, name, monkeypatch):
    want = capsules_of(engine, corpus)[name]
    free_slots(engine, 3)
    calls = count_copies(monkeypatch)
    branches = engine.fork(name, 3)
    assert len(calls) == 2  # the capsule into the first slot, then the first slot into the others
    for b in branches:
        assert_slots_equal(slot_bytes(engine, b.slot), want[0])
        assert b.tokens == want[1]
    assert [b.generate(6) for b in branches[1:]] == [branches[0].generate(6)] * 2


def test_restore_into_many_writes_each_slot_as_its_own_restore(engine, corpus, monkeypatch):
    want = capsules_of(engine, corpus)
    sessions = [engine.open() for _ in range(4)]
    for s in sessions:
        s.append(corpus[500:520])  # something else in every slot first
        wipe(engine, s.slot)
    names = ["off", "on", "decoded", "off"]  # a repeated capsule is read once and fanned out
    calls = count_copies(monkeypatch)
    tiers = engine.restore_into_many(sessions, names)
    assert tiers == ["device"] * 4 and len(calls) == 2
    for s, name in zip(sessions, names):
        assert_slots_equal(slot_bytes(engine, s.slot), want[name][0])
        assert s.tokens == want[name][1]
    # each continues as the capsule's session does alone
    sessions[1].close()
    ref = engine.restore("off")
    assert sessions[0].generate(6) == sessions[3].generate(6) == ref.generate(6)


def test_restore_many_makes_a_session_per_capsule(engine, corpus, monkeypatch):
    want = capsules_of(engine, corpus)
    free_slots(engine, 3)
    calls = count_copies(monkeypatch)
    made = engine.restore_many(["decoded", "on", "off"])
    assert len(calls) == 2
    for s, name in zip(made, ["decoded", "on", "off"]):
        assert_slots_equal(slot_bytes(engine, s.slot), want[name][0])
        assert s.tokens == want[name][1] and s.restored_from == "device"


def test_a_refused_batch_writes_nothing_and_takes_no_slot(engine, corpus):
    capsules_of(engine, corpus)
    a, b = engine.open(), engine.open()
    a.append(corpus[:40])
    b.append(corpus[40:90])
    before = [(slot_bytes(engine, s.slot), list(s.tokens)) for s in (a, b)]
    with pytest.raises(UnknownCapsuleError):
        engine.restore_into_many([a, b], ["on", "missing"])
    with pytest.raises(InvalidRequestError):
        engine.restore_into_many([a, b], ["on"])
    with pytest.raises(InvalidRequestError):
        engine.restore_into_many([a, a], ["on", "off"])
    for s, (state, tokens) in zip((a, b), before):
        assert_slots_equal(slot_bytes(engine, s.slot), state)
        assert s.tokens == tokens
    with pytest.raises(UnknownCapsuleError):
        engine.restore_many(["on", "missing"])
    with pytest.raises(InvalidRequestError):
        engine.restore_many([])
    # both slots left are still free (a blocking verb given no wait_s refuses at once when they are not)
    assert len(engine.restore_many(["on", "off"])) == 2


def snapshot_then_write_at_once(engine, corpus, P):
    s = engine.open()
    s.append(corpus[:P])
    want = slot_bytes(engine, s.slot)
    s.snapshot("c")
    s.append(corpus[P:P + 70])  # writes the slot's state, KV rows past P and crosses a grid point
    s.generate(3)
    r = engine.open()
    wipe(engine, r.slot)
    r.restore("c")
    got = slot_bytes(engine, r.slot)
    for name, t in got.items():  # what a restore writes: the state at P, KV rows [0, P)
        if name.startswith("kv_"):
            assert torch.equal(t[:, :P], want[name][:, :P]), name
        elif name in ("ssm", "conv", "last_hidden", "pos"):
            assert torch.equal(t, want[name]), name
    return s, r


@pytest.mark.parametrize("P", [ON, OFF], ids=["on-grid", "off-grid"])
def test_a_capsule_is_immutable_from_the_moment_snapshot_returns(engine, corpus, P):
    snapshot_then_write_at_once(engine, corpus, P)


@pytest.mark.gpu
@pytest.mark.parametrize("P", [ON, OFF], ids=["on-grid", "off-grid"])
def test_a_capsule_on_cuda_is_immutable_under_writes_queued_right_after(make_engine, P):
    """On CUDA nothing waits for the snapshot's copy: the writes after it are ordered behind it on the stream."""
    if not torch.cuda.is_available():
        pytest.fail("a CUDA test: run it with -m gpu on the GPU machine")
    engine = make_engine(device="cuda", slots=8)
    corpus = corpus_of(engine)
    snapshot_then_write_at_once(engine, corpus, P)
    s = engine.open()
    s.append(corpus[:P])
    s.snapshot("d")
    s.close()
    want = alone(engine, "d")
    free_slots(engine, 3)
    for b in engine.fork("d", 3):
        assert_slots_equal(slot_bytes(engine, b.slot), want[0])


def test_a_restore_copies_each_slab_run_of_blocks_as_one_pair(engine, corpus, monkeypatch):
    """KV blocks held in consecutive rows of one slab (a snapshot allocates its new blocks together) travel as
    one copy pair per block tensor and run, so a restore's host work does not grow with its blocks (a 2k
    capsule: 2 runs of 16 blocks, 8 pairs instead of 128). The rows are the snapshotted session's."""
    grid, kv = engine.runner.grid, engine.state.layout.block_tensors
    s = engine.open()
    s.append(corpus[:4 * grid])
    s.snapshot("a")
    s.append(corpus[4 * grid:6 * grid])
    s.snapshot("b")  # a's 4 blocks (a's slab), then 2 in a slab of their own
    rows = {k: engine.state.buffers[k][:, s.slot, :6 * grid].clone() for k in kv}
    s.close()
    pairs = []
    real = capsules.copy_pairs
    monkeypatch.setattr(capsules, "copy_pairs", lambda ps: (pairs.extend(ps), real(ps))[1])
    r = engine.restore("b")
    storages = {engine.state.buffers[k].untyped_storage().data_ptr(): k for k in kv}
    dsts = [as_tensor(d) for d, _ in pairs]  # a KV pair's sides are views not made yet (Strided)
    kv_dsts = [d for d in dsts if d.numel() and d.untyped_storage().data_ptr() in storages]
    assert len(kv_dsts) == 2 * len(kv)
    for k in kv:
        assert torch.equal(engine.state.buffers[k][:, r.slot, :6 * grid], rows[k]), k
    assert r.generate(6) == engine.restore("b").generate(6)


def test_a_restore_of_slab_held_blocks_makes_no_view_of_one_block(engine, corpus, monkeypatch):
    """A restore copies slab runs, so it never asks a block record for its own views: a crowd's first reads of
    64 capsules at 3.5k would otherwise make 3,500 blocks' views in its host time. Each slot still holds its
    capsule's rows, bitwise, and a batch of them restores too."""
    from capsulert.capsule_store.block_pool import BlockRecord

    grid, kv = engine.runner.grid, engine.state.layout.block_tensors
    want = {}
    for i, name in enumerate(("x", "y")):
        s = engine.open()
        s.append(corpus[i * 7 * grid:(i * 7 + 5) * grid + 9])
        s.snapshot(name)
        want[name] = {k: engine.state.buffers[k][:, s.slot, :5 * grid].clone() for k in kv}
        s.close()
    asked = []
    real = BlockRecord.block_tensors
    monkeypatch.setattr(BlockRecord, "block_tensors", lambda rec: (asked.append(rec), real(rec))[1])
    restored = engine.restore_many(["x", "y"])
    assert asked and all(rec.slab is None for rec in asked)  # each capsule's grid-state block: not in a slab
    for r, name in zip(restored, ("x", "y")):
        for k in kv:
            assert torch.equal(engine.state.buffers[k][:, r.slot, :5 * grid], want[name][k]), (name, k)


@pytest.mark.parametrize("first", [0, 1, 5], ids=["whole", "past-one-block", "inside-the-second-run"])
def test_the_copy_plan_of_views_not_made_is_the_plan_of_the_views(engine, corpus, first):
    """A restore's KV pairs name their views without making them (Strided); the GPU's copy plan reads their
    addresses and strides. That plan must be, run for run, the plan of the views they stand for, for every
    start block a restore or a prefix reuse asks for (a run cut at its start included), and each view not made
    must be the slot's rows and the slab's rows it names."""
    grid, st = engine.runner.grid, engine.state
    s = engine.open()
    s.append(corpus[:4 * grid])
    s.snapshot("a")
    s.append(corpus[4 * grid:7 * grid + 9])
    s.snapshot("b")  # two runs of blocks (a's slab, then its own) and own rows past its blocks
    slot = s.slot
    with engine.store.reading_parts("b") as (meta, parts, _):
        assert parts.runs is not None and len(parts.runs) == 2
        pairs = kv_pairs(st, slot, grid, parts, first, meta.held)
        assert any(isinstance(d, Strided) for d, _ in pairs) and any(isinstance(x, Strided) for _, x in pairs)
        made = [(as_tensor(d), as_tensor(x)) for d, x in pairs]
        # planned for the engine's device: a plan for another one leaves every pair to copy_
        lazy, lazy_rest = plan_runs(pairs, engine.device)
        real, real_rest = plan_runs(made, engine.device)
        assert not lazy_rest and not real_rest
        for f in ("src", "dst", "nbytes"):
            assert (getattr(lazy, f) == getattr(real, f)).all(), f
        for d, x in made:  # the slot already holds what it snapshotted: each pair's sides hold the same bytes
            assert torch.equal(d, x)
        rows = {k: st.buffers[k][:, slot, first * grid:meta.held] for k in st.layout.block_tensors}
        for k, want in rows.items():  # together the pairs cover the slot's rows [first * grid, held), no more
            covered = sum(d.numel() for d, _ in made if d.untyped_storage().data_ptr()
                          == st.buffers[k].untyped_storage().data_ptr())
            assert covered == want.numel(), k
    s.close()


def test_a_forks_two_copies_plan_as_the_views_they_name(engine, corpus, monkeypatch):
    """Both grouped copies of a restore of repeated and distinct capsules (the capsules into their first slots,
    then those slots' rows into the other slots, both naming views not made): the plan of what they name is the
    plan of the views, and every slot holds its capsule's bytes."""
    grid = engine.runner.grid
    s = engine.open()
    s.append(corpus[:3 * grid + 5])
    s.snapshot("p")
    s.append(corpus[3 * grid + 5:5 * grid])
    s.snapshot("q")
    s.close()
    want = {n: alone(engine, n)[0] for n in ("p", "q")}
    calls = []
    real = capsules.copy_pairs
    monkeypatch.setattr(capsules, "copy_pairs", lambda ps: (calls.append(list(ps)), real(ps))[1])
    free_slots(engine, 4)
    got = engine.restore_many(["p", "q", "p", "q"])
    assert len(calls) == 2 and all(any(isinstance(d, Strided) for d, _ in c) for c in calls)
    for pairs in calls:
        lazy, lazy_rest = plan_runs(pairs, engine.device)
        made, made_rest = plan_runs([(as_tensor(d), as_tensor(x)) for d, x in pairs], engine.device)
        assert lazy.count and len(lazy_rest) == len(made_rest)
        for f in ("src", "dst", "nbytes"):
            assert (getattr(lazy, f) == getattr(made, f)).all(), f
    for r, name in zip(got, ("p", "q", "p", "q")):
        assert_slots_equal(slot_bytes(engine, r.slot), want[name])


def test_a_slots_part_of_each_buffer_is_one_view_made_once(engine):
    """StateSet.slot_view hands out the view it made at start (a restore names a dozen per capsule): the same
    object each call, [:, slot] of a buffer of four or more dimensions and [slot] of the others, writing
    through to the buffer."""
    st = engine.state
    for name, full in st.buffers.items():
        for slot in (0, engine.config.slots - 1):
            view = st.slot_view(name, slot)
            assert view is st.slot_view(name, slot)
            want = full[:, slot] if full.dim() >= 4 else full[slot]
            assert (view.shape, view.stride(), view.data_ptr()) == (want.shape, want.stride(), want.data_ptr())
    before = st.buffers["ssm"].clone()
    st.slot_view("ssm", 1).add_(1)
    assert torch.equal(st.buffers["ssm"][:, 1], before[:, 1] + 1) and torch.equal(st.buffers["ssm"][:, 0], before[:, 0])
    st.slot_view("ssm", 1).copy_(before[:, 1])
