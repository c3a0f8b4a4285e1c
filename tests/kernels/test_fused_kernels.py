"""Fused Triton kernels (capsulert/kernels/triton_fused.py) against their plain-torch references
(capsulert/kernels/fused.py), over small labelled shapes, plus the Qwen3.5-9B shapes on a CUDA device.

Runs on a CUDA device, or on CPU under Triton's interpreter (TRITON_INTERPRET=1, slow: the small shapes only;
the shape lists are chosen by device when the module is collected). The whole module is gpu-marked; the CPU
CI (`-m "not gpu"`, no triton) never collects it.

The kernels compute in fp32 and round once, so they are compared with the reference evaluated in fp32 on the
same (already rounded) inputs: what remains is the kernel's final rounding and fp32 reduction order.
Batch invariance is checked bitwise: a row alone and the same row among other random rows, at several batch
sizes and positions.
"""
import os

import pytest
import torch

import triton  # noqa: F401  (tests/conftest.py ignores this module where triton is not installed)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda_or_interpreter():
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.fail("the Triton kernel tests need a CUDA device, or TRITON_INTERPRET=1 to run on the CPU")

from capsulert.kernels import fused as ref  # noqa: E402
from capsulert.kernels import triton_fused as tf  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
EPS = 1e-6
# batch sizes a row is embedded in for the invariance checks
BATCH_SIZES = [2, 17, 64] if CUDA else [2, 5]


def _shapes(small: dict, model_size: dict) -> dict:
    """The labelled shapes of a test: the small ones everywhere, the model-size ones on a CUDA device."""
    return {**small, **model_size} if CUDA else small


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype).to(DEVICE)


def _assert_untouched(after, before, slots):
    """Rows of the slot dimension not in `slots` are bitwise unchanged."""
    others = sorted(set(range(before.shape[0])) - set(slots.tolist()))
    assert torch.equal(after[others], before[others])


def _assert_rounded_like_torch(got, want):
    """Bitwise, except that Triton's interpreter casts fp32 to bf16 by truncation where the GPU rounds to
    nearest even: there, within one bf16 ulp."""
    if CUDA or got.dtype != torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2**-7, atol=0)


def _assert_row_invariant(make_rows, run):
    """make_rows(n, seed) -> per-row inputs (tensors whose dim 0 is the row); run(*rows) -> outputs (tuple,
    dim 0 the row). Row 0 of a solo run must come out bitwise the same inside batches of other random rows."""
    solo_in = make_rows(1, 0)
    solo_out = run(*solo_in)
    for n in BATCH_SIZES:
        for pos in sorted({0, n // 2, n - 1}):
            rows = make_rows(n, 1000 + n + pos)
            for t, s in zip(rows, solo_in):
                t[pos] = s[0]
            for got, want in zip(run(*rows), solo_out):
                assert torch.equal(got[pos], want[0]), f"row at {pos} of {n} differs from the row alone"


# ---------------------------------------------------------------- add + RMSNorm

ADD_NORM_SHAPES = _shapes(
    {
        "d16": (3, 16),
        "d24-ragged": (5, 24),
        "d80-rows-tokens": (2, 3, 80),
        "d1000-one-row": (1, 1000),
    },
    {
        "9b-decode": (64, 1, 4096),
        "9b-prefill": (1, 1024, 4096),
    },
)


@DTYPES
@pytest.mark.parametrize("with_x", [True, False], ids=["add", "no-add"])
@pytest.mark.parametrize("shape", ADD_NORM_SHAPES.values(), ids=ADD_NORM_SHAPES.keys())
def test_add_rms_norm(shape, with_x, dtype):
    D = shape[-1]
    h = _randn(*shape, seed=0, dtype=dtype, scale=3.0)
    x = _randn(*shape, seed=1, dtype=dtype) if with_x else None
    w = _randn(D, seed=2, dtype=dtype, scale=0.5)

    h_new, y = tf.add_rms_norm(h, x, w, EPS)
    assert h_new.shape == y.shape == h.shape and h_new.dtype == y.dtype == dtype
    if with_x:
        _assert_rounded_like_torch(h_new, h + x)  # the residual stream, rounded as torch's add rounds it
    else:
        assert h_new is h
    _, y_ref = ref.add_rms_norm(h_new.float(), None, w.float(), EPS)
    torch.testing.assert_close(y.float(), y_ref, **TOL[dtype])


@pytest.mark.parametrize("layout", ["row-slices", "not-flattenable"])
def test_add_rms_norm_strided(layout):
    """h, x as views: a slice of wider rows (no copy), and leading dims that cannot be viewed as rows."""
    R, T, D = 3, 4, 24
    if layout == "row-slices":
        h = _randn(R, T, 2 * D, seed=0)[..., :D]
        x = _randn(R, T, 3 * D, seed=1)[..., D:2 * D]
    else:
        h = _randn(T, R, D, seed=0).transpose(0, 1)
        x = _randn(T, R, D, seed=1).transpose(0, 1)
    w = _randn(D, seed=2, scale=0.5)
    h_ref, y_ref = ref.add_rms_norm(h, x, w, EPS)
    h_new, y = tf.add_rms_norm(h, x, w, EPS)
    assert torch.equal(h_new, h_ref)
    torch.testing.assert_close(y, y_ref, **TOL[torch.float32])


@pytest.mark.parametrize("D", [24, 4096] if CUDA else [24], ids=lambda d: f"d{d}")
def test_add_rms_norm_batch_invariant(D):
    w = _randn(D, seed=2, dtype=torch.bfloat16, scale=0.5)
    _assert_row_invariant(
        lambda n, seed: [_randn(n, D, seed=seed, dtype=torch.bfloat16, scale=3.0),
                         _randn(n, D, seed=seed + 1, dtype=torch.bfloat16)],
        lambda h, x: tf.add_rms_norm(h, x, w, EPS),
    )


# ---------------------------------------------------------------- gated RMSNorm

GATED_NORM_SHAPES = _shapes(  # leading dims..., H, D
    {
        "h2-d16": (3, 2, 16),
        "h3-d24-ragged": (2, 3, 24),
        "h5-d80-rows-tokens": (2, 2, 5, 80),
    },
    {
        "9b-decode": (64, 1, 32, 128),
        "9b-prefill": (1, 1024, 32, 128),
    },
)


def _gated_norm_inputs(shape, dtype, z_layout, seed=0):
    *lead, H, D = shape
    o = _randn(*shape, seed=seed, scale=2.0)
    if z_layout == "packed":  # z as the model gets it from a packed projection: columns of wider rows
        z = _randn(*lead, 3 * H * D, seed=seed + 1, dtype=dtype)[..., H * D:2 * H * D].view(*lead, H, D)
    else:
        z = _randn(*shape, seed=seed + 1, dtype=dtype)
    w = _randn(D, seed=seed + 2, dtype=dtype, scale=0.5) + 1.0
    return o, z, w


@DTYPES
@pytest.mark.parametrize("z_layout", ["contiguous", "packed"])
@pytest.mark.parametrize("shape", GATED_NORM_SHAPES.values(), ids=GATED_NORM_SHAPES.keys())
def test_gated_rms_norm(shape, z_layout, dtype):
    o, z, w = _gated_norm_inputs(shape, dtype, z_layout)
    y = tf.gated_rms_norm(o, z, w, EPS)
    assert y.shape == z.shape and y.dtype == dtype and y.is_contiguous()
    # the model rounds o to its dtype first: part of the semantics, so the fp32 evaluation does too
    y_ref = ref.gated_rms_norm(o.to(dtype).float(), z.float(), w.float(), EPS)
    torch.testing.assert_close(y.float(), y_ref, **TOL[dtype])


def test_gated_rms_norm_batch_invariant():
    H, D = (32, 128) if CUDA else (3, 24)
    w = _randn(D, seed=2, dtype=torch.bfloat16, scale=0.5) + 1.0
    _assert_row_invariant(
        lambda n, seed: [_randn(n, 1, H, D, seed=seed, scale=2.0),
                         _randn(n, 1, H, D, seed=seed + 1, dtype=torch.bfloat16)],
        lambda o, z: (tf.gated_rms_norm(o, z, w, EPS),),
    )


# ---------------------------------------------------------------- per-head RMSNorm + rotary

ROPE_SHAPES = _shapes(  # R, T, H, D, rotary_dim
    {
        "h2-d16-rot8": (2, 1, 2, 16, 8),
        "h3-d24-rot8-ragged": (1, 3, 3, 24, 8),
        "h2-d80-rot20": (2, 2, 2, 80, 20),
        "h2-d32-full-rotary": (1, 2, 2, 32, 32),
    },
    {
        "9b-q-decode": (64, 1, 16, 256, 64),
        "9b-k-decode": (64, 1, 4, 256, 64),
        "9b-q-prefill": (1, 1024, 16, 256, 64),
    },
)


def _rope(R, T, rot, dtype, seed):
    """cos, sin [R, T, rot] as the model builds them: positions times inverse frequencies, halves repeated."""
    pos = torch.randint(0, 5000, (R, 1), generator=_gen(seed)) + torch.arange(T)
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    freqs = pos[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)


def _rope_inputs(shape, dtype, layout, seed=0):
    R, T, H, D, rot = shape
    if layout == "q-with-gate":  # q as the model gets it: each head's q followed by its gate
        x = _randn(R, T, H, 2 * D, seed=seed, dtype=dtype, scale=2.0)[..., :D]
    else:
        x = _randn(R, T, H, D, seed=seed, dtype=dtype, scale=2.0)
    w = _randn(D, seed=seed + 1, dtype=dtype, scale=0.5)
    cos, sin = _rope(R, T, rot, dtype, seed + 2)
    return x, w, cos, sin


@DTYPES
@pytest.mark.parametrize("layout", ["contiguous", "q-with-gate"])
@pytest.mark.parametrize("shape", ROPE_SHAPES.values(), ids=ROPE_SHAPES.keys())
def test_head_norm_rope(shape, layout, dtype):
    rot = shape[-1]
    x, w, cos, sin = _rope_inputs(shape, dtype, layout)
    y = tf.head_norm_rope(x, w, cos, sin, rot, EPS)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    y_ref = ref.head_norm_rope(x.float(), w.float(), cos.float(), sin.float(), rot, EPS)
    torch.testing.assert_close(y.float(), y_ref, **TOL[dtype])


def test_head_norm_rope_batch_invariant():
    T, H, D, rot = (1, 16, 256, 64) if CUDA else (2, 3, 24, 8)
    w = _randn(D, seed=1, dtype=torch.bfloat16, scale=0.5)

    def make_rows(n, seed):
        x = _randn(n, T, H, 2 * D, seed=seed, dtype=torch.bfloat16, scale=2.0)
        return [x, *_rope(n, T, rot, torch.bfloat16, seed + 1)]

    # x is the q half of each row (a strided view of the row's q|gate)
    _assert_row_invariant(make_rows, lambda x, cos, sin: (tf.head_norm_rope(x[..., :D], w, cos, sin, rot, EPS),))


# ---------------------------------------------------------------- silu(gate) * up

SILU_MUL_SHAPES = _shapes(  # leading dims..., 2I
    {
        "i16": (3, 32),
        "i24-rows-tokens": (2, 3, 48),
        "i80": (5, 160),
        "i1500-two-blocks": (2, 3000),
    },
    {
        "9b-decode": (64, 1, 2 * 12288),
        "9b-prefill": (1, 1024, 2 * 12288),
    },
)


@DTYPES
@pytest.mark.parametrize("shape", SILU_MUL_SHAPES.values(), ids=SILU_MUL_SHAPES.keys())
def test_silu_mul(shape, dtype):
    gu = _randn(*shape, seed=0, dtype=dtype, scale=3.0)
    y = tf.silu_mul(gu)
    assert y.shape == shape[:-1] + (shape[-1] // 2,) and y.dtype == dtype
    torch.testing.assert_close(y.float(), ref.silu_mul(gu.float()), **TOL[dtype])


def test_silu_mul_strided():
    """gu as a column slice of a wider projection output."""
    gu = _randn(3, 2, 5 * 48, seed=0, scale=3.0)[..., 48:3 * 48]
    torch.testing.assert_close(tf.silu_mul(gu), ref.silu_mul(gu), **TOL[torch.float32])


def test_silu_mul_batch_invariant():
    I2 = 2 * 12288 if CUDA else 48
    _assert_row_invariant(
        lambda n, seed: [_randn(n, I2, seed=seed, dtype=torch.bfloat16, scale=3.0)],
        lambda gu: (tf.silu_mul(gu),),
    )


# ---------------------------------------------------------------- Gated DeltaNet decode step

DELTA_SHAPES = _shapes(  # B, Hk, Hv, Dk, Dv, num_slots, slot ids
    {
        "hk2-hv2-d16": (3, 2, 2, 16, 16, 5, [3, 0, 2]),
        "hk2-hv4-k16-v32": (2, 2, 4, 16, 32, 4, [2, 1]),
        "hk1-hv3-k24-v80-ragged": (2, 1, 3, 24, 80, 4, [3, 0]),  # K padded to 32, V in 2 blocks, last partial
        "hk2-hv4-k32-v16-b1": (1, 2, 4, 32, 16, 3, [2]),
    },
    {
        "9b-decode-64": (64, 16, 32, 128, 128, 80, torch.randperm(80, generator=_gen(5))[:64].tolist()),
    },
)


def _delta_inputs(B, Hk, Hv, Dk, Dv, num_slots, dtype, layout, seed=0):
    C = 2 * Hk * Dk + Hv * Dv
    if layout == "packed":  # as the model gets them: column slices of one projection output
        packed = _randn(B, C + 2 * Hv + 8, seed=seed, dtype=dtype)
        packed[:, C + Hv:] *= 3.0
        mixed, b, a = packed[:, :C], packed[:, C:C + Hv], packed[:, C + Hv:C + 2 * Hv]
    else:
        mixed = _randn(B, C, seed=seed, dtype=dtype)
        b, a = _randn(B, Hv, seed=seed + 1, dtype=dtype), _randn(B, Hv, seed=seed + 2, dtype=dtype, scale=3.0)
    # both softplus regimes: past the threshold (softplus(x) = x) and deep in the exp tail
    a[0, 0] = 24.0
    a[-1, -1] = -40.0
    neg_A = -_randn(Hv, seed=seed + 3).exp()
    dt_bias = _randn(Hv, seed=seed + 4, dtype=dtype, scale=0.5)
    ssm = _randn(num_slots, Hv, Dk, Dv, seed=seed + 5, scale=0.3)
    return mixed, a, b, neg_A, dt_bias, ssm


@DTYPES
@pytest.mark.parametrize("layout", ["contiguous", "packed"])
@pytest.mark.parametrize("shape", DELTA_SHAPES.values(), ids=DELTA_SHAPES.keys())
def test_gated_delta_step_fused(shape, layout, dtype):
    B, Hk, Hv, Dk, Dv, num_slots, ids = shape
    mixed, a, b, neg_A, dt_bias, ssm = _delta_inputs(B, Hk, Hv, Dk, Dv, num_slots, dtype, layout)
    slots = torch.tensor(ids, dtype=torch.int64, device=DEVICE)
    before = ssm.clone()
    ssm_ref = ssm.clone()
    o_ref = ref.gated_delta_step_fused(mixed, a, b, neg_A, dt_bias, ssm_ref, slots, Hk, Dk, Dv)

    o = tf.gated_delta_step_fused(mixed, a, b, neg_A, dt_bias, ssm, slots, Hk, Dk, Dv)
    assert o.shape == (B, Hv, Dv) and o.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, **TOL[dtype])
    torch.testing.assert_close(ssm[slots], ssm_ref[slots], **TOL[dtype])
    _assert_untouched(ssm, before, slots)


def test_gated_delta_step_fused_repeated_steps():
    """Several steps in a row on the same slots: the in-place state carries as the reference's does."""
    B, Hk, Hv, Dk, Dv, num_slots = 2, 1, 2, 16, 16, 4
    slots = torch.tensor([3, 1], device=DEVICE)
    *_, ssm = _delta_inputs(B, Hk, Hv, Dk, Dv, num_slots, torch.float32, "contiguous", seed=1)
    ssm_ref = ssm.clone()
    for step in range(3):
        mixed, a, b, neg_A, dt_bias, _ = _delta_inputs(B, Hk, Hv, Dk, Dv, 1, torch.float32, "contiguous",
                                                       seed=10 * step)
        o_ref = ref.gated_delta_step_fused(mixed, a, b, neg_A, dt_bias, ssm_ref, slots, Hk, Dk, Dv)
        o = tf.gated_delta_step_fused(mixed, a, b, neg_A, dt_bias, ssm, slots, Hk, Dk, Dv)
        torch.testing.assert_close(o, o_ref, **TOL[torch.float32])
    torch.testing.assert_close(ssm, ssm_ref, **TOL[torch.float32])


def test_gated_delta_step_fused_batch_invariant():
    """A slot's output and new state alone, and among other rows (other slots, states, inputs)."""
    Hk, Hv, Dk, Dv = (16, 32, 128, 128) if CUDA else (1, 2, 24, 80)
    dtype = torch.bfloat16
    mixed, a, b, neg_A, dt_bias, _ = _delta_inputs(1, Hk, Hv, Dk, Dv, 1, dtype, "contiguous", seed=0)
    state = _randn(1, Hv, Dk, Dv, seed=1, scale=0.3)

    def step(rows_mixed, rows_a, rows_b, rows_state):
        n = rows_mixed.shape[0]
        slots = torch.randperm(n, generator=_gen(n)).to(DEVICE)  # rows live in scattered slots
        ssm = torch.empty(n, Hv, Dk, Dv, device=DEVICE)
        ssm[slots] = rows_state
        o = tf.gated_delta_step_fused(rows_mixed, rows_a, rows_b, neg_A, dt_bias, ssm, slots, Hk, Dk, Dv)
        return o, ssm[slots]

    solo_in = (mixed, a, b, state)
    solo_o, solo_s = step(*solo_in)
    for n in BATCH_SIZES:
        for pos in sorted({0, n // 2, n - 1}):
            rows_mixed, rows_a, rows_b, _, _, _ = _delta_inputs(n, Hk, Hv, Dk, Dv, 1, dtype, "contiguous",
                                                                seed=100 + n + pos)
            rows_state = _randn(n, Hv, Dk, Dv, seed=200 + n + pos, scale=0.3)
            rows = (rows_mixed, rows_a, rows_b, rows_state)
            for t, s in zip(rows, solo_in):
                t[pos] = s[0]
            o, s_new = step(*rows)
            assert torch.equal(o[pos], solo_o[0]) and torch.equal(s_new[pos], solo_s[0]), (pos, n)


# ---------------------------------------------------------------- CUDA graphs

def _capture(fn):
    """Warm up (compile) on a side stream, then capture fn() in a CUDA graph; returns (graph, output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


if CUDA:  # defined only where it can run: graph capture needs a real CUDA device
    def test_cuda_graph_capture_replay_matches_eager():
        """Each kernel captured once, its inputs refilled in place, replayed: bitwise the eager result."""
        bf = torch.bfloat16
        h, x = _randn(64, 4096, seed=0, dtype=bf), _randn(64, 4096, seed=1, dtype=bf)
        w_h = _randn(4096, seed=2, dtype=bf)
        o, z, w_z = _gated_norm_inputs((64, 1, 32, 128), bf, "packed")
        q, w_q, cos, sin = _rope_inputs((64, 1, 16, 256, 64), bf, "q-with-gate")
        gu = _randn(64, 2 * 12288, seed=3, dtype=bf)
        mixed, a, b, neg_A, dt_bias, ssm0 = _delta_inputs(64, 16, 32, 128, 128, 80, bf, "packed")
        ssm = ssm0.clone()
        slots = torch.arange(64, device=DEVICE)

        def run():
            return (*tf.add_rms_norm(h, x, w_h, EPS), tf.gated_rms_norm(o, z, w_z, EPS),
                    tf.head_norm_rope(q, w_q, cos, sin, 64, EPS), tf.silu_mul(gu),
                    tf.gated_delta_step_fused(mixed, a, b, neg_A, dt_bias, ssm, slots, 16, 128, 128))

        graph, outs = _capture(run)
        for i, t in enumerate((h, x, o, z, q, cos, sin, gu, mixed, a, b)):
            t.copy_(torch.randn(t.shape, generator=_gen(50 + i)).to(t.dtype))
        slots.copy_(torch.randperm(80, generator=_gen(7))[:64])
        ssm.copy_(ssm0)
        graph.replay()
        ssm_e = ssm0.clone()
        eager = (*tf.add_rms_norm(h, x, w_h, EPS), tf.gated_rms_norm(o, z, w_z, EPS),
                 tf.head_norm_rope(q, w_q, cos, sin, 64, EPS), tf.silu_mul(gu),
                 tf.gated_delta_step_fused(mixed, a, b, neg_A, dt_bias, ssm_e, slots.clone(), 16, 128, 128))
        torch.cuda.synchronize()
        for got, want in zip(outs, eager):
            assert torch.equal(got, want)
        assert torch.equal(ssm, ssm_e)
