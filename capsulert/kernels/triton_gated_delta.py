"""Triton version of the gated delta rule decode step (one token per slot), state updated in place.

Same signature and semantics as `capsulert.kernels.ops.gated_delta_step` (reference:
`capsulert.kernels.gated_delta.gated_delta_step_ref`):

    per (b, h):  S = exp(g) S;  kv = S^T k;  delta = beta (v - kv);  S = S + k delta^T;  o = S^T q
    with S = ssm_buf[slots[b], h] (fp32 [K, V]) written back in place.

CUDA-graph capturable: the slot ids are read on the device, the grid and all allocations depend on shapes only.

Design: grid (B * H, cdiv(V, BV)). A program owns one [K, BV] column tile of one slot's state (K padded to a
power of two, held in registers), so the update is a single read + a single write of the state: the op is
memory bound on the state (B*H*K*V*4 bytes each way). The columns of S are independent under the delta rule
(kv, delta, the rank-1 update and o are all per value column), which is what makes the V split exact.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def delta_rule_update(S, q, k, v, g, beta):
    """One token of the gated delta rule on a [K, BV] column tile of the state: returns (new S, o [BV])."""
    S = S * tl.exp(g)
    kv = tl.sum(S * k[:, None], axis=0)  # [BV]
    delta = (v - kv) * beta
    S = S + k[:, None] * delta[None, :]
    o = tl.sum(S * q[:, None], axis=0)  # [BV]
    return S, o


@triton.jit
def _gated_delta_step_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, slots_ptr, o_ptr,
    H, K, V,
    sq_b, sq_h, sq_k,
    sk_b, sk_h, sk_k,
    sv_b, sv_h, sv_v,
    sg_b, sg_h,
    sbt_b, sbt_h,
    ss_n, ss_h, ss_k, ss_v,
    so_b, so_h, so_v,
    BK: tl.constexpr, BV: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H

    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mk = offs_k < K
    mv = offs_v < V

    slot = tl.load(slots_ptr + b).to(tl.int64)
    s_base = s_ptr + slot * ss_n + h * ss_h
    s_ptrs = s_base + offs_k[:, None] * ss_k + offs_v[None, :] * ss_v
    smask = mk[:, None] & mv[None, :]
    S = tl.load(s_ptrs, mask=smask, other=0.0).to(tl.float32)

    q = tl.load(q_ptr + b * sq_b + h * sq_h + offs_k * sq_k, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * sk_b + h * sk_h + offs_k * sk_k, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b * sv_b + h * sv_h + offs_v * sv_v, mask=mv, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * sg_b + h * sg_h).to(tl.float32)
    beta = tl.load(beta_ptr + b * sbt_b + h * sbt_h).to(tl.float32)

    S, o = delta_rule_update(S, q, k, v, g, beta)

    # every load of this tile is done before any thread writes it back (in-place WAR safety)
    tl.debug_barrier()
    tl.store(s_ptrs, S, mask=smask)
    tl.store(o_ptr + b * so_b + h * so_h + offs_v * so_v, o, mask=mv)


def step_launch_config(K: int, V: int) -> tuple[int, int, int]:
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 32 if BK >= 128 else 64)
    num_warps = 4 if BK * BV <= 4096 else 8
    return BK, BV, num_warps


def gated_delta_step(q, k, v, g, beta, ssm_buf, slots) -> torch.Tensor:
    """q, k [B, H, K], v [B, H, V], g, beta [B, H] (fp32); ssm_buf [num_slots, H, K, V] fp32 updated in place
    for rows slots[b] (int tensor [B] on the device). Returns o [B, H, V] fp32."""
    B, H, K = k.shape
    V = v.shape[-1]
    assert q.shape == (B, H, K) and v.shape == (B, H, V) and g.shape == (B, H) and beta.shape == (B, H)
    assert ssm_buf.dim() == 4 and ssm_buf.shape[1:] == (H, K, V) and ssm_buf.dtype == torch.float32
    assert slots.shape == (B,)
    o = torch.empty(B, H, V, dtype=torch.float32, device=v.device)
    if B == 0:
        return o
    BK, BV, num_warps = step_launch_config(K, V)
    grid = (B * H, triton.cdiv(V, BV))
    _gated_delta_step_kernel[grid](
        q, k, v, g, beta, ssm_buf, slots, o,
        H, K, V,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        g.stride(0), g.stride(1),
        beta.stride(0), beta.stride(1),
        ssm_buf.stride(0), ssm_buf.stride(1), ssm_buf.stride(2), ssm_buf.stride(3),
        o.stride(0), o.stride(1), o.stride(2),
        BK=BK, BV=BV, num_warps=num_warps,
    )
    return o
