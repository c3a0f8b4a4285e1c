"""The router of an MoE layer in Triton; same signature and semantics as moe_route in capsulert/kernels/moe.py.

    moe_route(x, router, shared_gate, n, top_k, normalize) -> (ids [n, k] int32, weights [n, k] fp32,
                                                               shared_logit [R, 1] fp32)
        1. _gates_kernel: the logits of every row against the E router rows and the shared expert's gate row,
           as SPLIT partial sums over fixed KS-wide slices of H (fp32, [SPLIT, R, E + 1]). A one-token step
           then spreads the router's 1 MB (35B-A3B shape) over 144 programs: 2.2 us a layer on the H200, where
           the cuBLAS GEMM it replaces (8x64 tiles) took 5.3 us.
        2. _route_kernel, one program per row: the partials summed in slice order (the slice loop unrolled, so
           its loads are in flight together: a rolled loop took 5.8 us a layer, unrolled the whole router is
           ~0.1 ms of a b = 1 step less), softmax in fp32, the top-k by repeated argmax (the lowest id among
           equal probabilities), renormalised; and the row's shared logit.

Row-wise by construction: a logit is the fp32 sum, in slice order, of per-slice dot products over the same
16-row MMA tiles whatever else is in the tile (masked rows load zeros), so a row's logits, its experts and its
weights do not depend on the other rows of the step. The slice width is fixed, not derived from the number of
rows. The logits stay in fp32 (the reference, a GEMM in the model's dtype, rounds them to it: the two agree
within that rounding, not bitwise). CUDA-graph capturable: grids from shapes only, no host syncs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

KS = 128  # the width of an H slice: a logit's bits depend on it, so it is a constant
BM, BN = 16, 32  # rows and logits per program of _gates_kernel


@triton.jit
def _gates_kernel(x_ptr, router_ptr, gate_ptr, part_ptr, R, E, H, s_x, s_r, s_g, s_ps, s_pr,
                  IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)  # 0..E-1 the router's rows, E the shared expert's gate
    ks = tl.program_id(2) * KS + tl.arange(0, KS)
    row_ok, k_ok = rows < R, ks < H
    a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * s_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                other=0.0)
    w_rows = tl.where(cols < E, router_ptr + cols * s_r, gate_ptr + (cols - E) * s_g)
    w = tl.load(w_rows[None, :] + ks[:, None], mask=k_ok[:, None] & (cols <= E)[None, :], other=0.0)
    if IEEE:
        acc = tl.dot(a, w, input_precision="ieee")
    else:
        acc = tl.dot(a, w)
    tl.store(part_ptr + tl.program_id(2) * s_ps + rows.to(tl.int64)[:, None] * s_pr + cols[None, :], acc,
             mask=row_ok[:, None] & (cols <= E)[None, :])


@triton.jit
def _route_kernel(part_ptr, ids_ptr, w_ptr, logit_ptr, n, E, s_ps, s_pr, SPLIT: tl.constexpr,
                  TOP_K: tl.constexpr, KP: tl.constexpr, NORMALIZE: tl.constexpr, BE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BE)
    valid = offs < E
    x = tl.zeros([BE], dtype=tl.float32)
    shared = 0.0
    for s in tl.static_range(SPLIT):  # slice order
        x += tl.load(part_ptr + s * s_ps + row * s_pr + offs, mask=valid, other=0.0)
        shared += tl.load(part_ptr + s * s_ps + row * s_pr + E)
    tl.store(logit_ptr + row, shared)
    if row < n:
        x = tl.where(valid, x, float("-inf"))
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


def moe_route(x: torch.Tensor, router: torch.Tensor, shared_gate: torch.Tensor, n: int, top_k: int,
              normalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, H]; router [E, H]; shared_gate [1, H] (last dims contiguous); the first n <= R rows routed."""
    R, H = x.shape
    E = router.shape[0]
    for name, t in (("x", x), ("router", router), ("shared_gate", shared_gate)):
        assert t.stride(-1) == 1, f"{name}: the last dim must be contiguous"
    dev = x.device
    ids = torch.empty(n, top_k, dtype=torch.int32, device=dev)
    weights = torch.empty(n, top_k, dtype=torch.float32, device=dev)
    shared_logit = torch.empty(R, 1, dtype=torch.float32, device=dev)
    if not R:
        return ids, weights, shared_logit
    split = triton.cdiv(H, KS)
    part = torch.empty(split, R, E + 1, dtype=torch.float32, device=dev)
    _gates_kernel[(triton.cdiv(R, BM), triton.cdiv(E + 1, BN), split)](
        x, router, shared_gate, part, R, E, H, x.stride(0), router.stride(0), shared_gate.stride(0),
        part.stride(0), part.stride(1), IEEE=x.dtype == torch.float32, BM=BM, BN=BN, KS=KS, num_warps=4)
    BE = triton.next_power_of_2(E)
    _route_kernel[(R,)](part, ids, weights, shared_logit, n, E, part.stride(0), part.stride(1), SPLIT=split,
                        TOP_K=top_k, KP=triton.next_power_of_2(top_k), NORMALIZE=normalize, BE=BE,
                        num_warps=max(1, min(8, BE // 256)))
    return ids, weights, shared_logit
