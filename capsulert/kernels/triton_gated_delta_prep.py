"""Triton version of the Gated DeltaNet prefill preparation: from the conv output and the gate projections of
a piece to the inputs of the chunked rule, in one kernel.

Same signature and semantics as `capsulert.kernels.fused.gated_delta_prefill_prep` (the reference):

    mixed [R, T, 2*Hk*Dk + Hv*Dv] = q | k | v (conv output), a, b [R, T, Hv]   ->
    q, k [R, T, Hv, Dk]  L2-normalised per head (q also scaled by Dk**-0.5), key head h // (Hv // Hk)
    v    [R, T, Hv, Dv]
    g    [R, T, Hv] fp32 = -A * softplus(a + dt_bias);  beta [R, T, Hv] fp32 = sigmoid(b) rounded to b's dtype
    with g = beta = 0 on the padding tokens t >= valid[r] (they neither decay nor write the state).

q, k and v come out in `out_dtype`: the model dtype for fla's chunked kernels (which read bf16 and would
round them there), fp32 for the plain-torch chunked rule. The reference replaces about thirty small launches
per linear-attention layer (splits made contiguous, repeat_interleave, the norms, the gates, the padding
masks, dtype casts); in a short prefill piece those launches, not the math, are the cost.

Numerics: computed in fp32, rounded once at the store; matches the reference within a tolerance, not bitwise.
Row-wise: a program reads one token's row and writes that row's heads, with block shapes that follow from
the head layout alone, so a token's bits do not depend on the piece it is computed in (split-invariant
prefill). CUDA-graph capturable: `valid` is read on the device; grid and outputs depend on shapes only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from capsulert.kernels.triton_fused import softplus


@triton.jit
def _prep_kernel(
    mixed_ptr, a_ptr, b_ptr, neg_a_ptr, dt_bias_ptr, valid_ptr,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
    T, HV, GROUP, KEY_DIM, K, V, q_scale,
    sm_r, sm_t, sa_r, sa_t, sa_h, sb_r, sb_t, sb_h,
    BH: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_VALID: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # r * T + t
    r = row // T
    t = row % T
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    mh = offs_h < HV
    hk = offs_h // GROUP
    offs_k = tl.arange(0, BK)
    offs_v = tl.arange(0, BV)
    mk = mh[:, None] & (offs_k < K)[None, :]
    mv = mh[:, None] & (offs_v < V)[None, :]

    src = mixed_ptr + r * sm_r + t * sm_t
    q = tl.load(src + hk[:, None] * K + offs_k[None, :], mask=mk, other=0.0).to(tl.float32)
    k = tl.load(src + KEY_DIM + hk[:, None] * K + offs_k[None, :], mask=mk, other=0.0).to(tl.float32)
    v = tl.load(src + 2 * KEY_DIM + offs_h[:, None] * V + offs_v[None, :], mask=mv, other=0.0)
    q = q * tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6)[:, None] * q_scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]

    a = tl.load(a_ptr + r * sa_r + t * sa_t + offs_h * sa_h, mask=mh, other=0.0).to(tl.float32)
    braw = tl.load(b_ptr + r * sb_r + t * sb_t + offs_h * sb_h, mask=mh, other=0.0)
    neg_a = tl.load(neg_a_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)
    g = neg_a * softplus(a + dt_bias)
    beta = tl.sigmoid(braw.to(tl.float32)).to(b_ptr.dtype.element_ty).to(tl.float32)
    if HAS_VALID:
        real = t < tl.load(valid_ptr + r)
        g = tl.where(real, g, 0.0)
        beta = tl.where(real, beta, 0.0)

    out = row * HV + offs_h  # [BH] head rows of the outputs
    tl.store(q_ptr + out[:, None] * K + offs_k[None, :], q.to(q_ptr.dtype.element_ty), mask=mk)
    tl.store(k_ptr + out[:, None] * K + offs_k[None, :], k.to(k_ptr.dtype.element_ty), mask=mk)
    tl.store(v_ptr + out[:, None] * V + offs_v[None, :], v.to(v_ptr.dtype.element_ty), mask=mv)
    tl.store(g_ptr + out, g, mask=mh)
    tl.store(beta_ptr + out, beta, mask=mh)


def prep_launch_config(Hv: int, K: int, V: int) -> tuple[int, int, int, int]:
    """(BH, BK, BV, num_warps): value heads per program such that a program holds at most ~8k values."""
    BK, BV = triton.next_power_of_2(K), triton.next_power_of_2(V)
    fit = max(1, 8192 // (2 * BK + BV))
    BH = min(triton.next_power_of_2(Hv), 1 << (fit.bit_length() - 1))  # powers of two: tl.arange's extent
    return BH, BK, BV, max(1, min(8, triton.next_power_of_2(BH * (2 * BK + BV)) // 1024))


def gated_delta_prefill_prep(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, neg_A: torch.Tensor,
                             dt_bias: torch.Tensor, valid: torch.Tensor | None, num_k_heads: int, k_dim: int,
                             v_dim: int, out_dtype: torch.dtype = torch.bfloat16):
    """mixed [R, T, 2*Hk*Dk + Hv*Dv] (last dim contiguous); a, b [R, T, Hv] (any strides); neg_A, dt_bias [Hv];
    valid [R] device ints or None. Returns (q, k [R, T, Hv, Dk], v [R, T, Hv, Dv] in out_dtype, g, beta
    [R, T, Hv] fp32), all contiguous."""
    Hk, K, V = num_k_heads, k_dim, v_dim
    R, T, C = mixed.shape
    Hv = a.shape[-1]
    assert Hk > 0 and Hv % Hk == 0, f"value heads {Hv} must be a multiple of key heads {Hk}"
    assert C == 2 * Hk * K + Hv * V and mixed.stride(-1) == 1, (
        f"mixed must be [R, T, 2*{Hk}*{K} + {Hv}*{V}] with a contiguous last dim, got {tuple(mixed.shape)}")
    assert a.shape == (R, T, Hv) and b.shape == (R, T, Hv), f"a, b must be [{R}, {T}, {Hv}]"
    assert neg_A.shape == (Hv,) and dt_bias.shape == (Hv,), f"neg_A, dt_bias must be [{Hv}]"
    dev = mixed.device
    q = torch.empty(R, T, Hv, K, dtype=out_dtype, device=dev)
    k = torch.empty_like(q)
    v = torch.empty(R, T, Hv, V, dtype=out_dtype, device=dev)
    g = torch.empty(R, T, Hv, dtype=torch.float32, device=dev)
    beta = torch.empty_like(g)
    if R * T == 0:
        return q, k, v, g, beta
    if valid is not None:
        assert valid.shape == (R,), f"valid must be [{R}], got {tuple(valid.shape)}"
    BH, BK, BV, num_warps = prep_launch_config(Hv, K, V)
    neg_A, dt_bias = neg_A.contiguous(), dt_bias.contiguous()
    _prep_kernel[(R * T, triton.cdiv(Hv, BH))](
        mixed, a, b, neg_A, dt_bias, neg_A if valid is None else valid,
        q, k, v, g, beta,
        T, Hv, Hv // Hk, Hk * K, K, V, K**-0.5,
        mixed.stride(0), mixed.stride(1), a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1),
        b.stride(2),
        BH=BH, BK=BK, BV=BV, HAS_VALID=valid is not None, num_warps=num_warps,
    )
    return q, k, v, g, beta
