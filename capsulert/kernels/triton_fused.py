"""Triton versions of the fused layer stages: one kernel each where the model runs a chain of small torch ops.

Same signatures and return types as the references in `capsulert.kernels.fused` (the semantics):

    add_rms_norm(h, x, w, eps)                -> (h + x, rms_norm_1p(h + x, w, eps))
    gated_rms_norm(o, z, w, eps)              -> w * rmsnorm(o in z's dtype) * silu(z)
    head_norm_rope(x, w, cos, sin, rot, eps)  -> partial rotary of rms_norm_1p(x) per head
    silu_mul(gu)                              -> silu(gu[..., :I]) * gu[..., I:]
    gated_delta_step_fused(mixed, a, b, neg_A, dt_bias, ssm_buf, slots, Hk, Dk, Dv) -> o, ssm_buf in place

Numerics: values are loaded, computed on in fp32 and rounded once when stored, where the references round
after several of their ops; so results match the references within a tolerance, not bitwise. Two roundings
of the references are kept because they are part of what the model feeds on: the residual stream h + x is
rounded to h's dtype before it is normalised (it is the stream the next layer adds to), and so is the fp32
mixer output o before gated_rms_norm normalises it, and beta = sigmoid(b) is rounded to b's dtype (the
prefill path feeds the same rounded beta to the chunked rule).

Row-wise batch invariance: a program reads and writes one row (or one head of one row) only, and its block
shapes and warp counts, hence every reduction order, follow from the row's length and head layout alone.
So a row's bits do not depend on how many rows run with it or what they hold.

CUDA-graph capturable: no host syncs; the grids and the outputs (torch.empty) depend on shapes only; slot
ids are read on the device. Inputs may be strided views (e.g. slices of a packed projection output) as long
as their last dim is contiguous; no copy is made unless their leading dims cannot be viewed as rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from capsulert.kernels.triton_gated_delta import delta_rule_update, step_launch_config

# values a program keeps in registers at most, for the kernels that tile several heads into one program
_TILE_ELEMS = 4096


def warps_for(elems: int) -> int:
    """Warps for a program holding `elems` values: about 8 per thread (one 16-byte load of bf16), 1 to 16."""
    return max(1, min(16, elems // 256))


def _check_last_dim(x: torch.Tensor, name: str) -> None:
    assert x.stride(-1) == 1 or x.shape[-1] == 1, (
        f"{name}: the last dim must be contiguous (stride 1), got shape {tuple(x.shape)} strides {tuple(x.stride())}")


def _as_rows(x: torch.Tensor, name: str, inner: int = 1) -> torch.Tensor:
    """x as a view [N, *x.shape[-inner:]] with the leading dims flattened into N; a copy only when those dims
    cannot be flattened without one (then the strides are the copy's)."""
    _check_last_dim(x, name)
    shape = (-1,) + tuple(x.shape[x.dim() - inner:])
    try:
        return x.view(shape)
    except RuntimeError:
        return x.reshape(shape)


# ---------------------------------------------------------------- residual add + RMSNorm

@triton.jit
def add_rms_norm_row(h, x, w_ptr, h_out_ptrs, y_ptrs, offs, m, D, eps, HAS_X: tl.constexpr):
    """One row: h_new = h + x rounded to h's dtype (stored), y = rms_norm_1p(h_new) (stored). Shared with the
    MoE combine (kernels/triton_moe.py), which adds its output to the residual stream in the same launch: with
    the same [BD] block and warps a row's bits are those of add_rms_norm."""
    if HAS_X:
        h = (h.to(tl.float32) + x.to(tl.float32)).to(h.dtype)
        tl.store(h_out_ptrs, h, mask=m)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = hf * rstd * (1.0 + w)
    tl.store(y_ptrs, y.to(y_ptrs.dtype.element_ty), mask=m)


def add_rms_norm_launch(D: int) -> dict:
    """The block and warps of a row of add_rms_norm_row: a function of the row's length only."""
    BD = triton.next_power_of_2(D)
    return dict(BD=BD, num_warps=warps_for(BD))


@triton.jit
def _add_rms_norm_kernel(
    h_ptr, x_ptr, w_ptr, h_out_ptr, y_ptr,
    D, eps,
    sh_n, sx_n, sho_n, sy_n,
    HAS_X: tl.constexpr, BD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BD)
    m = offs < D
    h = tl.load(h_ptr + row * sh_n + offs, mask=m, other=0.0)
    x = h
    if HAS_X:
        x = tl.load(x_ptr + row * sx_n + offs, mask=m, other=0.0)
    add_rms_norm_row(h, x, w_ptr, h_out_ptr + row * sho_n + offs, y_ptr + row * sy_n + offs, offs, m, D, eps,
                     HAS_X)


def add_rms_norm(h: torch.Tensor, x: torch.Tensor | None, w: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """h, x [..., D] (x may be None: then h_new is h itself); w [D]. Returns (h_new, y), both h's shape and
    dtype. One program per row, the whole row in registers."""
    D = h.shape[-1]
    assert w.shape == (D,), f"w must be [{D}], got {tuple(w.shape)}"
    h2 = _as_rows(h, "h")
    if x is not None:
        assert x.shape == h.shape and x.dtype == h.dtype, (
            f"x must match h: {tuple(x.shape)} {x.dtype} vs {tuple(h.shape)} {h.dtype}")
        x2 = _as_rows(x, "x")
        h_new = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    else:
        x2, h_new = h2, h
    y = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    N = h2.shape[0]
    if N == 0 or D == 0:
        return h_new, y
    ho2 = h_new.view(-1, D) if x is not None else h2
    _add_rms_norm_kernel[(N,)](
        h2, x2, w, ho2, y,
        D, eps,
        h2.stride(0), x2.stride(0), ho2.stride(0), D,
        HAS_X=x is not None, **add_rms_norm_launch(D),
    )
    return h_new, y


# ---------------------------------------------------------------- gated RMSNorm (Gated DeltaNet output)

@triton.jit
def _gated_rms_norm_kernel(
    o_ptr, z_ptr, w_ptr, y_ptr,
    H, D, eps,
    so_n, so_h, sz_n, sz_h,
    BH: tl.constexpr, BD: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    m = (offs_h < H)[:, None] & md[None, :]
    o = tl.load(o_ptr + n * so_n + offs_h[:, None] * so_h + offs_d[None, :], mask=m, other=0.0)
    o = o.to(z_ptr.dtype.element_ty).to(tl.float32)
    z = tl.load(z_ptr + n * sz_n + offs_h[:, None] * sz_h + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(o * o, axis=1) / D + eps)  # [BH]
    w = tl.load(w_ptr + offs_d, mask=md, other=0.0).to(tl.float32)
    y = o * rstd[:, None] * w[None, :] * (z * tl.sigmoid(z))
    tl.store(y_ptr + (n * H + offs_h[:, None]) * D + offs_d[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


def head_tile(H: int, D: int) -> tuple[int, int]:
    BD = triton.next_power_of_2(D)
    BH = max(1, min(triton.next_power_of_2(H), _TILE_ELEMS // BD))
    return BH, BD


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """o (fp32) and z of one shape [..., H, D] (rows are the D-sized heads); w [D]. Returns z's dtype and
    shape, contiguous. A program normalises a tile of BH heads of one leading row."""
    assert o.shape == z.shape, f"o and z must have one shape, got {tuple(o.shape)} and {tuple(z.shape)}"
    assert o.dim() >= 2, "o, z must be [..., H, D]"
    H, D = z.shape[-2:]
    assert w.shape == (D,), f"w must be [{D}], got {tuple(w.shape)}"
    o3, z3 = _as_rows(o, "o", inner=2), _as_rows(z, "z", inner=2)
    y = torch.empty(z.shape, dtype=z.dtype, device=z.device)
    N = z3.shape[0]
    if y.numel() == 0:
        return y
    BH, BD = head_tile(H, D)
    _gated_rms_norm_kernel[(N, triton.cdiv(H, BH))](
        o3, z3, w, y,
        H, D, eps,
        o3.stride(0), o3.stride(1), z3.stride(0), z3.stride(1),
        BH=BH, BD=BD, num_warps=warps_for(BH * BD),
    )
    return y


# ---------------------------------------------------------------- per-head RMSNorm + partial rotary

@triton.jit
def norm_rope_heads(x_head, w_ptr, cos_row, sin_row, offs_h, H, D, ROT, eps, BD: tl.constexpr):
    """rms_norm_1p then the partial rotary embedding of the heads offs_h (< H) of one (row, token): x_head [BH, 1]
    pointers to their first elements, cos_row / sin_row to the token's angles. Returns [BH, BD] fp32."""
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    mh = offs_h < H
    m = mh[:, None] & md[None, :]
    x = tl.load(x_head + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    w = tl.load(w_ptr + offs_d, mask=md, other=0.0).to(tl.float32)
    xn = x * rstd * (1.0 + w[None, :])

    # rotate_half over the first ROT dims pairs dim i with i +- ROT/2; registers cannot be permuted, so the
    # partner values are loaded (from cache) and normalised again
    half = ROT // 2
    in_rot = offs_d < ROT
    first = offs_d < half
    partner = tl.where(first, offs_d + half, offs_d - half)
    mp = mh[:, None] & in_rot[None, :]
    xp = tl.load(x_head + partner[None, :], mask=mp, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=in_rot, other=0.0).to(tl.float32)
    xpn = xp * rstd * (1.0 + wp[None, :])
    rot = tl.where(first[None, :], -xpn, xpn)
    c = tl.load(cos_row + offs_d, mask=in_rot, other=0.0).to(tl.float32)
    s = tl.load(sin_row + offs_d, mask=in_rot, other=0.0).to(tl.float32)
    return tl.where(in_rot[None, :], xn * c[None, :] + rot * s[None, :], xn)


@triton.jit
def _head_norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr,
    T, H, D, ROT, eps,
    sx_r, sx_t, sx_h,
    sc_r, sc_t, ss_r, ss_t,
    BH: tl.constexpr, BD: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # one (row, token)
    r = pid // T
    t = pid % T
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    offs_d = tl.arange(0, BD)
    x_head = x_ptr + r * sx_r + t * sx_t + offs_h[:, None] * sx_h  # [BH, 1]
    y = norm_rope_heads(x_head, w_ptr, cos_ptr + r * sc_r + t * sc_t, sin_ptr + r * ss_r + t * ss_t, offs_h, H, D,
                        ROT, eps, BD)
    m = (offs_h < H)[:, None] & (offs_d < D)[None, :]
    tl.store(y_ptr + (pid * H + offs_h[:, None]) * D + offs_d[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


def head_norm_rope(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                   eps: float) -> torch.Tensor:
    """x [R, T, H, D] (any strides, last dim contiguous); w [D]; cos, sin [R, T, rotary_dim] in x's dtype.
    Returns contiguous [R, T, H, D]. A program handles a tile of BH heads of one (row, token)."""
    assert x.dim() == 4, f"x must be [R, T, H, D], got {tuple(x.shape)}"
    R, T, H, D = x.shape
    assert w.shape == (D,), f"w must be [{D}], got {tuple(w.shape)}"
    assert rotary_dim % 2 == 0 and 0 < rotary_dim <= D, f"rotary_dim {rotary_dim} must be even, in (0, {D}]"
    for name, t in (("cos", cos), ("sin", sin)):
        assert t.shape == (R, T, rotary_dim), f"{name} must be [{R}, {T}, {rotary_dim}], got {tuple(t.shape)}"
        _check_last_dim(t, name)
    _check_last_dim(x, "x")
    y = torch.empty(R, T, H, D, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    BH, BD = head_tile(H, D)
    _head_norm_rope_kernel[(R * T, triton.cdiv(H, BH))](
        x, w, cos, sin, y,
        T, H, D, rotary_dim, eps,
        x.stride(0), x.stride(1), x.stride(2),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        BH=BH, BD=BD, num_warps=warps_for(BH * BD),
    )
    return y


# ---------------------------------------------------------------- silu(gate) * up

@triton.jit
def _silu_mul_kernel(gu_ptr, y_ptr, I, sgu_n, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < I
    row = gu_ptr + n * sgu_n
    g = tl.load(row + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(row + I + offs, mask=m, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + n * I + offs, y.to(y_ptr.dtype.element_ty), mask=m)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [..., 2I] = [gate | up] -> silu(gate) * up, contiguous [..., I] in gu's dtype. Elementwise: a
    program covers BLOCK columns of one row."""
    assert gu.shape[-1] % 2 == 0, f"the last dim of gu must be 2 * I, got {gu.shape[-1]}"
    inter = gu.shape[-1] // 2
    gu2 = _as_rows(gu, "gu")
    y = torch.empty(gu.shape[:-1] + (inter,), dtype=gu.dtype, device=gu.device)
    N = gu2.shape[0]
    if y.numel() == 0:
        return y
    BLOCK = min(triton.next_power_of_2(inter), 1024)
    _silu_mul_kernel[(N, triton.cdiv(inter, BLOCK))](
        gu2, y, inter, gu2.stride(0),
        BLOCK=BLOCK, num_warps=warps_for(2 * BLOCK),
    )
    return y


# ---------------------------------------------------------------- Gated DeltaNet decode step

@triton.jit
def softplus(x):
    """torch's softplus (beta 1, threshold 20): x above 20, else log(1 + exp(x)) in the form
    max(x, 0) + log1p(exp(-|x|)), which cannot overflow."""
    e = tl.exp(-tl.abs(x))  # in (0, 1]
    u = 1.0 + e
    # log1p(e) without a log1p: log(u) * e / (u - 1) cancels the rounding of 1 + e; where 1 + e rounds to 1,
    # log1p(e) is e to fp32 precision
    du = tl.where(u == 1.0, 1.0, u - 1.0)
    log1p_e = tl.where(u == 1.0, e, tl.log(u) * (e / du))
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p_e)


@triton.jit
def _gated_delta_step_fused_kernel(
    mixed_ptr, a_ptr, b_ptr, neg_a_ptr, dt_bias_ptr, s_ptr, slots_ptr, o_ptr,
    HV, GROUP, KEY_DIM, K, V, q_scale,
    sm_b, sa_b, sa_h, sb_b, sb_h, sna, sdt,
    ss_n, ss_h, ss_k, ss_v,
    so_b, so_h, so_v,
    BK: tl.constexpr, BV: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    b = (pid_bh // HV).to(tl.int64)
    h = pid_bh % HV
    hk = h // GROUP  # the key head this value head shares (repeat_interleave)

    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mk = offs_k < K
    mv = offs_v < V

    slot = tl.load(slots_ptr + b).to(tl.int64)
    s_ptrs = s_ptr + slot * ss_n + h * ss_h + offs_k[:, None] * ss_k + offs_v[None, :] * ss_v
    smask = mk[:, None] & mv[None, :]
    S = tl.load(s_ptrs, mask=smask, other=0.0)

    row = mixed_ptr + b * sm_b
    q = tl.load(row + hk * K + offs_k, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(row + KEY_DIM + hk * K + offs_k, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * KEY_DIM + h * V + offs_v, mask=mv, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + b * sa_b + h * sa_h).to(tl.float32)
    braw = tl.load(b_ptr + b * sb_b + h * sb_h)
    neg_a = tl.load(neg_a_ptr + h * sna).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h * sdt).to(tl.float32)

    # every program of a head recomputes its norms and gates: K values, cheaper than another launch
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    g = neg_a * softplus(a + dt_bias)
    beta = tl.sigmoid(braw.to(tl.float32)).to(b_ptr.dtype.element_ty).to(tl.float32)

    S, o = delta_rule_update(S, q, k, v, g, beta)

    # every load of this tile is done before any thread writes it back (in-place WAR safety)
    tl.debug_barrier()
    tl.store(s_ptrs, S, mask=smask)
    tl.store(o_ptr + b * so_b + h * so_h + offs_v * so_v, o, mask=mv)


def gated_delta_step_fused(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, neg_A: torch.Tensor,
                           dt_bias: torch.Tensor, ssm_buf: torch.Tensor, slots: torch.Tensor, num_k_heads: int,
                           k_dim: int, v_dim: int) -> torch.Tensor:
    """mixed [B, 2*Hk*Dk + Hv*Dv] = q | k | v (conv output); a, b [B, Hv]; neg_A [Hv] fp32; dt_bias [Hv];
    ssm_buf [num_slots, Hv, Dk, Dv] fp32 updated in place for rows slots[b] (int tensor [B] on the device, no
    repeats); num_k_heads, k_dim, v_dim = Hk, Dk, Dv (per-head dims). Returns o [B, Hv, Dv] fp32.

    Grid (B * Hv, cdiv(Dv, BV)): a program owns one [Dk, BV] column tile of one slot's head state (the
    columns are independent under the delta rule), so the state is read and written once."""
    Hk, K, V = num_k_heads, k_dim, v_dim
    B = mixed.shape[0]
    Hv = a.shape[1]
    assert Hk > 0 and Hv % Hk == 0, f"value heads {Hv} must be a multiple of key heads {Hk}"
    assert mixed.dim() == 2 and mixed.shape[1] == 2 * Hk * K + Hv * V, (
        f"mixed must be [B, 2*{Hk}*{K} + {Hv}*{V}], got {tuple(mixed.shape)}")
    _check_last_dim(mixed, "mixed")
    assert a.shape == (B, Hv) and b.shape == (B, Hv), f"a, b must be [{B}, {Hv}]"
    assert neg_A.shape == (Hv,) and dt_bias.shape == (Hv,), f"neg_A, dt_bias must be [{Hv}]"
    assert ssm_buf.dim() == 4 and ssm_buf.shape[1:] == (Hv, K, V) and ssm_buf.dtype == torch.float32, (
        f"ssm_buf must be fp32 [num_slots, {Hv}, {K}, {V}], got {ssm_buf.dtype} {tuple(ssm_buf.shape)}")
    assert slots.shape == (B,)
    o = torch.empty(B, Hv, V, dtype=torch.float32, device=mixed.device)
    if B == 0:
        return o
    BK, BV, num_warps = step_launch_config(K, V)
    _gated_delta_step_fused_kernel[(B * Hv, triton.cdiv(V, BV))](
        mixed, a, b, neg_A, dt_bias, ssm_buf, slots, o,
        Hv, Hv // Hk, Hk * K, K, V, K**-0.5,
        mixed.stride(0), a.stride(0), a.stride(1), b.stride(0), b.stride(1), neg_A.stride(0), dt_bias.stride(0),
        ssm_buf.stride(0), ssm_buf.stride(1), ssm_buf.stride(2), ssm_buf.stride(3),
        o.stride(0), o.stride(1), o.stride(2),
        BK=BK, BV=BV, num_warps=num_warps,
    )
    return o
