"""Triton versions of the mixture-of-experts stages; same signatures and semantics as capsulert/kernels/moe.py.

    moe_route(logits, top_k, normalize)  one program per row: softmax in fp32, the top-k by repeated argmax
                                         (the lowest id among equal probabilities), renormalised
    moe_experts(x, ids, weights, w_gate_up, w_down, shared, shared_gate)
        1. the (token, rank) pairs sorted by expert (kernels/triton_moe_plan.py): each expert's rows,
           contiguous, and for a step of few pairs the list of the chosen experts only
        2. gate/up GEMM: one program per (chosen expert, block of I columns), looping over that expert's rows in
           blocks of BM and over H in blocks of BK; silu(gate) * up in the epilogue -> act [pairs, I]
        3. down GEMM: one program per (expert, block of H columns) over the same rows; the routing weight in
           the epilogue -> y [pairs, H] fp32
        4. combine: one program per (row, block of H): the k weighted outputs summed in rank order, plus
           sigmoid(shared_gate) * shared, rounded once to the model's dtype

Row-wise batch invariance: there is no split-K: every output element is one fp32 accumulator that runs over K
in 16-element MMA steps in the same order, whatever else is in its tile, and the padding rows of a tile are
masked loads of zero. A row's result therefore does not depend on how many tokens chose the same expert nor
where in the tile it lands; the routing and the combine read and write one row per program. Two tile sets
exist: SMALL (16-row tiles, the decode steps and short appends: a few rows per expert) and LARGE (64-row
tiles, Hopper's warpgroup MMA: long prefill pieces, 2.2-2.7x faster at 2k-8k rows on the H200). The set is
chosen from the number of rows, so a row's bits must be the same under both. They are on the H200 (measured,
bf16; tests/kernels/test_moe_kernels.py), and `tiles_agree` checks it on the engine's device at start: where
it does not hold, the engine runs SMALL everywhere and says so in its log (engine.py). Numerics: fp32
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

from capsulert.kernels.triton_moe_plan import expert_plan



@dataclass(frozen=True)
class Tiles:
    """The launch constants of the two expert GEMMs."""
    gate_up: dict
    down: dict


# BM = 16 is the smallest tl.dot tile: a decode step gives an expert a few rows. BN is small so that a batch-1
# step, which touches k experts only, still spreads its weight reads over ~100+ programs (one per SM).
SMALL = Tiles(gate_up=dict(BM=16, BN=32, BK=128, num_warps=4, num_stages=3),
              down=dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=3))
# 64-row tiles reuse each weight tile over 4x the rows; measured on the H200 at the 35B-A3B layer shape (graph
# replays of one layer's experts): 1.79 -> 0.81 ms at 2048 rows, 6.80 -> 2.55 ms at 8192, but 0.42 -> 0.46 ms at
# 256 rows and 42 -> 54 us at one row, hence the threshold
LARGE = Tiles(gate_up=dict(BM=64, BN=128, BK=64, num_warps=4, num_stages=4),
              down=dict(BM=64, BN=128, BK=64, num_warps=4, num_stages=4))
LARGE_FROM_ROWS = 512
LARGE_DTYPES = (torch.bfloat16, torch.float16)  # an fp32 LARGE tile does not fit in shared memory
COMBINE_BH = 1024


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, w_ptr, E, s_l,
                  TOP_K: tl.constexpr, KP: tl.constexpr, NORMALIZE: tl.constexpr, BE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BE)
    valid = offs < E
    x = tl.load(logits_ptr + row * s_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
    p = tl.where(valid, tl.exp(x - tl.max(x, axis=0)), 0.0)
    p = tl.where(valid, p / tl.sum(p, axis=0), -2.0)  # lanes past E: below every probability, never chosen
    ranks = tl.arange(0, KP)
    top = tl.zeros([KP], dtype=tl.float32)
    ids = tl.zeros([KP], dtype=tl.int32)
    total = 0.0
    for r in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, offs, BE), axis=0)  # the lowest id among equal probabilities
        top = tl.where(ranks == r, best, top)
        ids = tl.where(ranks == r, idx, ids)
        total += best
        p = tl.where(offs == idx, -1.0, p)  # below every probability: not chosen again
    if NORMALIZE:
        top = top / total
    tl.store(ids_ptr + row * TOP_K + ranks, ids, mask=ranks < TOP_K)
    tl.store(w_ptr + row * TOP_K + ranks, top, mask=ranks < TOP_K)


def moe_route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, E] (last dim contiguous) -> (ids [n, top_k] int32, weights [n, top_k] fp32)."""
    n, E = logits.shape
    assert logits.stride(-1) == 1, "the router logits' last dim must be contiguous"
    ids = torch.empty(n, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(n, top_k, dtype=torch.float32, device=logits.device)
    if n:
        BE = triton.next_power_of_2(E)
        _route_kernel[(n,)](logits, ids, weights, E, logits.stride(0), TOP_K=top_k,
                            KP=triton.next_power_of_2(top_k), NORMALIZE=normalize, BE=BE,
                            num_warps=max(1, min(8, BE // 256)))
    return ids, weights


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, order_ptr, experts_ptr, bounds_ptr, H, I,
                    s_x, s_we, s_wn, s_a,
                    TOP_K: tl.constexpr, IEEE: tl.constexpr, COMPACT: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    j = tl.program_id(0)
    e = tl.load(experts_ptr + j) if COMPACT else j  # the plan's expert of this program (triton_moe_plan.py)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    col_ok = cols < I
    start = tl.load(bounds_ptr + j)
    end = tl.load(bounds_ptr + j + 1)
    w_gate = w_ptr + e.to(tl.int64) * s_we + cols[None, :] * s_wn  # [1, BN] row pointers of the gate rows
    w_up = w_gate + I * s_wn  # the up rows follow the gate rows
    for m0 in range(start, end, BM):
        at = m0 + tl.arange(0, BM)
        row_ok = at < end
        pair = tl.load(order_ptr + at, mask=row_ok, other=0)
        x_rows = x_ptr + (pair // TOP_K).to(tl.int64)[:, None] * s_x
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
        tl.store(act_ptr + pair.to(tl.int64)[:, None] * s_a + cols[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, y_ptr, rw_ptr, order_ptr, experts_ptr, bounds_ptr, H, I,
                 s_a, s_we, s_wn, s_y,
                 IEEE: tl.constexpr, COMPACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr):
    j = tl.program_id(0)
    e = tl.load(experts_ptr + j) if COMPACT else j
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    col_ok = cols < H
    start = tl.load(bounds_ptr + j)
    end = tl.load(bounds_ptr + j + 1)
    w_rows = w_ptr + e.to(tl.int64) * s_we + cols[None, :] * s_wn
    for m0 in range(start, end, BM):
        at = m0 + tl.arange(0, BM)
        row_ok = at < end
        pair = tl.load(order_ptr + at, mask=row_ok, other=0).to(tl.int64)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, I, BK):
            ks = k0 + tl.arange(0, BK)
            k_ok = ks < I
            a = tl.load(act_ptr + pair[:, None] * s_a + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        rw = tl.load(rw_ptr + pair, mask=row_ok, other=0.0)
        tl.store(y_ptr + pair[:, None] * s_y + cols[None, :], rw[:, None] * acc,
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _combine_kernel(y_ptr, shared_ptr, gate_ptr, out_ptr, n, H, s_y, s_s, s_g, s_o,
                    TOP_K: tl.constexpr, BH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = cols < H
    g = tl.load(gate_ptr + row * s_g).to(tl.float32)
    acc = tl.sigmoid(g) * tl.load(shared_ptr + row * s_s + cols, mask=ok, other=0.0).to(tl.float32)
    if row < n:
        routed = tl.load(y_ptr + (row * TOP_K) * s_y + cols, mask=ok, other=0.0)
        for r in tl.static_range(1, TOP_K):  # rank order
            routed += tl.load(y_ptr + (row * TOP_K + r) * s_y + cols, mask=ok, other=0.0)
        acc = routed + acc
    tl.store(out_ptr + row * s_o + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def tiles_for(n: int, dtype: torch.dtype, large_from: int | None) -> Tiles:
    """LARGE from `large_from` rows on (None: never), in 16-bit types only: an fp32 LARGE tile does not fit
    in shared memory, and fp32 on CUDA is a parity setting, not a speed one."""
    large = large_from is not None and n >= large_from and dtype in LARGE_DTYPES
    return LARGE if large else SMALL


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, shared: torch.Tensor, shared_gate: torch.Tensor, *,
                large_from: int | None = LARGE_FROM_ROWS, tiles: Tiles | None = None) -> torch.Tensor:
    """x [n, H]; ids, weights [n, k]; w_gate_up [E, 2I, H]; w_down [E, H, I]; shared [R, H]; shared_gate [R, 1]
    (R >= n; rows n.. get the gated shared expert alone). Returns [R, H] in shared's dtype. The tiles are
    `tiles_for(n, ...)` unless given (tiles_agree and the tests compare the two sets)."""
    n, H = x.shape
    R, k = shared.shape[0], ids.shape[1]
    E, I = w_down.shape[0], w_down.shape[2]
    for name, t in (("x", x), ("w_gate_up", w_gate_up), ("w_down", w_down), ("shared", shared)):
        assert t.stride(-1) == 1, f"{name}: the last dim must be contiguous"
    dev = x.device
    out = torch.empty(R, H, dtype=shared.dtype, device=dev)
    y = torch.empty(n * k, H, dtype=torch.float32, device=dev)
    if n:
        plan = expert_plan(ids, E)  # each program's expert and (token, rank) pairs
        compact = plan.experts is not None
        experts = plan.experts if compact else plan.bounds  # not read when not compact
        act = torch.empty(n * k, I, dtype=x.dtype, device=dev)
        ieee = x.dtype == torch.float32  # fp32 inputs: full-precision dot products, not TF32
        chosen = tiles or tiles_for(n, x.dtype, large_from)
        t = chosen.gate_up
        _gate_up_kernel[(plan.programs, triton.cdiv(I, t["BN"]))](
            x, w_gate_up, act, plan.order, experts, plan.bounds, H, I, x.stride(0), w_gate_up.stride(0),
            w_gate_up.stride(1), act.stride(0), TOP_K=k, IEEE=ieee, COMPACT=compact, BM=t["BM"], BN=t["BN"],
            BK=t["BK"], num_warps=t["num_warps"], num_stages=t["num_stages"])
        t = chosen.down
        _down_kernel[(plan.programs, triton.cdiv(H, t["BN"]))](
            act, w_down, y, weights.reshape(-1).contiguous(), plan.order, experts, plan.bounds, H, I,
            act.stride(0), w_down.stride(0), w_down.stride(1), y.stride(0), IEEE=ieee, COMPACT=compact,
            BM=t["BM"], BN=t["BN"], BK=t["BK"], num_warps=t["num_warps"], num_stages=t["num_stages"])
    if R:
        _combine_kernel[(R, triton.cdiv(H, COMBINE_BH))](
            y, shared, shared_gate, out, n, H, y.stride(0), shared.stride(0), shared_gate.stride(0), out.stride(0),
            TOP_K=k, BH=COMBINE_BH, num_warps=4)
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
    x, shared, gate = randn(n, H), randn(n, H), randn(n, 1)
    w_gate_up, w_down = randn(E, 2 * I, H, scale=H ** -0.5), randn(E, H, I, scale=I ** -0.5)
    logits = torch.randn(n, E, generator=g, device=device)
    logits[: n // 2, :k] += 8.0  # half the rows on experts 0..k-1: several 64-row tiles each
    logits[-2:, -1] += 30.0  # the last expert: two rows only
    ids, weights = moe_route(logits, k, True)
    outs = [moe_experts(x, ids, weights, w_gate_up, w_down, shared, gate, tiles=t) for t in (SMALL, LARGE)]
    return bool(torch.equal(outs[0], outs[1]))
