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
    # decode buckets, prefill buckets, the batched re-derivation of grid points (b rows of 64 tokens) and the
    # speculative verify steps (b slots fed 2 to MAX_SPECULATE + 1 tokens each)
    assert set(g.graphs) == ({ShapeKey("decode", b, 1) for b in (1, 2, 4)} | {ShapeKey("prefill", 1, t) for t in (16, 32, 64, 128)}
                             | {ShapeKey("prefill_grid", 1, 128)}
                             | {ShapeKey("prefill", b, 64) for b in (2, 4)}
                             | {ShapeKey("verify", b, w) for b in (1, 2, 4) for w in range(2, MAX_SPECULATE + 2)})


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
