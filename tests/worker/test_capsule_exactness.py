"""The exactness suite: capsules restore the complete state, bit for bit, on and off the prefill grid."""
import pytest
import torch

from tests.worker.test_engine import assert_state_equal, slot_state
from tests.models import MODELS

CHUNK = 128
BOUNDARIES = {"on-grid": 256, "off-grid": 301}
OTHER = "Completely unrelated text about gardening, tomatoes, rain and the price of copper wire in 1911. " * 4


@pytest.fixture
def corpus(engine):
    from capsulert.engine.default_model import CORPUS_PATH

    return engine.tokenize(CORPUS_PATH.read_text()[:40000])


def capsule_view_equal(engine, session, name):
    """The restored slot holds exactly the capsule's bytes: live state at P, grid checkpoint at G."""
    with engine.store.reading(name, "default") as (meta, t):
        st, s, P, G = engine.state, session.slot, meta.boundary, meta.grid_pos
        assert int(st.pos[s]) == P
        for name in st.layout.block_tensors:  # the KV and an MTP head's KV, rows [0, P)
            assert torch.equal(st.buffers[name][:, s, :P], t[name]), name
        if st.layout.mtp_layers:  # the head's seed at the grid point
            assert torch.equal(st.grid_hidden[s], t["last_hidden" if P == G else "grid_hidden"])
        for live, grid, key in ((st.ssm, st.ssm_grid, "ssm"), (st.conv, st.conv_grid, "conv")):
            assert torch.equal(live[:, s], t[key])
            assert torch.equal(grid[:, s], t[key if P == G else f"{key}_grid"])
        assert (P == G) == ("ssm_grid" not in t)
        assert torch.equal(st.last_hidden[s], t["last_hidden"])


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
@pytest.mark.parametrize("P", BOUNDARIES.values(), ids=BOUNDARIES.keys())
def test_pure_restore_equals_snapshot_point(engine, corpus, P):
    s = engine.open()
    logits = s.append(corpus[:P])
    s.snapshot("c")
    r = engine.restore("c")
    assert torch.equal(r.logits(), logits)
    assert r.tokens == corpus[:P]
    capsule_view_equal(engine, r, "c")
    assert r.generate(16) == s.generate(16)


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
@pytest.mark.parametrize("P", BOUNDARIES.values(), ids=BOUNDARIES.keys())
def test_adversarial_garbage_then_restore(engine, corpus, P):
    """State completeness: every live buffer of the slot (the MTP head's KV and seed among them) overwritten
    with garbage, then a restore gives the same tokens and the same MTP drafts as a cold prefill."""
    s = engine.open()
    s.append(corpus[:P])
    s.snapshot("c")
    slot = s.slot
    s.close()
    g = torch.Generator().manual_seed(0)
    for name, buf in engine.state.buffers.items():  # every buffer of the slot, KV beyond P too
        view = engine.state.slot_view(name, slot)
        view.copy_(torch.randint(-1000, 1000, view.shape, generator=g).to(view.dtype) if name == "pos"
                   else torch.randn(view.shape, generator=g).to(view.dtype) * 50)
    t = engine.open()
    assert t.slot == slot
    t.append(OTHER)
    t.restore("c")
    ref = engine.open()
    ref.append(corpus[:P])
    nxt = int(ref.logits().argmax())
    assert torch.equal(engine.runner.mtp_draft([t.slot], [nxt], 3), engine.runner.mtp_draft([ref.slot], [nxt], 3))
    assert t.generate(32) == ref.generate(32)
    assert torch.equal(engine.runner.mtp_draft([t.slot], [7], 3), engine.runner.mtp_draft([ref.slot], [7], 3))


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
@pytest.mark.parametrize("P", BOUNDARIES.values(), ids=BOUNDARIES.keys())
def test_restore_append_equals_cold(engine, corpus, P):
    prefix, suffix = corpus[:P], corpus[P:P + 45]
    s = engine.open()
    s.append(prefix)
    s.snapshot("c")
    s.close()
    r = engine.restore("c")
    warm_logits = r.append(suffix)
    cold = engine.open()
    cold_logits = cold.append(prefix + suffix)
    assert torch.equal(warm_logits, cold_logits)
    assert_state_equal(slot_state(engine, r), slot_state(engine, cold))


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_fork_branches_equal_cold_and_do_not_interfere(engine, corpus):
    P = 301
    s = engine.open()
    s.append(corpus[:P])
    s.snapshot("root")
    s.close()
    branches = engine.fork("root", 3)
    branches.append(engine.restore("root"))  # the 4th through the same path fork uses
    suffixes = [corpus[1000 + 50 * i: 1000 + 50 * i + 20 + 7 * i] for i in range(4)]
    logits = [None] * 4
    for i in (2, 0, 3, 1):  # interleaved
        logits[i] = branches[i].append(suffixes[i])
    gens = engine.generate(branches, 12)
    for i in range(4):
        cold = engine.open() if engine.free_slots else None
        if cold is None:
            branches[i].close()
            cold = engine.open()
        assert torch.equal(cold.append(corpus[:P] + suffixes[i]), logits[i])
        assert cold.generate(12) == gens[i]
        cold.close()


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_rollback_and_roll_forward(engine, corpus):
    A, B, C, D = corpus[:200], corpus[200:330], corpus[330:420], corpus[600:640]
    s = engine.open()
    for name, part in (("after-A", A), ("after-B", B), ("after-C", C)):
        s.append(part)
        s.snapshot(name)
    original = s.generate(16)
    s.restore("after-A")
    rolled = s.append(D)
    cold = engine.open()
    assert torch.equal(rolled, cold.append(A + D))
    assert s.generate(16) == cold.generate(16)
    s.restore("after-C")
    assert s.generate(16) == original


def test_long_boundary_many_chunks(make_engine, corpus):
    engine = make_engine(max_seq=2048, prefill_chunk=CHUNK)
    P = 9 * CHUNK + 37
    s = engine.open()
    s.append(corpus[:P])
    s.snapshot("long")
    s.close()
    r = engine.restore("long")
    warm = r.append(corpus[P:P + 30])
    cold = engine.open()
    assert torch.equal(warm, cold.append(corpus[:P + 30]))
    assert_state_equal(slot_state(engine, r), slot_state(engine, cold))


def test_kv_only_restore_diverges(engine, corpus):
    """Ablation: the recurrent and conv state are load-bearing, so a KV-only capsule is wrong."""
    P = 256
    s = engine.open()
    s.append(corpus[:P])
    s.snapshot("full")
    expected = s.generate(16)
    s.close()
    for stale in (False, True):
        r = engine.restore("full")
        slot = r.slot
        if stale:
            other = engine.open()
            other.append(OTHER)
            src = other.slot
        for name in ("ssm", "conv", "ssm_grid", "conv_grid"):
            view = engine.state.slot_view(name, slot)
            view.copy_(engine.state.slot_view(name, src)) if stale else view.zero_()
        got = r.generate(16)
        first_diff = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
        assert first_diff is not None and first_diff < 4, (stale, got, expected)
        r.close()
        if stale:
            other.close()


def test_namespaces_keep_same_names_apart(engine, corpus):
    a, b = engine.open(), engine.open()
    la = a.append(corpus[:150])
    lb = b.append(corpus[150:330])
    a.snapshot("turn", namespace="tenant-a")
    b.snapshot("turn", namespace="tenant-b")
    a.restore("turn", namespace="tenant-b")
    assert torch.equal(a.logits(), lb)
    r = engine.restore("turn", namespace="tenant-a")
    assert torch.equal(r.logits(), la)
    from capsulert.errors import UnknownCapsuleError

    with pytest.raises(UnknownCapsuleError):
        engine.restore("turn")  # the default namespace has no such capsule
    assert [c.meta.namespace for c in engine.store.list()] == ["tenant-a", "tenant-b"]
