"""Triton versions of the depthwise causal conv1d (+ silu) over the Gated DeltaNet projections, with the
per-slot conv state updated in place.

Same signatures and semantics as `capsulert.kernels.ops.conv_step` / `conv_prefill` (references:
`capsulert.kernels.conv.causal_conv1d_step_ref` / `causal_conv1d_ref` plus the `index_copy_` of the new
state into `conv_buf`):

    history = cat(conv_buf[slots[b]] ([C, K-1]), x[b] channels-first)     (length K-1+T)
    out[b, t, c] = silu(sum_j history[c, t + j] * weight[c, j])            (j = 0..K-1)
    conv_buf[slots[b]] = history[:, -(K-1):]

Inputs/outputs/state are in the model dtype (bf16 on GPU); products and the sum are fp32, rounded once.
Both kernels sum the taps in the same order (j = 0..K-1, sequentially), so a token gets bitwise the same
output from the step kernel as from the prefill kernel.

CUDA-graph capturable: slot ids read on the device; grid and allocation depend on shapes only.
In-place safety: the state of a slot is read and written by one program only, which does all of its loads
before a block barrier and its stores after it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_step_kernel(
    x_ptr, buf_ptr, slots_ptr, w_ptr, out_ptr,
    C,
    sx_b, sx_c,
    sb_n, sb_c, sb_w,
    sw_c, sw_k,
    so_b, so_c,
    KW: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr,
):
    b = tl.program_id(0)
    pid_c = tl.program_id(1)
    W: tl.constexpr = KW - 1
    offs_c = pid_c * BC + tl.arange(0, BC)
    mc = offs_c < C
    slot = tl.load(slots_ptr + b).to(tl.int64)
    buf_row = buf_ptr + slot * sb_n + offs_c * sb_c  # [BC] pointers to tap 0 of each channel

    xv = tl.load(x_ptr + b * sx_b + offs_c * sx_c, mask=mc, other=0.0)

    # output: taps summed sequentially j = 0..KW-1 (same order as the prefill kernel)
    acc = tl.zeros([BC], dtype=tl.float32)
    for j in tl.static_range(KW):
        if j < W:
            hj = tl.load(buf_row + j * sb_w, mask=mc, other=0.0).to(tl.float32)
        else:
            hj = xv.to(tl.float32)
        wj = tl.load(w_ptr + offs_c * sw_c + j * sw_k, mask=mc, other=0.0).to(tl.float32)
        acc += hj * wj
    out = acc * tl.sigmoid(acc)

    # new state [BC, KP]: new[c, i] = history[c, i + 1] (i < W)
    offs_i = tl.arange(0, KP)
    from_buf = (offs_i + 1) < W
    nb = tl.load(buf_row[:, None] + (offs_i[None, :] + 1) * sb_w, mask=mc[:, None] & from_buf[None, :], other=0.0)
    new = tl.where(from_buf[None, :], nb, xv[:, None])

    tl.debug_barrier()
    tl.store(buf_row[:, None] + offs_i[None, :] * sb_w, new, mask=mc[:, None] & (offs_i[None, :] < W))
    tl.store(out_ptr + b * so_b + offs_c * so_c, out.to(out_ptr.dtype.element_ty), mask=mc)


@triton.jit
def _history_at(buf_row, x_b, n, offs_i, mi, offs_c, mc, sb_w, sx_t, sx_c, W: tl.constexpr):
    """[BC, KP]: the conv history after the first n tokens of the piece, history[c, n + i] (i < W), from the
    old state where n + i < W, else from x."""
    hidx = n + offs_i  # [KP]
    n_in_buf = hidx < W
    nb = tl.load(buf_row[:, None] + hidx[None, :] * sb_w,
                 mask=mc[:, None] & (n_in_buf & mi)[None, :], other=0.0)
    nx = tl.load(x_b + (hidx - W)[None, :] * sx_t + offs_c[:, None] * sx_c,
                 mask=mc[:, None] & ((~n_in_buf) & mi)[None, :], other=0.0)
    return tl.where(n_in_buf[None, :], nb, nx)


@triton.jit
def _conv_prefill_kernel(
    x_ptr, buf_ptr, slots_ptr, w_ptr, out_ptr, valid_ptr, grid_buf_ptr, grid_at_ptr,
    T, C,
    sx_b, sx_t, sx_c,
    sb_n, sb_c, sb_w,
    sw_c, sw_k,
    so_b, so_t, so_c,
    KW: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_VALID: tl.constexpr,
    HAS_GRID: tl.constexpr,
):
    b = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_c = tl.program_id(2)
    W: tl.constexpr = KW - 1
    offs_t = pid_t * BT + tl.arange(0, BT)
    offs_c = pid_c * BC + tl.arange(0, BC)
    mt = offs_t < T
    mc = offs_c < C
    slot = tl.load(slots_ptr + b).to(tl.int64)
    buf_row = buf_ptr + slot * sb_n + offs_c * sb_c  # [BC]
    x_b = x_ptr + b * sx_b

    # history index of tap j for token t is t + j: < W comes from the old state (only t-block 0, as BT >= W),
    # otherwise from x[t + j - W]
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(KW):
        idx = offs_t + j  # [BT]
        in_buf = idx < W
        hb = tl.load(buf_row[None, :] + idx[:, None] * sb_w,
                     mask=(in_buf & mt)[:, None] & mc[None, :], other=0.0)
        hx = tl.load(x_b + (idx - W)[:, None] * sx_t + offs_c[None, :] * sx_c,
                     mask=((~in_buf) & mt)[:, None] & mc[None, :], other=0.0)
        hj = tl.where(in_buf[:, None], hb, hx).to(tl.float32)
        wj = tl.load(w_ptr + offs_c * sw_c + j * sw_k, mask=mc, other=0.0).to(tl.float32)
        acc += hj * wj[None, :]
    out = acc * tl.sigmoid(acc)

    # new state (t-block 0 only: the only program that reads the old state): new[c, i] = history[c, n + i],
    # the history ending at the last real token n - 1 (n = valid[b] of a padded row, else T)
    if HAS_VALID:
        n = tl.load(valid_ptr + b).to(tl.int32)
    else:
        n = T
    offs_i = tl.arange(0, KP)
    mi = (offs_i < W) & ((offs_i * 0 + pid_t) == 0)  # [KP]; all false outside t-block 0
    new = _history_at(buf_row, x_b, n, offs_i, mi, offs_c, mc, sb_w, sx_t, sx_c, W)
    if HAS_GRID:  # the history at the grid point grid_at[b] tokens in: the slot's conv checkpoint
        at = tl.load(grid_at_ptr + b).to(tl.int32)
        at_grid = _history_at(buf_row, x_b, at, offs_i, mi, offs_c, mc, sb_w, sx_t, sx_c, W)
        tl.store(grid_buf_ptr + slot * sb_n + offs_c[:, None] * sb_c + offs_i[None, :] * sb_w, at_grid,
                 mask=mc[:, None] & mi[None, :])

    tl.debug_barrier()
    tl.store(buf_row[:, None] + offs_i[None, :] * sb_w, new, mask=mc[:, None] & mi[None, :])
    tl.store(out_ptr + b * so_b + offs_t[:, None] * so_t + offs_c[None, :] * so_c,
             out.to(out_ptr.dtype.element_ty), mask=mt[:, None] & mc[None, :])


def _check(conv_buf, slots, weight, B, C):
    KW = weight.shape[1]
    assert KW >= 2, "conv width must be >= 2"
    assert weight.shape == (C, KW)
    assert conv_buf.dim() == 3 and conv_buf.shape[1:] == (C, KW - 1)
    assert slots.shape == (B,)
    return KW


def conv_step(x, conv_buf, slots, weight) -> torch.Tensor:
    """x [B, C] one token per slot; conv_buf [num_slots, C, K-1] updated in place for `slots`;
    weight [C, K]. Returns silu(conv) [B, C] in x's dtype."""
    B, C = x.shape
    KW = _check(conv_buf, slots, weight, B, C)
    out = torch.empty(B, C, dtype=x.dtype, device=x.device)
    if B == 0:
        return out
    KP = triton.next_power_of_2(KW)
    BC = min(triton.next_power_of_2(C), 256)
    num_warps = 4 if BC >= 256 else (2 if BC >= 64 else 1)
    grid = (B, triton.cdiv(C, BC))
    _conv_step_kernel[grid](
        x, conv_buf, slots, weight, out,
        C,
        x.stride(0), x.stride(1),
        conv_buf.stride(0), conv_buf.stride(1), conv_buf.stride(2),
        weight.stride(0), weight.stride(1),
        out.stride(0), out.stride(1),
        KW=KW, KP=KP, BC=BC, num_warps=num_warps,
    )
    return out


def conv_prefill(x, conv_buf, slots, weight, valid=None, grid=None) -> torch.Tensor:
    """x [B, T, C]; conv_buf [num_slots, C, K-1] updated in place for `slots`; weight [C, K]. With `valid` [B]
    (device ints), only the first valid[b] tokens of a row are real: the new state is the history ending at
    the last real one (as conv_prefill_ref). `grid` (grid_buf, at): grid_buf[slots[b]] <- the history after
    the first at[b] tokens (an int, or [B] device ints). Returns silu(conv) [B, T, C] in x's dtype."""
    B, T, C = x.shape
    KW = _check(conv_buf, slots, weight, B, C)
    out = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    if B == 0 or T == 0:
        return out
    KP = triton.next_power_of_2(KW)
    BC = min(triton.next_power_of_2(C), 128)
    BT = max(min(triton.next_power_of_2(T), 16), triton.next_power_of_2(KW - 1))
    assert BT >= KW - 1  # only t-block 0 reads the old state
    num_warps = 4 if BT * BC >= 2048 else 2
    launch = (B, triton.cdiv(T, BT), triton.cdiv(C, BC))
    if valid is not None:
        assert valid.shape == (B,), f"valid must be [{B}], got {tuple(valid.shape)}"
    grid_buf, grid_at = grid if grid is not None else (conv_buf, None)
    if grid is not None:
        assert grid_buf.shape == conv_buf.shape and grid_buf.stride() == conv_buf.stride()
        if isinstance(grid_at, int):
            grid_at = torch.full((B,), grid_at, dtype=torch.int32, device=x.device)
        assert grid_at.shape == (B,), f"grid_at must be [{B}], got {tuple(grid_at.shape)}"
    _conv_prefill_kernel[launch](
        x, conv_buf, slots, weight, out, slots if valid is None else valid, grid_buf,
        slots if grid_at is None else grid_at,
        T, C,
        x.stride(0), x.stride(1), x.stride(2),
        conv_buf.stride(0), conv_buf.stride(1), conv_buf.stride(2),
        weight.stride(0), weight.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        KW=KW, KP=KP, BT=BT, BC=BC, HAS_VALID=valid is not None, HAS_GRID=grid is not None,
        num_warps=num_warps,
    )
    return out
