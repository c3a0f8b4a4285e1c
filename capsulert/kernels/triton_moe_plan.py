"""The work plan of the expert GEMMs (kernels/triton_moe.py): which (token, rank) pairs each program of the
expert kernels computes.

    expert_plan(ids, E) -> ExpertPlan(order, experts, bounds, programs)
        order     [n*k] int32   the pairs sorted by expert, stable (pair order within an expert)
        experts   [programs]    int32: the expert of program j, or None: program j is expert j
        bounds    [programs+1]  int32: program j computes order[bounds[j]:bounds[j+1]]

A step of few pairs (a decode step, a short append: at most BUCKET_PAIRS) runs one Triton program that sorts
the pairs by expert in registers and lists only the experts some pair chose, so the expert kernels launch
min(E, n*k) programs per column block instead of E: a batch-1 step of the 35B-A3B shape chose 8 of 256 experts
per layer, and the 248 programs that found no rows still had to be scheduled. A longer piece sorts with torch
and keeps one program per expert (nearly every expert is chosen there).

The plan decides only which program computes which rows; each row's arithmetic is the same either way, so a
row's bits do not depend on the plan. CUDA-graph capturable: no host syncs, shapes from n*k and E only.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

BUCKET_PAIRS = 1024  # at most this many (token, rank) pairs: one program sorts them (a b = 128 decode step)


class ExpertPlan(NamedTuple):
    order: torch.Tensor
    experts: torch.Tensor | None
    bounds: torch.Tensor
    programs: int


@triton.jit
def _bucket_kernel(ids_ptr, order_ptr, experts_ptr, bounds_ptr, scratch_ptr, P, E, G,
                   BLOCK: tl.constexpr, GB: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    valid = offs < P
    ex = tl.load(ids_ptr + offs, mask=valid, other=E)  # lanes past P sort after every real expert
    keys = tl.sort(ex * BLOCK + offs)  # (expert, pair) order: a stable sort by expert
    sorted_ex = keys // BLOCK
    tl.store(order_ptr + offs, keys % BLOCK, mask=valid)
    tl.store(scratch_ptr + offs, sorted_ex)
    tl.debug_barrier()  # every lane's expert is in scratch before a lane reads its left neighbour's
    prev = tl.load(scratch_ptr + offs - 1, mask=offs > 0, other=-1)
    first = (sorted_ex != prev) & valid  # the first pair of an expert
    rank = tl.cumsum(first.to(tl.int32), axis=0) - 1
    tl.store(experts_ptr + rank, sorted_ex, mask=first)
    tl.store(bounds_ptr + rank, offs, mask=first)
    chosen = tl.sum(first.to(tl.int32), axis=0)
    tail = tl.arange(0, GB)  # programs past the chosen experts: empty ranges at P
    tl.store(bounds_ptr + tail, P, mask=(tail >= chosen) & (tail <= G))
    tl.store(experts_ptr + tail, 0, mask=(tail >= chosen) & (tail < G))


def expert_plan(ids: torch.Tensor, num_experts: int) -> ExpertPlan:
    """ids [n, k] (any int dtype, n*k > 0) -> the plan of the expert kernels (module doc)."""
    flat = ids.reshape(-1).to(torch.int32)
    P, dev = flat.numel(), flat.device
    if P > BUCKET_PAIRS:
        experts, order = torch.sort(flat, stable=True)
        bounds = torch.searchsorted(experts, torch.arange(num_experts + 1, dtype=torch.int32, device=dev),
                                    out_int32=True)
        return ExpertPlan(order.to(torch.int32), None, bounds, num_experts)
    G = min(num_experts, P)
    BLOCK = triton.next_power_of_2(P)
    order = torch.empty(P, dtype=torch.int32, device=dev)
    experts = torch.empty(G, dtype=torch.int32, device=dev)
    bounds = torch.empty(G + 1, dtype=torch.int32, device=dev)
    scratch = torch.empty(BLOCK, dtype=torch.int32, device=dev)
    _bucket_kernel[(1,)](flat, order, experts, bounds, scratch, P, num_experts, G, BLOCK=BLOCK,
                         GB=triton.next_power_of_2(G + 1), num_warps=4)
    return ExpertPlan(order, experts, bounds, G)


def expert_plan_ref(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The compact plan in plain torch (the test oracle): order, the chosen experts ascending, their bounds."""
    flat = ids.reshape(-1).to(torch.int64)
    experts, order = torch.sort(flat, stable=True)
    chosen, counts = torch.unique_consecutive(experts, return_counts=True)
    bounds = torch.cat([torch.zeros(1, dtype=torch.int64, device=flat.device), counts.cumsum(0)])
    return order.to(torch.int32), chosen.to(torch.int32), bounds.to(torch.int32)
