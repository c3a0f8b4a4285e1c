"""The stage of an attention layer between its input projection and the attention kernel, in one Triton launch;
same semantics as attention_prep_ref in kernels/fused.py.

    attention_prep(q, w_q, k, w_k, v, cos, sin, rotary_dim, eps, kv_k, kv_v, slots, start) -> q' [B, T, Hq, D]
        q' = head_norm_rope(q, w_q, ...) (returned); head_norm_rope(k, w_k, ...) and v written to the KV cache
        at rows start[b] + t of slot slots[b]

One program per (row, token) and block of heads: the query heads' programs store q', the key heads' programs
store k' and the same heads of v straight into the cache, so k' never goes through memory on its own. This is
one launch where a decode step ran three (q's norm, k's norm, the cache write): on the H200 those took ~1.9, ~1.9
and ~1.5 us per attention layer, every launch also paying its gap in the graph.

Numerics: the per-head math is norm_rope_heads (kernels/triton_fused.py), fp32 inside, rounded once to the
model's dtype. Row-wise by construction: a program reads and writes one (row, token) only, with tiles that
follow from the head layout. Cache rows past max_seq (only the padding tokens of a captured piece reach them)
are not written. CUDA-graph capturable: slots and start are read on the device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from capsulert.kernels.triton_fused import head_tile, norm_rope_heads, warps_for


@triton.jit
def _attention_prep_kernel(
    q_ptr, k_ptr, v_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr, slots_ptr, start_ptr,
    T, HQ, HKV, D, ROT, eps, max_seq, Q_BLOCKS,
    sq_r, sq_t, sq_h, sk_r, sk_t, sk_h, sv_r, sv_t, sv_h, sc_r, sc_t, ss_r, ss_t,
    skc_n, skc_s, skc_h, svc_n, svc_s, svc_h,
    BH: tl.constexpr, BD: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # one (row, token)
    r = pid // T
    t = pid % T
    blk = tl.program_id(1)
    offs_d = tl.arange(0, BD)
    cos_row = cos_ptr + r * sc_r + t * sc_t
    sin_row = sin_ptr + r * ss_r + t * ss_t
    if blk < Q_BLOCKS:  # query heads
        offs_h = blk * BH + tl.arange(0, BH)
        y = norm_rope_heads(q_ptr + r * sq_r + t * sq_t + offs_h[:, None] * sq_h, wq_ptr, cos_row, sin_row, offs_h,
                            HQ, D, ROT, eps, BD)
        m = (offs_h < HQ)[:, None] & (offs_d < D)[None, :]
        tl.store(qo_ptr + (pid * HQ + offs_h[:, None]) * D + offs_d[None, :], y.to(qo_ptr.dtype.element_ty), mask=m)
    else:  # key heads, and the same heads of v: into the cache
        offs_h = (blk - Q_BLOCKS) * BH + tl.arange(0, BH)
        y = norm_rope_heads(k_ptr + r * sk_r + t * sk_t + offs_h[:, None] * sk_h, wk_ptr, cos_row, sin_row, offs_h,
                            HKV, D, ROT, eps, BD)
        slot = tl.load(slots_ptr + r).to(tl.int64)
        row = tl.load(start_ptr + r).to(tl.int64) + t
        m = tl.where(row < max_seq, (offs_h < HKV)[:, None] & (offs_d < D)[None, :], False)
        heads = offs_h[:, None].to(tl.int64)
        tl.store(kc_ptr + slot * skc_n + row * skc_s + heads * skc_h + offs_d[None, :], y.to(kc_ptr.dtype.element_ty),
                 mask=m)
        v = tl.load(v_ptr + r * sv_r + t * sv_t + heads * sv_h + offs_d[None, :], mask=m, other=0.0)
        tl.store(vc_ptr + slot * svc_n + row * svc_s + heads * svc_h + offs_d[None, :], v, mask=m)


def attention_prep(q: torch.Tensor, w_q: torch.Tensor, k: torch.Tensor, w_k: torch.Tensor, v: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, eps: float, kv_k: torch.Tensor,
                   kv_v: torch.Tensor, slots: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """q [B, T, Hq, D], k and v [B, T, Hkv, D] (any strides, last dim contiguous); w_q, w_k [D]; cos, sin
    [B, T, rotary_dim]; kv_* [num_slots, max_seq, Hkv, D]; slots, start [B] on the device. Returns contiguous q'."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    assert k.shape == (B, T, Hkv, D) and v.shape == k.shape, f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    assert kv_k.shape[2:] == (Hkv, D) and kv_v.shape == kv_k.shape, f"caches {tuple(kv_k.shape)}, {tuple(kv_v.shape)}"
    assert w_q.shape == (D,) and w_k.shape == (D,), f"norm weights must be [{D}]"
    assert rotary_dim % 2 == 0 and 0 < rotary_dim <= D, f"rotary_dim {rotary_dim} must be even, in (0, {D}]"
    assert cos.shape == (B, T, rotary_dim) and sin.shape == cos.shape, f"cos, sin must be [{B}, {T}, {rotary_dim}]"
    assert slots.shape == (B,) and start.shape == (B,)
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin), ("kv_k", kv_k), ("kv_v", kv_v)):
        assert t.stride(-1) == 1, f"{name}: the last dim must be contiguous"
    q_out = torch.empty(B, T, Hq, D, dtype=q.dtype, device=q.device)
    if not (B and T):
        return q_out
    BH, BD = head_tile(max(Hq, Hkv), D)
    q_blocks = triton.cdiv(Hq, BH)
    _attention_prep_kernel[(B * T, q_blocks + triton.cdiv(Hkv, BH))](
        q, k, v, w_q, w_k, cos, sin, q_out, kv_k, kv_v, slots, start,
        T, Hq, Hkv, D, rotary_dim, eps, kv_k.shape[1], q_blocks,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        kv_k.stride(0), kv_k.stride(1), kv_k.stride(2), kv_v.stride(0), kv_v.stride(1), kv_v.stride(2),
        BH=BH, BD=BD, num_warps=warps_for(BH * BD),
    )
    return q_out
