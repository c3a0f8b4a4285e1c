"""The fused references (capsulert/kernels/fused.py) compute bitwise what the model's unfused code computes.

Each test writes out the model's own composition (the unfused helpers and ops of engine/model.py, as the layer code used
them, on whole projection outputs) and compares with torch.equal, on the CPU, in fp32 and bf16. Where the
model is moving to packed projections, the reference also gets its inputs as column views of one packed
output and must still give the unpacked model's bits.
"""
import pytest
import torch
import torch.nn.functional as F

from capsulert.kernels import fused
from capsulert.kernels.fused import gated_delta_step_inplace_ref, l2_normalize, rms_norm_1p, rotate_half


def gated_rms_norm(x, gate, w, eps):
    """The model's unfused Gated DeltaNet output norm, as it was written before the fused stages."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return ((w * xf.to(dtype)) * F.silu(gate.float())).to(dtype)

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
EPS = 1e-6


def _randn(*shape, seed, dtype, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _packed(*parts):
    """The parts [..., n_i] as column views of one packed [..., sum n_i] tensor (as a packed GEMM gives)."""
    whole = torch.cat(parts, dim=-1)
    return list(whole.split([p.shape[-1] for p in parts], dim=-1))


def _assert_equal(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


@DTYPES
@pytest.mark.parametrize("shape", [(3, 1, 40), (1, 37, 24), (5, 7)], ids=["decode", "prefill", "rows"])
def test_add_rms_norm_is_the_models_residual_and_norm(shape, dtype):
    h, x = _randn(*shape, seed=0, dtype=dtype, scale=3.0), _randn(*shape, seed=1, dtype=dtype)
    w = _randn(shape[-1], seed=2, dtype=dtype, scale=0.5)
    h_new, y = fused.add_rms_norm(h, x, w, EPS)
    h_model = h + x
    _assert_equal(h_new, h_model)
    _assert_equal(y, rms_norm_1p(h_model, w, EPS))
    h_same, y = fused.add_rms_norm(h, None, w, EPS)
    assert h_same is h
    _assert_equal(y, rms_norm_1p(h, w, EPS))


@DTYPES
@pytest.mark.parametrize("shape", [(3, 1, 4, 16), (1, 37, 3, 24)], ids=["decode", "prefill"])
def test_gated_rms_norm_is_the_models_output_norm(shape, dtype):
    *lead, H, D = shape
    o = _randn(*shape, seed=0, dtype=torch.float32, scale=2.0)  # the recurrent kernels' fp32 output
    z = _randn(*lead, H * D, seed=1, dtype=dtype)  # the model's z projection [R, T, H*D]
    w = _randn(D, seed=2, dtype=dtype, scale=0.5) + 1.0
    want = gated_rms_norm(o.to(dtype), z.view(shape), w, EPS)
    _assert_equal(fused.gated_rms_norm(o, z.view(shape), w, EPS), want)
    z_packed = _packed(_randn(*lead, 5, seed=3, dtype=dtype), z, _randn(*lead, 3, seed=4, dtype=dtype))[1]
    _assert_equal(fused.gated_rms_norm(o, z_packed.view(shape), w, EPS), want)


def _rope(R, T, rot, dtype):
    pos = torch.arange(R)[:, None] * 17 + torch.arange(T)
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    freqs = pos[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@DTYPES
@pytest.mark.parametrize("shape", [(3, 1, 4, 2, 32, 8), (1, 9, 2, 1, 24, 24)],
                         ids=["decode-partial-rotary", "prefill-full-rotary"])
def test_head_norm_rope_is_the_models_q_and_k(shape, dtype):
    R, T, Hq, Hkv, D, r = shape
    q_gate_proj = _randn(R, T, Hq * 2 * D, seed=0, dtype=dtype, scale=2.0)
    k_proj = _randn(R, T, Hkv * D, seed=1, dtype=dtype, scale=2.0)
    w_q, w_k = _randn(D, seed=2, dtype=dtype, scale=0.5), _randn(D, seed=3, dtype=dtype, scale=0.5)
    rope = _rope(R, T, r, dtype)

    # model.py's _attention, verbatim
    q, gate = q_gate_proj.view(R, T, -1, 2 * D).chunk(2, dim=-1)
    q = rms_norm_1p(q, w_q, EPS)
    k = rms_norm_1p(k_proj.view(R, T, -1, D), w_k, EPS)
    cos, sin = (t[:, :, None, :] for t in rope)
    q = torch.cat((q[..., :r] * cos + rotate_half(q[..., :r]) * sin, q[..., r:]), dim=-1)
    k = torch.cat((k[..., :r] * cos + rotate_half(k[..., :r]) * sin, k[..., r:]), dim=-1)

    q_view = q_gate_proj.view(R, T, -1, 2 * D).chunk(2, dim=-1)[0]
    _assert_equal(fused.head_norm_rope(q_view, w_q, *rope, r, EPS), q)
    _assert_equal(fused.head_norm_rope(k_proj.view(R, T, -1, D), w_k, *rope, r, EPS), k)


@DTYPES
@pytest.mark.parametrize("shape", [(3, 1, 24), (2, 5, 80), (7, 1000)], ids=["decode", "prefill", "rows"])
def test_silu_mul_is_the_models_mlp_gate(shape, dtype):
    gate, up = _randn(*shape, seed=0, dtype=dtype, scale=4.0), _randn(*shape, seed=1, dtype=dtype)
    _assert_equal(fused.silu_mul(torch.cat([gate, up], dim=-1)), F.silu(gate) * up)


def _model_decode_step(mixed, a, b, neg_A, dt_bias, ssm_buf, slots, Hk, Dk, Dv):
    """model.py's _gated_delta_net decode path from the conv output on (R = B rows, T = 1), verbatim."""
    mixed, a, b = mixed[:, None], a[:, None], b[:, None]
    R, T = mixed.shape[:2]
    B = slots.shape[0]
    Hv = a.shape[-1]
    q, k, v = torch.split(mixed, [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    q = q.reshape(R, T, Hk, Dk)
    k = k.reshape(R, T, Hk, Dk)
    v = v.reshape(R, T, Hv, Dv)
    beta = torch.sigmoid(b).float()
    g = neg_A * F.softplus(a.float() + dt_bias)
    if Hv != Hk:
        q = q.repeat_interleave(Hv // Hk, dim=2)
        k = k.repeat_interleave(Hv // Hk, dim=2)
    q = l2_normalize(q.float()) * Dk**-0.5
    k = l2_normalize(k.float())
    v = v.float()
    return gated_delta_step_inplace_ref(*(t[:B, 0] for t in (q, k, v, g, beta)), ssm_buf, slots)


@DTYPES
@pytest.mark.parametrize("layout", ["separate", "packed"])
@pytest.mark.parametrize("heads", [(2, 2), (2, 6)], ids=["hv=hk", "hv=3hk"])
def test_gated_delta_step_fused_is_the_models_decode_step(heads, layout, dtype):
    Hk, Hv = heads
    B, Dk, Dv, num_slots = 3, 16, 24, 5
    mixed = _randn(B, 2 * Hk * Dk + Hv * Dv, seed=0, dtype=dtype)
    b = _randn(B, Hv, seed=1, dtype=dtype)
    a = _randn(B, Hv, seed=2, dtype=dtype, scale=3.0)
    a[0, 0], a[-1, -1] = 24.0, -40.0  # both sides of softplus' threshold
    neg_A = -_randn(Hv, seed=3, dtype=torch.float32).exp()
    dt_bias = _randn(Hv, seed=4, dtype=dtype, scale=0.5)
    ssm = _randn(num_slots, Hv, Dk, Dv, seed=5, dtype=torch.float32, scale=0.3)
    slots = torch.tensor([4, 0, 2])
    ssm_model = ssm.clone()
    o_model = _model_decode_step(mixed, a, b, neg_A, dt_bias, ssm_model, slots, Hk, Dk, Dv)

    if layout == "packed":
        mixed, b, a = _packed(mixed, b, a)
    o = fused.gated_delta_step_fused(mixed, a, b, neg_A, dt_bias, ssm, slots, Hk, Dk, Dv)
    _assert_equal(o, o_model)
    _assert_equal(ssm, ssm_model)
