"""Fused stages of the hybrid model's layers, plain-torch reference versions: these are the semantics.

Each function composes the same torch ops, in the same order and dtypes, as the unfused code in
capsulert/engine/model.py, so the reference path computes bitwise what the model computed before
(tests/kernels/test_fused_reference.py). The Triton versions (triton_fused.py) do each stage in one kernel,
in fp32 with a single rounding at the end, and are tested against these within a tolerance.

    add_rms_norm           residual add + zero-centred RMSNorm (the norm before each mixer and MLP)
    gated_rms_norm         RMSNorm with a plain weight times silu(z) (the Gated DeltaNet output norm)
    head_norm_rope         per-head zero-centred RMSNorm + partial rotary embedding (q and k of attention)
    attention_prep_ref     head_norm_rope of q and of k, and k and v into the KV cache (triton_attention_prep.py)
    silu_mul               silu(gate) * up over a packed [gate | up] projection (the MLP)
    gated_delta_step_fused q/k L2 norms, decay g, write strength beta and the recurrent decode step
    gated_delta_prefill_prep  the same norms and gates for a prefill piece, padding tokens masked: the
                           inputs of the chunked rule
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from capsulert.kernels.attention import write_kv_ref
from capsulert.kernels.gated_delta import gated_delta_step_ref

# On the CPU a vectorised transcendental op (silu, sigmoid) rounds an element differently in its vector body
# and in its scalar tail, which depends on the tensor's layout. The model's inputs to these ops were whole
# projection outputs (contiguous); where a reference may get a view of a packed projection instead, it makes
# it contiguous first so that it still gives the model's bits.


def rms_norm_1p(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm over the last dim: normalise in fp32, scale by (1 + w), cast to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + w.float())).to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def add_rms_norm(h: torch.Tensor, x: torch.Tensor | None, w: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """h_new = h + x (h itself when x is None), y = rms_norm_1p(h_new, w, eps). Returns (h_new, y)."""
    if x is not None:
        h = h + x
    return h, rms_norm_1p(h, w, eps)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """o (fp32 mixer output) and z [..., D]: RMSNorm of o in z's dtype with the plain weight w, times silu(z).
    Returns z's dtype."""
    dtype = z.dtype
    xf = o.to(dtype).float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return ((w * xf.to(dtype)) * F.silu(z.float().contiguous())).to(dtype)


def head_norm_rope(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                   eps: float) -> torch.Tensor:
    """x [R, T, H, D] (any strides): rms_norm_1p per head with w [D], then the rotary embedding on the first
    rotary_dim dims (rotate_half convention; cos, sin [R, T, rotary_dim]). Returns contiguous [R, T, H, D]."""
    x = rms_norm_1p(x, w, eps)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    r = rotary_dim
    return torch.cat((x[..., :r] * cos + rotate_half(x[..., :r]) * sin, x[..., r:]), dim=-1)


def attention_prep_ref(q, w_q, k, w_k, v, cos, sin, rotary_dim: int, eps: float, kv_k, kv_v, slots, start
                       ) -> torch.Tensor:
    """An attention layer's stage between its input projection and the attention: q and k [B, T, H, D] through
    head_norm_rope with their norms, k and v [B, T, Hkv, D] into the KV cache (write_kv_ref); returns q's."""
    k = head_norm_rope(k, w_k, cos, sin, rotary_dim, eps)
    write_kv_ref(kv_k, kv_v, slots, start, k, v)
    return head_norm_rope(q, w_q, cos, sin, rotary_dim, eps)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [..., 2I] = [gate | up] -> silu(gate) * up [..., I] in gu's dtype."""
    inter = gu.shape[-1] // 2
    return F.silu(gu[..., :inter].contiguous()) * gu[..., inter:]


def gated_delta_step_fused(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, neg_A: torch.Tensor,
                           dt_bias: torch.Tensor, ssm_buf: torch.Tensor, slots: torch.Tensor, num_k_heads: int,
                           k_dim: int, v_dim: int) -> torch.Tensor:
    """The Gated DeltaNet decode step after the conv, one token per slot.

    mixed [B, 2*Hk*Dk + Hv*Dv] = q | k | v (model dtype); a, b [B, Hv]; neg_A [Hv] fp32; dt_bias [Hv];
    ssm_buf [num_slots, Hv, Dk, Dv] fp32, updated in place for rows `slots` [B]. num_k_heads = Hk,
    k_dim = Dk and v_dim = Dv are per-head dims; value head h reads key head h // (Hv // Hk).
    Returns o [B, Hv, Dv] fp32."""
    B = mixed.shape[0]
    Hk, Dk, Dv = num_k_heads, k_dim, v_dim
    Hv = a.shape[1]
    q, k, v = torch.split(mixed, [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    q = q.reshape(B, Hk, Dk)
    k = k.reshape(B, Hk, Dk)
    v = v.reshape(B, Hv, Dv)
    g, beta = gated_delta_gates(a, b, neg_A, dt_bias)
    q, k = gated_delta_qk(q, k, Hv)
    return gated_delta_step_inplace_ref(q, k, v.float(), g, beta, ssm_buf, slots)


def gated_delta_gates(a: torch.Tensor, b: torch.Tensor, neg_A: torch.Tensor, dt_bias: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The decay g = -A * softplus(a + dt_bias) and the write strength beta = sigmoid(b), both fp32."""
    return neg_A * F.softplus(a.float() + dt_bias), torch.sigmoid(b.contiguous()).float()


def gated_delta_qk(q: torch.Tensor, k: torch.Tensor, value_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., Hk, Dk] -> [..., Hv, Dk] fp32: key heads shared by Hv // Hk value heads, L2-normalised,
    q scaled by Dk**-0.5."""
    if value_heads != q.shape[-2]:
        q = q.repeat_interleave(value_heads // q.shape[-2], dim=-2)
        k = k.repeat_interleave(value_heads // k.shape[-2], dim=-2)
    return l2_normalize(q.float()) * q.shape[-1]**-0.5, l2_normalize(k.float())


def gated_delta_step_inplace_ref(q, k, v, g, beta, ssm_buf, slots) -> torch.Tensor:
    """The recurrent step on normalised inputs, state read from and written back to ssm_buf[slots]."""
    o, new_state = gated_delta_step_ref(q, k, v, g, beta, ssm_buf[slots])
    ssm_buf.index_copy_(0, slots, new_state)
    return o


def gated_delta_prefill_prep(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, neg_A: torch.Tensor,
                             dt_bias: torch.Tensor, valid: torch.Tensor | None, num_k_heads: int, k_dim: int,
                             v_dim: int, out_dtype: torch.dtype = torch.float32):
    """The chunked rule's inputs from a prefill piece's conv output mixed [R, T, 2*Hk*Dk + Hv*Dv] = q | k | v
    and gate projections a, b [R, T, Hv]: (q, k [R, T, Hv, Dk] normalised (gated_delta_qk), v [R, T, Hv, Dv],
    in out_dtype; g, beta [R, T, Hv] fp32 (gated_delta_gates)), with g = beta = 0 on the padding tokens
    t >= valid[r] (valid [R] or None: every token real)."""
    R, T, _ = mixed.shape
    Hk, Dk, Dv = num_k_heads, k_dim, v_dim
    Hv = a.shape[-1]
    q, k, v = torch.split(mixed, [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    q, k, v = q.reshape(R, T, Hk, Dk), k.reshape(R, T, Hk, Dk), v.reshape(R, T, Hv, Dv)
    g, beta = gated_delta_gates(a, b, neg_A, dt_bias)
    if valid is not None:  # padding tokens neither decay nor write the state
        real = (torch.arange(T, device=mixed.device)[None, :] < valid[:, None]).float()[..., None]
        beta = beta * real
        g = g * real
    q, k = gated_delta_qk(q, k, Hv)
    return q.to(out_dtype), k.to(out_dtype), v.to(out_dtype), g, beta
