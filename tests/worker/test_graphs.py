"""CUDA graph plans (GPU only): bounded count, slot- and position-agnostic replay, never invalidated."""
import pytest
import torch

from capsulert.engine.graphs import ShapeKey
from capsulert.protocol.sampling import MAX_SPECULATE, SamplingParams
from tests.models import MODELS

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda_engine(make_engine):
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device: run with -m gpu --device cuda on the GPU machine")
    return make_engine(device="cuda", slots=4)


def test_capture_draws_a_bar_over_the_shapes_when_asked(cuda_engine, make_engine, capsys, monkeypatch):
    monkeypatch.setattr("capsulert.progress.SHOW_AFTER_S", 0)
    eng = make_engine(device="cuda", slots=4, progress=True)
    err = capsys.readouterr().err
    shapes = len(eng.graphs.graphs)
    assert "capsulert: CUDA graphs" in err and f"0/{2 * shapes}" in err and "capture]" in err
    eng.close()


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_graph_count_is_bounded(cuda_engine):
    g = cuda_engine.graphs
    sizes = (16, 32, 64, 128)
    # decode buckets, prefill buckets (plain, keeping a grid point, replaying a kept tail), the batched
    # re-derivation of grid points (b rows of 64 tokens), decode steps with k re-derivations in their forward
    # (where this card's GEMMs allow: checked at start), batched appends (b sessions' pieces of up to t tokens,
    # with and without replayed tails) and the speculative verify steps (b slots fed 2 to MAX_SPECULATE + 1
    # tokens each)
    assert g.mixed_pieces in ((), (1, 2, 4))
    assert set(g.graphs) == ({ShapeKey("decode", b, 1) for b in (1, 2, 4)} | {ShapeKey("prefill", 1, t) for t in sizes}
                             | {ShapeKey("prefill_grid", 1, 128)}
                             | {ShapeKey(p, 1, t) for p in ("prefill_replay", "prefill_grid_replay") for t in sizes}
                             | {ShapeKey("prefill", b, 64) for b in (2, 4)}
                             | {ShapeKey("mixed", b, k) for b in (1, 2, 4) for k in g.mixed_pieces}
                             | {ShapeKey(p, b, t) for p in ("pieces", "pieces_replay") for b in (2, 4) for t in sizes}
                             | {ShapeKey("verify", b, w) for b in (1, 2, 4) for w in range(2, MAX_SPECULATE + 2)})
    # a cap on the batched appends' rows leaves the larger shapes to eager forwards
    assert g.piece_shapes == [(b, t) for b in (2, 4) for t in sizes]


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_snapshot_restore_never_invalidate_graphs(cuda_engine, text):
    eng = cuda_engine
    graphs = dict(eng.graphs.graphs)
    ptrs = eng.state.data_ptrs()
    s = eng.open()
    s.append(text)
    s.snapshot("c")
    first = s.generate(16)
    for slot_user in range(3):  # the same graphs serve other slots and other positions
        r = eng.restore("c")
        assert r.generate(16) == first
        r.close()
    s.restore("c")
    assert s.generate(16) == first
    assert eng.graphs.graphs == graphs and eng.state.data_ptrs() == ptrs


@pytest.mark.parametrize("model_dir", ["moe"], indirect=True)
def test_reference_moe_kernels_refuse_graph_capture(make_engine):
    from capsulert.errors import ConfigError

    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device: run with -m gpu --device cuda on the GPU machine")
    with pytest.raises(ConfigError, match="cannot capture"):
        make_engine(device="cuda", slots=2, kernels="reference")
    eager = make_engine(device="cuda", slots=2, kernels="reference", cuda_graphs=False)
    assert len(eager.open(prompt="a prompt").generate(4, SamplingParams(ignore_eos=True))) == 4


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_a_prefill_its_graph_would_pad_by_over_a_quarter_runs_in_two_pieces_with_the_same_bits(make_engine, monkeypatch):
    """1056 tokens under 2048-token pieces: a 1024-row and a 32-row graph (engine.prefill_pieces), not one
    2048-row graph, with the logits and state of one unpadded eager piece."""
    from capsulert.engine import runner as engine_mod

    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device: run with -m gpu --device cuda on the GPU machine")
    ids = torch.randint(1, 4096, (1056,), generator=torch.Generator().manual_seed(3)).tolist()
    eager = make_engine(device="cuda", slots=1, max_seq=4096, prefill_chunk=2048, cuda_graphs=False)
    s = eager.open()
    want = s.append(ids)
    want_ssm = eager.state.ssm[:, s.slot].clone()
    eager.close()
    eng = make_engine(device="cuda", slots=1, max_seq=4096, prefill_chunk=2048)
    seen = []
    real = engine_mod.prefill_pieces
    monkeypatch.setattr(engine_mod, "prefill_pieces", lambda *a: seen.append(real(*a)) or seen[-1])
    s = eng.open()
    got = s.append(ids)
    assert seen == [[(0, 1024), (1024, 1056)]]
    assert torch.equal(got, want) and torch.equal(eng.state.ssm[:, s.slot], want_ssm)


@pytest.mark.parametrize("model_dir", ["moe"], indirect=True)
def test_an_moe_engine_with_short_prefill_pieces_says_which_piece_keeps_prefill_fast(make_engine, caplog):
    from capsulert.engine.engine import MOE_PREFILL_CHUNK

    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device: run with -m gpu --device cuda on the GPU machine")
    with caplog.at_level("INFO", logger="capsulert.engine"):
        make_engine(device="cuda", slots=1, cuda_graphs=False).close()
    assert f"prefill_chunk={MOE_PREFILL_CHUNK}" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="capsulert.engine"):
        make_engine(device="cuda", slots=1, max_seq=MOE_PREFILL_CHUNK, prefill_chunk=MOE_PREFILL_CHUNK,
                    cuda_graphs=False).close()
    assert "on an MoE model" not in caplog.text


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_a_batched_append_replays_its_shapes_graph_with_the_eager_forwards_bits(make_engine):
    """A crowd's turns (Engine.append_many) replay the batched-append graph of their shape, with and without
    replayed tails, at mixed lengths, one crossing a grid point: the logits, every state buffer of each slot and
    the tokens decoded after are bitwise an eager forward's (batched_piece_rows=0 captures none)."""
    from tests.worker.test_append_many import slot_bytes

    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device: run with -m gpu --device cuda on the GPU machine")
    ids = torch.randint(1, 4096, (2000,), generator=torch.Generator().manual_seed(5)).tolist()
    contexts = [ids[:100], ids[200:330], ids[400:464], []]
    turns = [ids[600:610], ids[700:770], ids[800:805], ids[900:940]]
    on_grid = [ids[1000:1064], ids[1100:1228], ids[1300:1364]]
    results = []
    for rows in (None, 0):
        eng = make_engine(device="cuda", slots=8) if rows is None else make_engine(device="cuda", slots=8,
                                                                                    batched_piece_rows=rows)
        assert bool(eng.graphs.piece_shapes) == (rows is None)
        forwards = []
        forward = eng.runner.model.forward
        eng.runner.model.forward = lambda *a, **kw: forwards.append(kw) or forward(*a, **kw)
        crowd = [eng.open(c) if c else eng.open() for c in contexts]
        grid_crowd = [eng.open(c) for c in on_grid]
        forwards.clear()
        logits = eng.append_many(crowd, turns)  # tails replayed: 36 and 2 rows
        logits += eng.append_many(grid_crowd, [ids[1500:1516]] * 3)  # every piece on the grid: none replayed
        # with graphs no eager forward ran; without, one per batch, replaying tails in the first only
        assert [kw["replay"] is not None for kw in forwards] == ([] if rows is None else [True, False])
        del eng.runner.model.forward
        state = [slot_bytes(eng, s) for s in crowd + grid_crowd]
        tokens = eng.generate(crowd + grid_crowd, 70, [SamplingParams(ignore_eos=True)] * 7)
        results.append((logits, state, [list(t) for t in tokens]))
        eng.close()
    (got, got_state, got_tokens), (want, want_state, want_tokens) = results
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == 7
    for a, b in zip(got_state, want_state):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert got_tokens == want_tokens
