"""The expert stage of an MoE layer in Triton; same signature and semantics as moe_experts in capsulert/kernels/moe.py.

    (moe_route: kernels/triton_moe_route.py)
    moe_experts(x, ids, weights, experts, shared_logit)
        1. the (token, rank) pairs sorted by expert (kernels/triton_moe_plan.py): each expert's rows,
           contiguous, and for a step of few pairs the list of the chosen experts only
        2. gate/up GEMM: one program per (chosen expert, block of I columns), looping over that expert's rows in
           blocks of BM and over H in blocks of BK; silu(gate) * up in the epilogue -> act [pairs, I]
        3. down GEMM: one program per (expert, block of H columns) over the same rows; the routing weight in
           the epilogue -> y [pairs, H] fp32
        4. combine: one program per (row, block of H): the k weighted outputs summed in rank order, plus the
           gated shared expert, rounded once to the model's dtype; with `add_norm`, one program per row that
           also adds the row to the residual stream and runs the next layer's input norm (add_rms_norm's own
           row code, kernels/triton_fused.py: the same bits, a launch less a layer)
    The shared expert is one more expert of steps 2 and 3 that every row chose, its weight sigmoid(shared_logit):
    its first programs (Tiles.shared_rows rows each) run beside the routed ones in the same launches, so a decode step
    launches no GEMM nor elementwise kernel of its own for it (on the 35B-A3B shape that took the b = 1 step from
    3.62 to 3.41 ms on the H200: bench/RESULTS.md).

Row-wise batch invariance: there is no split-K: every output element is one fp32 accumulator that runs over K
in 16-element MMA steps in the same order, whatever else is in its tile, and the padding rows of a tile are
masked loads of zero. A row's result therefore does not depend on how many tokens chose the same expert nor
where in the tile it lands; the routing and the combine read and write one row per program. Two tile sets
exist: SMALL (16-row tiles, the decode steps and short appends: a few rows per expert) and LARGE (64-row
tiles, Hopper's warpgroup MMA: long prefill pieces, 2.2-2.7x faster at 2k-8k rows on the H200). The set is
chosen from the number of rows, so a row's bits must be the same under both. They are on the H200 (measured,
bf16; tests/kernels/test_moe_kernels.py), and `tiles_agree` checks it on the engine's device at start: where
it does not hold, the engine runs SMALL everywhere and says so in its log (engine/runner.py). Numerics: fp32
accumulation, one rounding of act to the model's dtype (the reference rounds gate/up, silu and the product
separately), so results match the reference within a tolerance, not bitwise.

Only experts that some row chose do work: a step of few pairs launches programs for the chosen experts only,
and in a longer piece the program of an unchosen expert finds no rows and returns, so a decode step reads the
weights of the experts its tokens use (the active-weight floor), and the padding rows of a fixed-shape step are
never routed. CUDA-graph capturable: no host syncs (the plan and every grid depend on shapes only).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from capsulert.kernels.moe import AddNorm, ExpertWeights
from capsulert.kernels.triton_fused import add_rms_norm_launch, add_rms_norm_row
from capsulert.kernels.triton_moe_plan import expert_plan



@dataclass(frozen=True)
class Tiles:
    """The launch constants of the two expert GEMMs, and the shared expert's rows per program."""
    gate_up: dict
    down: dict
    shared_rows: int


# BM = 16 is the smallest tl.dot tile: a decode step gives an expert a few rows. BN is small so that a batch-1
# step, which touches k experts only, still spreads its weight reads over ~100+ programs (one per SM).
SMALL = Tiles(gate_up=dict(BM=16, BN=32, BK=128, num_warps=4, num_stages=3),
              down=dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=3), shared_rows=16)
# 64-row tiles reuse each weight tile over 4x the rows; measured on the H200 at the 35B-A3B layer shape (graph
# replays of one layer's experts): 1.79 -> 0.81 ms at 2048 rows, 6.80 -> 2.55 ms at 8192, but 0.42 -> 0.46 ms at
# 256 rows and 42 -> 54 us at one row, hence the threshold
LARGE = Tiles(gate_up=dict(BM=64, BN=128, BK=64, num_warps=4, num_stages=4),
              down=dict(BM=64, BN=128, BK=64, num_warps=4, num_stages=4), shared_rows=128)
LARGE_FROM_ROWS = 512
LARGE_DTYPES = (torch.bfloat16, torch.float16)  # an fp32 LARGE tile does not fit in shared memory
COMBINE_BH = 1024
# shared_rows: the shared expert's rows per program. One tile in a decode step: its programs then take as long as a
# routed expert's, where 64 rows in one program made the b = 64 step's last wave wait for them (20.2 against
# 19.8 ms a step on the 35B-A3B shape, H200). 128 in a long piece: about a routed expert's rows (n * k / E = 128
# at 4096 tokens).


@triton.jit
def _program_rows(j, NS, experts_ptr, bounds_ptr, R, SHARED_ROWS: tl.constexpr, COMPACT: tl.constexpr):
    """The rows of program j of an expert kernel: programs 0..NS-1 are the shared expert over rows
    [j * SHARED_ROWS, ...) of the step, the rest the plan's routed experts (triton_moe_plan.py). Returns
    (routed, e, start, end): the routed expert e computes order[start:end], the shared expert rows start..end-1."""
    routed = j >= NS
    if routed:
        g = j - NS
        e = tl.load(experts_ptr + g) if COMPACT else g
        start = tl.load(bounds_ptr + g)
        end = tl.load(bounds_ptr + g + 1)
    else:
        e = j * 0
        start = j * SHARED_ROWS
        end = tl.minimum(start + SHARED_ROWS, R)
    return routed, e, start, end


@triton.jit
def _tile_rows(routed, at, row_ok, order_ptr, P, TOP_K: tl.constexpr):
    """A row tile's (x row, act/y row, routed pair) indices: a routed expert's rows are (token, rank) pairs of
    the plan's order; the shared expert's are the step's rows themselves, whose act/y rows follow the P pairs."""
    pair = tl.load(order_ptr + at, mask=tl.where(routed, row_ok, False), other=0)
    token = tl.where(routed, pair // TOP_K, at)
    out_row = tl.where(routed, pair, P + at)
    return token.to(tl.int64), out_row.to(tl.int64), pair.to(tl.int64)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, sg_ptr, su_ptr, act_ptr, order_ptr, experts_ptr, bounds_ptr, NS, P, R, H, I, S,
                    s_x, s_we, s_wn, s_sn, s_a,
                    TOP_K: tl.constexpr, IEEE: tl.constexpr, COMPACT: tl.constexpr, SHARED_ROWS: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    routed, e, start, end = _program_rows(tl.program_id(0), NS, experts_ptr, bounds_ptr, R,
                                          SHARED_ROWS, COMPACT)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    if routed:
        width = I
        w_gate = w_ptr + e.to(tl.int64) * s_we + cols[None, :] * s_wn  # [1, BN] row pointers of the gate rows
        w_up = w_gate + I * s_wn  # the up rows follow the gate rows
    else:
        width = S
        w_gate = sg_ptr + cols[None, :] * s_sn
        w_up = su_ptr + cols[None, :] * s_sn
    col_ok = cols < width
    end = tl.where(tl.program_id(1) * BN < width, end, start)  # a column block past this expert's width: no rows
    for m0 in range(start, end, BM):
        at = m0 + tl.arange(0, BM)
        row_ok = at < end
        token, out_row, _ = _tile_rows(routed, at, row_ok, order_ptr, P, TOP_K)
        x_rows = x_ptr + token[:, None] * s_x
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, H, BK):
            ks = k0 + tl.arange(0, BK)
            k_ok = ks < H
            a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wmask = k_ok[:, None] & col_ok[None, :]
            g = tl.load(w_gate + ks[:, None], mask=wmask, other=0.0)
            u = tl.load(w_up + ks[:, None], mask=wmask, other=0.0)
            if IEEE:
                acc_g = tl.dot(a, g, acc_g, input_precision="ieee")
                acc_u = tl.dot(a, u, acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(a, g, acc_g)
                acc_u = tl.dot(a, u, acc_u)
        act = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(act_ptr + out_row[:, None] * s_a + cols[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, sd_ptr, y_ptr, rw_ptr, logit_ptr, order_ptr, experts_ptr, bounds_ptr, NS, P, R,
                 H, I, S, s_a, s_we, s_wn, s_sn, s_l, s_y,
                 TOP_K: tl.constexpr, IEEE: tl.constexpr, COMPACT: tl.constexpr, SHARED_ROWS: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    routed, e, start, end = _program_rows(tl.program_id(0), NS, experts_ptr, bounds_ptr, R,
                                          SHARED_ROWS, COMPACT)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    col_ok = cols < H
    if routed:
        width = I
        w_rows = w_ptr + e.to(tl.int64) * s_we + cols[None, :] * s_wn
    else:
        width = S
        w_rows = sd_ptr + cols[None, :] * s_sn
    for m0 in range(start, end, BM):
        at = m0 + tl.arange(0, BM)
        row_ok = at < end
        _, out_row, pair = _tile_rows(routed, at, row_ok, order_ptr, P, TOP_K)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, width, BK):
            ks = k0 + tl.arange(0, BK)
            k_ok = ks < width
            a = tl.load(act_ptr + out_row[:, None] * s_a + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(w_rows + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        # the routing weight of a pair, or the sigmoid gate of a row of the shared expert
        rw = tl.load(rw_ptr + pair, mask=tl.where(routed, row_ok, False), other=0.0)
        logit = tl.load(logit_ptr + at.to(tl.int64) * s_l, mask=tl.where(routed, False, row_ok), other=0.0)
        rw = tl.where(routed, rw, tl.sigmoid(logit.to(tl.float32)))
        tl.store(y_ptr + out_row[:, None] * s_y + cols[None, :], rw[:, None] * acc,
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _combined(y_ptr, row, cols, ok, n, P, s_y, TOP_K: tl.constexpr):
    """A row's output over `cols`, fp32: its k weighted expert outputs in rank order, plus the gated shared one."""
    acc = tl.load(y_ptr + (P + row) * s_y + cols, mask=ok, other=0.0)  # the gated shared expert
    if row < n:
        routed = tl.load(y_ptr + (row * TOP_K) * s_y + cols, mask=ok, other=0.0)
        for r in tl.static_range(1, TOP_K):  # rank order
            routed += tl.load(y_ptr + (row * TOP_K + r) * s_y + cols, mask=ok, other=0.0)
        acc = routed + acc
    return acc


@triton.jit
def _combine_kernel(y_ptr, out_ptr, n, P, H, s_y, s_o, TOP_K: tl.constexpr, BH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = cols < H
    acc = _combined(y_ptr, row, cols, ok, n, P, s_y, TOP_K)
    tl.store(out_ptr + row * s_o + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _combine_add_norm_kernel(y_ptr, h_ptr, w_ptr, h_out_ptr, x_out_ptr, n, P, H, eps, s_y, s_h, s_ho, s_xo,
                             TOP_K: tl.constexpr, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    ok = cols < H
    out = _combined(y_ptr, row, cols, ok, n, P, s_y, TOP_K).to(h_ptr.dtype.element_ty)  # the block's output
    h = tl.load(h_ptr + row * s_h + cols, mask=ok, other=0.0)
    add_rms_norm_row(h, out, w_ptr, h_out_ptr + row * s_ho + cols, x_out_ptr + row * s_xo + cols, cols, ok, H,
                     eps, True)


def tiles_for(n: int, dtype: torch.dtype, large_from: int | None) -> Tiles:
    """LARGE from `large_from` rows on (None: never), in 16-bit types only: an fp32 LARGE tile does not fit
    in shared memory, and fp32 on CUDA is a parity setting, not a speed one."""
    large = large_from is not None and n >= large_from and dtype in LARGE_DTYPES
    return LARGE if large else SMALL


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights,
                shared_logit: torch.Tensor, add_norm: AddNorm | None = None, *,
                large_from: int | None = LARGE_FROM_ROWS, tiles: Tiles | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [R, H]; ids, weights [n, k] (n <= R: rows n.. are padding, the gated shared expert alone);
    experts: the layer's weights; shared_logit [R, 1]. Returns [R, H] in x's dtype, or with `add_norm` the pair
    add_rms_norm(add_norm.h, that, add_norm.w, add_norm.eps) gives. The tiles are `tiles_for(R, ...)` unless
    given (tiles_agree and the tests compare the two sets)."""
    R, H = x.shape
    n, k = ids.shape
    E, I = experts.down.shape[0], experts.down.shape[2]
    S = experts.shared_down_proj.shape[1]
    for name, t in (("x", x), *zip(experts._fields, experts)):
        assert t.stride(-1) == 1, f"{name}: the last dim must be contiguous"
    assert experts.shared_gate_proj.stride(0) == experts.shared_up_proj.stride(0), "shared gate/up: one row stride"
    if add_norm is not None:
        assert add_norm.h.shape == x.shape and add_norm.h.dtype == x.dtype and add_norm.w.shape == (H,), (
            f"add_norm: h {tuple(add_norm.h.shape)} {add_norm.h.dtype}, w {tuple(add_norm.w.shape)} for x "
            f"{tuple(x.shape)} {x.dtype}")
        assert add_norm.h.stride(-1) == 1, "add_norm.h: the last dim must be contiguous"
    out = torch.empty(R, H, dtype=x.dtype, device=x.device)
    if not R:
        return out if add_norm is None else (out, torch.empty_like(out))
    P = n * k
    if n:
        plan = expert_plan(ids, E)  # each routed program's expert and (token, rank) pairs
        order, bounds, programs = plan.order, plan.bounds, plan.programs
        compact = plan.experts is not None
        chosen_experts = plan.experts if compact else plan.bounds  # not read when not compact
    else:
        order = bounds = chosen_experts = torch.zeros(1, dtype=torch.int32, device=x.device)  # never read
        programs, compact = 0, False
    chosen = tiles or tiles_for(R, x.dtype, large_from)
    shared_programs = triton.cdiv(R, chosen.shared_rows)
    grid_rows = shared_programs + programs
    act = torch.empty(P + R, max(I, S), dtype=x.dtype, device=x.device)
    y = torch.empty(P + R, H, dtype=torch.float32, device=x.device)
    ieee = x.dtype == torch.float32  # fp32 inputs: full-precision dot products, not TF32
    t = chosen.gate_up
    _gate_up_kernel[(grid_rows, triton.cdiv(max(I, S), t["BN"]))](
        x, experts.gate_up, experts.shared_gate_proj, experts.shared_up_proj, act, order, chosen_experts, bounds,
        shared_programs, P, R, H, I, S, x.stride(0), experts.gate_up.stride(0), experts.gate_up.stride(1),
        experts.shared_gate_proj.stride(0), act.stride(0), TOP_K=k, IEEE=ieee, COMPACT=compact,
        SHARED_ROWS=chosen.shared_rows, BM=t["BM"], BN=t["BN"], BK=t["BK"], num_warps=t["num_warps"],
        num_stages=t["num_stages"])
    t = chosen.down
    _down_kernel[(grid_rows, triton.cdiv(H, t["BN"]))](
        act, experts.down, experts.shared_down_proj, y, weights.reshape(-1).contiguous(), shared_logit, order,
        chosen_experts, bounds, shared_programs, P, R, H, I, S, act.stride(0), experts.down.stride(0),
        experts.down.stride(1), experts.shared_down_proj.stride(0), shared_logit.stride(0), y.stride(0), TOP_K=k,
        IEEE=ieee, COMPACT=compact, SHARED_ROWS=chosen.shared_rows, BM=t["BM"], BN=t["BN"], BK=t["BK"],
        num_warps=t["num_warps"], num_stages=t["num_stages"])
    if add_norm is not None:  # out is the residual stream h + the block's output
        normed = torch.empty_like(out)
        h = add_norm.h
        _combine_add_norm_kernel[(R,)](y, h, add_norm.w, out, normed, n, P, H, add_norm.eps, y.stride(0),
                                       h.stride(0), out.stride(0), normed.stride(0), TOP_K=k, **add_rms_norm_launch(H))
        return out, normed
    _combine_kernel[(R, triton.cdiv(H, COMBINE_BH))](y, out, n, P, H, y.stride(0), out.stride(0), TOP_K=k,
                                                     BH=COMBINE_BH, num_warps=4)
    return out


def tiles_agree(dtype: torch.dtype, device: torch.device | str, seed: int = 0) -> bool:
    """Whether SMALL and LARGE give every row the same bits on this device and dtype (the condition for choosing
    the set from the number of rows): one problem with many rows per expert (several tiles of each size) and
    experts of one or two rows, run under both sets. The shapes are runtime arguments of the kernels, so this
    compiles nothing the engine would not compile anyway. True without a run for a dtype LARGE never runs in
    (tiles_for): there is nothing to agree on."""
    if dtype not in LARGE_DTYPES:
        return True
    g = torch.Generator(device=device).manual_seed(seed)
    E, H, I, k, n = 16, 512, 256, 4, 300

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)
    x, logit = randn(n, H), randn(n, 1)
    experts = ExpertWeights(randn(E, 2 * I, H, scale=H ** -0.5), randn(E, H, I, scale=I ** -0.5),
                            randn(I, H, scale=H ** -0.5), randn(I, H, scale=H ** -0.5), randn(H, I, scale=I ** -0.5))
    logits = torch.randn(n, E, generator=g, device=device)
    logits[: n // 2, :k] += 8.0  # half the rows on experts 0..k-1: several 64-row tiles each
    logits[-2:, -1] += 30.0  # the last expert: two rows only
    weights, ids = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    outs = [moe_experts(x, ids, weights, experts, logit, tiles=t) for t in (SMALL, LARGE)]
    return bool(torch.equal(outs[0], outs[1]))
