"""The Triton mixture-of-experts kernels (capsulert/kernels/triton_moe*.py) against their plain-torch references
(capsulert/kernels/moe.py), over small labelled shapes, plus the Qwen3.5-35B-A3B shapes on a CUDA device.

Runs on a CUDA device, or on CPU under Triton's interpreter (TRITON_INTERPRET=1, slow: the small shapes only).
The whole module is gpu-marked; the CPU CI (`-m "not gpu"`, no triton) never collects it.

Routing picks the same experts as the reference (inputs without near-ties) with weights within fp32 rounding.
The experts compute in fp32 and round once, so they are compared with the reference evaluated in fp32 on the
same (already rounded) inputs. Batch invariance is checked bitwise: a token's output alone and among other
tokens, at several positions, including batches where every token chose the same experts (many rows per
expert: several row tiles) and padding rows that are not routed.
"""
import pytest
import torch

import triton  # noqa: F401  (tests/conftest.py ignores this module where triton is not installed)

from capsulert.kernels import moe as ref
from capsulert.kernels import triton_moe as tm
from capsulert.kernels import triton_moe_route as tr
from tests.kernels.routing import route_logits

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_or_interpreter")]
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# the expert GEMMs in bf16 on a CUDA device only: Triton's interpreter runs a bf16 tl.dot as a matmul of the
# raw 16-bit patterns (triton 3.9), which is no test of the kernel
DOT_DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if CUDA else [torch.float32],
                                     ids=["fp32", "bf16"] if CUDA else ["fp32"])
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _shapes(small: dict, model_size: dict) -> dict:
    """The labelled shapes of a test: the small ones everywhere, the model-size ones on a CUDA device."""
    return {**small, **model_size} if CUDA else small


def _randn(*shape, seed, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEVICE)


# ---------------------------------------------------------------- routing

ROUTE_SHAPES = _shapes(
    {"e8-k2": (5, 8, 2), "e6-k3": (7, 6, 3), "e64-k8": (3, 64, 8), "e40-k5-ragged": (4, 40, 5)},
    {"35b-e256-k8-b64": (64, 256, 8), "35b-e256-k8-chunk": (1024, 256, 8)},
)


@pytest.mark.parametrize("shape", ROUTE_SHAPES.values(), ids=ROUTE_SHAPES.keys())
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "raw"])
@DOT_DTYPES
def test_route_matches_reference(shape, normalize, dtype):
    n, E, k = shape
    # distinct logits a clear step apart: no near-ties whose order rounding could flip
    logits = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(i)) for i in range(n)])
    logits = (logits.float() * 0.05).to(dtype).to(DEVICE)
    ids, w = route_logits(tr.moe_route, logits, k, normalize)
    want_ids, want_w = route_logits(ref.moe_route, logits, k, normalize)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-6)


def test_route_ties_go_to_the_lowest_expert_id():
    logits = torch.zeros(3, 8, device=DEVICE)
    logits[1, 5] = logits[1, 6] = 1.0  # a tie at the top
    ids, w = route_logits(tr.moe_route, logits, 3, True)
    assert ids.tolist() == [[0, 1, 2], [5, 6, 0], [0, 1, 2]]
    assert torch.equal(ids.long(), route_logits(ref.moe_route, logits, 3, True)[0])


# the router's input width over several KS slices (ragged), its experts over several column blocks
GATE_SHAPES = _shapes({"h300-e40": (300, 40)}, {"35b-h2048-e256": (2048, 256)})


@pytest.mark.parametrize("shape", GATE_SHAPES.values(), ids=GATE_SHAPES.keys())
def test_router_logits_and_the_shared_logit_match_reference(shape):
    """Random weights (fp32, so the reference's GEMM rounds nothing the kernel keeps), the first 5 of 7 rows
    routed: the same experts, and every row's shared-expert logit."""
    H, E = shape
    x, router, gate = _randn(7, H, seed=20), _randn(E, H, seed=21, scale=H ** -0.5), _randn(1, H, seed=22)
    ids, w, logit = tr.moe_route(x, router, gate, 5, 8, True)
    want_ids, want_w, want_logit = ref.moe_route(x, router, gate, 5, 8, True)
    assert ids.shape == (5, 8) and logit.shape == (7, 1) and logit.dtype == torch.float32
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(w, want_w, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logit, want_logit, rtol=1e-4, atol=1e-4)


@DOT_DTYPES
def test_route_row_invariant(dtype):
    """A row's experts, weights and shared logit alone and among other rows (several 16-row tiles of the
    router's GEMM), routed or padding."""
    H, E = (2048, 256) if CUDA else (300, 40)
    router, gate = _randn(E, H, seed=30, dtype=dtype, scale=H ** -0.5), _randn(1, H, seed=31, dtype=dtype)
    row = _randn(1, H, seed=32, dtype=dtype)
    solo = tr.moe_route(row, router, gate, 1, 8, True)
    for R, n, pos in [(2, 2, 1), (17, 17, 0), (33, 33, 20), (40, 3, 2), (40, 3, 35)]:
        batch = _randn(R, H, seed=33 + R, dtype=dtype)
        batch[pos] = row[0]
        ids, w, logit = tr.moe_route(batch, router, gate, n, 8, True)
        assert torch.equal(logit[pos], solo[2][0])
        if pos < n:
            assert torch.equal(ids[pos], solo[0][0]) and torch.equal(w[pos], solo[1][0])


# ---------------------------------------------------------------- experts + combine

EXPERT_SHAPES = _shapes(  # n routed rows, R rows in all, H, I, E, k, S (the shared expert's width)
    {"h64-i32-e8-k2": (6, 6, 64, 32, 8, 2, 32), "h48-i40-e6-k3-ragged": (5, 7, 48, 40, 6, 3, 40),
     "h160-i96-e4-k2-tiles": (20, 20, 160, 96, 4, 2, 96), "padded-r8": (3, 8, 64, 32, 8, 2, 32),
     "shared-wider-s48": (6, 6, 64, 32, 8, 2, 48), "shared-narrower-s24": (5, 9, 64, 40, 8, 2, 24),
     "shared-several-programs-r300": (280, 300, 64, 32, 8, 2, 32)},
    {"35b-b1": (1, 64, 2048, 512, 256, 8, 512), "35b-b64": (64, 64, 2048, 512, 256, 8, 512),
     "35b-chunk": (1024, 1024, 2048, 512, 256, 8, 512)},
)


def _expert_inputs(n, R, H, I, E, k, dtype, seed=0, same_experts=False, experts=None, S=None):
    """x [R, H], ids, routing weights (n rows), the layer's ExpertWeights (`experts`: reuse these), shared_logit.
    S: the shared expert's width (I unless given)."""
    S = S or I
    x = _randn(R, H, seed=seed, dtype=dtype)
    experts = experts or ref.ExpertWeights(
        _randn(E, 2 * I, H, seed=seed + 1, dtype=dtype, scale=H ** -0.5),
        _randn(E, H, I, seed=seed + 2, dtype=dtype, scale=I ** -0.5),
        _randn(S, H, seed=seed + 3, dtype=dtype, scale=H ** -0.5),
        _randn(S, H, seed=seed + 6, dtype=dtype, scale=H ** -0.5),
        _randn(H, S, seed=seed + 7, dtype=dtype, scale=S ** -0.5))
    shared_logit = _randn(R, 1, seed=seed + 4, dtype=dtype)
    logits = _randn(n, E, seed=seed + 5)
    if same_experts:
        logits = logits[:1].expand(n, E).contiguous()
    ids, w = route_logits(ref.moe_route, logits, k, True)
    return x, ids.to(DEVICE), w.to(DEVICE), experts, shared_logit


def _fp32(*ts):
    return [ref.ExpertWeights(*_fp32(*t)) if isinstance(t, ref.ExpertWeights) else
            t.float() if t.is_floating_point() else t for t in ts]


@pytest.mark.parametrize("shape", EXPERT_SHAPES.values(), ids=EXPERT_SHAPES.keys())
@DOT_DTYPES
def test_experts_match_reference(shape, dtype):
    *dims, S = shape
    args = _expert_inputs(*dims, dtype=dtype, S=S)
    got = tm.moe_experts(*args)
    assert got.dtype == dtype and got.shape == (shape[1], shape[2])
    want = ref.moe_experts(*_fp32(*args)) if dtype != torch.float32 else ref.moe_experts(*args)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_experts_all_rows_on_one_expert_set_span_several_row_tiles():
    """Every token chose the same experts: each expert gets more rows than one BM tile holds."""
    n = 3 * tm.SMALL.gate_up["BM"] + 5
    args = _expert_inputs(n, n, 64, 32, 8, 2, torch.float32, same_experts=True)
    torch.testing.assert_close(tm.moe_experts(*args), ref.moe_experts(*args), **TOL[torch.float32])


@DOT_DTYPES
def test_experts_row_invariant(dtype):
    """A token's output alone equals its output among other tokens, wherever it sits and however many of them
    chose its experts (random routing, or all on its experts)."""
    H, I, E, k = (2048, 512, 256, 8) if CUDA else (64, 32, 8, 2)
    solo_args = _expert_inputs(1, 1, H, I, E, k, dtype, seed=50)
    solo = tm.moe_experts(*solo_args)[0]
    experts = solo_args[3]
    # the last case puts the row in a later program of the shared expert (Tiles.shared_rows rows each)
    for n, pos, same in [(2, 1, False), (9, 4, False), (40, 39, True), (40, 0, False), (200, 150, False)]:
        x, ids, w, _, logit = _expert_inputs(n, n, H, I, E, k, dtype, seed=60 + n, experts=experts)
        if same:
            ids[:], w[:] = solo_args[1][0], solo_args[2][0]
        x[pos], ids[pos], w[pos], logit[pos] = solo_args[0][0], solo_args[1][0], solo_args[2][0], solo_args[4][0]
        got = tm.moe_experts(x, ids, w, experts, logit)
        assert torch.equal(got[pos], solo), f"row at {pos} of {n} differs from the row alone"


# the 64-row set runs bf16 on a CUDA device only (the interpreter runs the fp32 GEMMs only; fp32 takes SMALL)
TILE_SETS = pytest.mark.parametrize("tiles", [tm.SMALL, tm.LARGE] if CUDA else [tm.SMALL],
                                    ids=["small", "large"] if CUDA else ["small"])


@TILE_SETS
def test_experts_match_reference_under_each_tile_set(tiles):
    dtype = torch.bfloat16 if CUDA else torch.float32
    args = _expert_inputs(150, 150, 256, 128, 8, 2, dtype, same_experts=True)
    got = tm.moe_experts(*args, tiles=tiles)
    torch.testing.assert_close(got.float(), ref.moe_experts(*_fp32(*args)).float(), **TOL[dtype])


def test_tile_set_follows_the_rows_and_the_dtype():
    assert tm.tiles_for(1, torch.bfloat16, tm.LARGE_FROM_ROWS) is tm.SMALL
    assert tm.tiles_for(tm.LARGE_FROM_ROWS - 1, torch.bfloat16, tm.LARGE_FROM_ROWS) is tm.SMALL
    assert tm.tiles_for(tm.LARGE_FROM_ROWS, torch.bfloat16, tm.LARGE_FROM_ROWS) is tm.LARGE
    assert tm.tiles_for(4096, torch.float16, tm.LARGE_FROM_ROWS) is tm.LARGE
    assert tm.tiles_for(4096, torch.float32, tm.LARGE_FROM_ROWS) is tm.SMALL  # does not fit shared memory
    assert tm.tiles_for(4096, torch.bfloat16, None) is tm.SMALL


if CUDA:
    def test_a_row_gets_the_same_bits_under_both_tile_sets():
        """The condition for choosing the tile set from the number of rows (a row of a long prefill piece and
        the same row in a decode step or a short append): bitwise, at the 35B-A3B layer shape, with experts of
        one row and experts of several 64-row tiles."""
        assert tm.tiles_agree(torch.bfloat16, DEVICE)
        H, I, E, k, n = 2048, 512, 256, 8, 1100
        x, ids, w, experts, logit = _expert_inputs(n, n, H, I, E, k, torch.bfloat16, seed=70)
        ids[: n // 2] = torch.arange(k, device=DEVICE, dtype=ids.dtype)  # 550 rows on experts 0..7
        small = tm.moe_experts(x, ids, w, experts, logit, tiles=tm.SMALL)
        large = tm.moe_experts(x, ids, w, experts, logit)  # n >= LARGE_FROM_ROWS: the large set
        assert n >= tm.LARGE_FROM_ROWS and torch.equal(small, large)
        solo = tm.moe_experts(x[5:6], ids[5:6], w[5:6], experts, logit[5:6])  # the small set
        assert torch.equal(solo[0], large[5])

    def test_tiles_agree_runs_nothing_for_a_dtype_the_large_set_never_runs_in(monkeypatch):
        """An fp32 MoE engine on CUDA (a parity setting) never runs LARGE, whose fp32 tile would not fit in
        shared memory: the start-up check must not launch it either."""
        monkeypatch.setattr(tm, "moe_experts", lambda *a, **k: pytest.fail("tiles_agree launched the experts"))
        assert tm.tiles_agree(torch.float32, DEVICE)

    def test_engine_runs_small_tiles_only_where_the_sets_disagree(monkeypatch, tiny_moe_dir, caplog):
        from capsulert.engine.engine import Engine

        eng = Engine.from_config(model=str(tiny_moe_dir), device="cuda", slots=2, max_seq=256, cuda_graphs=False)
        assert eng.model.kernels.moe_experts is tm.moe_experts
        monkeypatch.setattr(tm, "tiles_agree", lambda dtype, device: False)
        with caplog.at_level("WARNING", logger="capsulert.engine"):
            eng = Engine.from_config(model=str(tiny_moe_dir), device="cuda", slots=2, max_seq=256, cuda_graphs=False)
        assert eng.model.kernels.moe_experts.keywords == {"large_from": None}
        assert "16-row tiles" in caplog.text


def test_padding_rows_get_the_shared_expert_only_and_unchosen_experts_do_no_work():
    n, R, H, I, E, k = 3, 8, 64, 32, 8, 2
    x, ids, w, experts, logit = _expert_inputs(n, R, H, I, E, k, torch.float32)
    unchosen = sorted(set(range(E)) - set(ids.flatten().tolist()))
    assert unchosen
    gate_up, down = experts.gate_up.clone(), experts.down.clone()
    gate_up[unchosen], down[unchosen] = float("nan"), float("nan")  # read by no program
    got = tm.moe_experts(x, ids, w, experts._replace(gate_up=gate_up, down=down), logit)
    assert torch.isfinite(got).all()
    shared_only = ref.moe_experts(x[n:], ids[:0], w[:0], experts, logit[n:])
    torch.testing.assert_close(got[n:], shared_only, **TOL[torch.float32])


def test_the_shared_expert_is_computed_for_every_row():
    """Its weights reach every row, routed or padding, and the sigmoid gate scales it: a zero shared down
    projection leaves the routed sum alone; a logit of -inf switches it off."""
    n, R, H, I, E, k = 4, 6, 64, 32, 8, 2
    x, ids, w, experts, logit = _expert_inputs(n, R, H, I, E, k, torch.float32, seed=3)
    full = tm.moe_experts(x, ids, w, experts, logit)
    off = torch.full_like(logit, float("-inf"))
    no_down = experts._replace(shared_down_proj=torch.zeros_like(experts.shared_down_proj))
    routed = tm.moe_experts(x, ids, w, no_down, logit)
    assert torch.equal(tm.moe_experts(x, ids, w, experts, off), routed)
    assert not torch.equal(full[:n], routed[:n]) and not routed[n:].any() and full[n:].abs().min() > 0
    torch.testing.assert_close(full, ref.moe_experts(x, ids, w, experts, logit), **TOL[torch.float32])


ADD_NORM_SHAPES = _shapes({"h64-r6": (6, 6, 64, 32, 8, 2, 32), "h48-ragged-padded": (5, 7, 48, 40, 6, 3, 40)},
                          {"35b-b1": (1, 1, 2048, 512, 256, 8, 512), "35b-b64": (64, 64, 2048, 512, 256, 8, 512)})


@pytest.mark.parametrize("shape", ADD_NORM_SHAPES.values(), ids=ADD_NORM_SHAPES.keys())
@DOT_DTYPES
def test_combine_with_add_norm_is_add_rms_norm_of_the_output(shape, dtype):
    """The combine that adds the block's output to the residual stream and runs the next layer's input norm
    gives bitwise what the plain combine followed by add_rms_norm gives (the launch it saves), and the reference's
    add_norm branch is that composition too."""
    from capsulert.kernels import fused
    from capsulert.kernels.triton_fused import add_rms_norm
    *dims, S = shape
    x, ids, w, experts, logit = _expert_inputs(*dims, dtype=dtype, S=S)
    R, H = x.shape
    h, norm_w = _randn(R, H, seed=20, dtype=dtype), _randn(H, seed=21, dtype=dtype, scale=0.1)
    add_norm = ref.AddNorm(h, norm_w, 1e-6)
    got_h, got_x = tm.moe_experts(x, ids, w, experts, logit, add_norm)
    want_h, want_x = add_rms_norm(h, tm.moe_experts(x, ids, w, experts, logit), norm_w, 1e-6)
    assert torch.equal(got_h, want_h) and torch.equal(got_x, want_x)
    args = _fp32(x, ids, w, experts, logit) if dtype != torch.float32 else (x, ids, w, experts, logit)
    ref_h, ref_x = ref.moe_experts(*args, ref.AddNorm(h.float(), norm_w.float(), 1e-6))
    composed = fused.add_rms_norm(h.float(), ref.moe_experts(*args), norm_w.float(), 1e-6)
    assert torch.equal(ref_h, composed[0]) and torch.equal(ref_x, composed[1])
    torch.testing.assert_close(got_x.float(), ref_x, **TOL[dtype])


if CUDA:
    def test_cuda_graph_capture_replay_matches_eager():
        n, R, H, I, E, k = 64, 64, 2048, 512, 256, 8
        x, _, _, experts, _ = _expert_inputs(n, R, H, I, E, k, torch.bfloat16)
        router, gate = _randn(E, H, seed=9, dtype=torch.bfloat16), _randn(1, H, seed=8, dtype=torch.bfloat16)

        def step():
            i, rw, logit = tr.moe_route(x, router, gate, n, k, True)
            return tm.moe_experts(x, i, rw, experts, logit)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # compile outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        x.copy_(_randn(n, H, seed=11, dtype=torch.bfloat16))
        graph.replay()
        assert torch.equal(out, step())
