"""Mixture-of-experts stages, plain-torch reference versions: the semantics (the CPU path and the oracle of the
Triton versions in triton_moe_route.py and triton_moe.py).

    moe_route(x, router, shared_gate, n, top_k, normalize)
                                                   -> expert ids [n, k] (rank order), their weights (fp32),
                                                      the shared expert's gate logit [R, 1]
    moe_experts(x, ids, weights, experts, shared_logit)
                                                   -> sum_r weights[:, r] * expert_r(x)
                                                      + sigmoid(shared_logit) * shared_expert(x)
    moe_experts(..., add_norm=AddNorm(h, w, eps))  -> add_rms_norm(h, that output, w, eps) (kernels/fused.py):
                                                      the residual stream and the next layer's input norm

Routing: the router's logits (router @ x), softmax over the experts in fp32, the k largest probabilities in
descending order (the lowest expert id first among equal ones), renormalised to sum to 1 when `normalize` (HF's
norm_topk_prob). An expert, routed or shared, is a SwiGLU MLP: down @ (silu(gate @ x) * (up @ x)); a routed
expert's gate and up rows are stacked in one [2I, H] weight. Combine: the k weighted expert outputs summed in
fp32 in rank order, then the gated shared expert added, one rounding to the model's dtype at the end.

Row-wise by construction: a token's expert work, the shared expert's included, is matrix-vector products on its
own hidden vector (torch.mv), and every reduction (softmax, the top-k sort, the rank-order sum) runs over one row.
So a row's bits do not depend on which other tokens share the step nor on how many of them chose the same expert:
the condition for batch-invariant decode and for prefill pieces split anywhere. (A per-expert GEMM over the tokens
that chose it would be faster, but its rows' bits can change with the number of rows: the CPU GEMM picks gemv at
one row.)
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from capsulert.errors import ConfigError
from capsulert.kernels.fused import add_rms_norm


class ExpertWeights(NamedTuple):
    """One MoE layer's expert weights, as the expert kernels read them (views of the model's named weights)."""
    gate_up: torch.Tensor  # [E, 2I, H] the routed experts: each one's gate rows, then its up rows
    down: torch.Tensor  # [E, H, I]
    shared_gate_proj: torch.Tensor  # [S, H] the shared expert, which every row goes through
    shared_up_proj: torch.Tensor  # [S, H]
    shared_down_proj: torch.Tensor  # [H, S]


class AddNorm(NamedTuple):
    """Where an MoE block's output goes next, when the expert stage takes it there itself: added to the residual
    stream h [R, H] and normalised with the next layer's input norm (add_rms_norm(h, out, w, eps)). The Triton
    combine does both in its own launch, a launch less a layer."""
    h: torch.Tensor
    w: torch.Tensor
    eps: float


def moe_route(x: torch.Tensor, router: torch.Tensor, shared_gate: torch.Tensor, n: int, top_k: int,
              normalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, H] (model dtype); router [E, H]; shared_gate [1, H]; the first n <= R rows are routed (the rest is
    padding of a fixed-shape step) -> (ids [n, top_k] int64, weights [n, top_k] fp32, each row's experts in
    rank order; shared_logit [R, 1], the shared expert's gate logit). The logits are GEMMs over all R rows,
    like the model's other projections."""
    probs = torch.softmax(F.linear(x, router)[:n].float(), dim=-1)
    # a stable descending sort keeps equal probabilities in expert order: ties go to the lowest id
    top, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    top, ids = top[:, :top_k], ids[:, :top_k]
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return ids, top, F.linear(x, shared_gate)


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights,
                shared_logit: torch.Tensor, add_norm: AddNorm | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The MoE block's output for R rows.

    x [R, H] (model dtype); ids, weights [n, k] from moe_route for the first n <= R rows; shared_logit [R, 1] the
    shared expert's gate logit. Rows n..R-1 (padding of a fixed-shape step) are not routed: they get the gated
    shared expert alone. Returns [R, H] in the model's dtype; with `add_norm`, add_rms_norm of it instead:
    (h + out, the next layer's normalised input)."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ConfigError("the reference MoE kernels read each token's experts on the host, which a CUDA graph "
                          "cannot capture: use kernels='auto' or 'triton' on CUDA, or cuda_graphs=False")
    inter = experts.down.shape[-1]
    out = torch.empty_like(x)
    for m in range(x.shape[0]):
        acc = _gated_shared(experts, x[m], shared_logit[m])
        if m < ids.shape[0]:
            routed = None
            for r, e in enumerate(ids[m].tolist()):
                gate_up = torch.mv(experts.gate_up[e], x[m])
                y = torch.mv(experts.down[e], F.silu(gate_up[:inter]) * gate_up[inter:])
                term = weights[m, r] * y.float()
                routed = term if routed is None else routed + term
            acc = routed + acc
        out[m] = acc.to(out.dtype)
    return out if add_norm is None else add_rms_norm(add_norm.h, out, add_norm.w, add_norm.eps)


def _gated_shared(experts: ExpertWeights, x: torch.Tensor, logit: torch.Tensor) -> torch.Tensor:
    """sigmoid(logit) * shared_expert(x) for one row, in fp32. The sigmoid of one element at a time: a vectorised
    CPU sigmoid rounds an element by where it falls in the tensor (vector body or scalar tail)."""
    act = F.silu(torch.mv(experts.shared_gate_proj, x)) * torch.mv(experts.shared_up_proj, x)
    return torch.sigmoid(logit.float()) * torch.mv(experts.shared_down_proj, act).float()
