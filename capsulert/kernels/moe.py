"""Mixture-of-experts stages, plain-torch reference versions: the semantics (the CPU path and the oracle of the
Triton versions in triton_moe.py).

    moe_route(logits, top_k, normalize)            -> expert ids [n, k] (rank order) and their weights (fp32)
    moe_experts(x, ids, weights, w_gate_up, w_down, shared, shared_gate)
                                                   -> sum_r weights[:, r] * expert_r(x)  +  sigmoid(gate) * shared

Routing: softmax over the experts in fp32, the k largest probabilities in descending order (the lowest expert
id first among equal ones), renormalised to sum to 1 when `normalize` (HF's norm_topk_prob). An expert is a
SwiGLU MLP: down @ (silu(gate @ x) * (up @ x)), its gate and up rows stacked in one [2I, H] weight.
Combine: the k weighted expert outputs summed in fp32 in rank order, then the gated shared expert added, one
rounding to the model's dtype at the end.

Row-wise by construction: a token's expert work is matrix-vector products on its own hidden vector (torch.mv),
and every reduction (softmax, the top-k sort, the rank-order sum) runs over one row. So a row's bits do not
depend on which other tokens share the step nor on how many of them chose the same expert: the condition for
batch-invariant decode and for prefill pieces split anywhere. (A per-expert GEMM over the tokens that chose it
would be faster, but its rows' bits can change with the number of rows: the CPU GEMM picks gemv at one row.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from capsulert.errors import ConfigError


def moe_route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, E] (the router's output, any dtype) -> (ids [n, top_k] int64, weights [n, top_k] fp32),
    each row's experts in rank order."""
    probs = torch.softmax(logits.float(), dim=-1)
    # a stable descending sort keeps equal probabilities in expert order: ties go to the lowest id
    top, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    top, ids = top[:, :top_k], ids[:, :top_k]
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return ids, top


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, shared: torch.Tensor, shared_gate: torch.Tensor) -> torch.Tensor:
    """The MoE block's output for R rows, R >= n.

    x [n, H] the routed rows (model dtype); ids, weights [n, k] from moe_route; w_gate_up [E, 2I, H];
    w_down [E, H, I]; shared [R, H] the shared expert's output; shared_gate [R, 1] its gate logit (both model
    dtype). Rows n..R-1 (padding of a fixed-shape step) get the gated shared expert alone.
    Returns [R, H] in the model's dtype."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ConfigError("the reference MoE kernels read each token's experts on the host, which a CUDA graph "
                          "cannot capture: use kernels='auto' or 'triton' on CUDA, or cuda_graphs=False")
    n, inter = x.shape[0], w_down.shape[-1]
    out = torch.empty_like(shared)
    for m, row_ids in enumerate(ids.tolist()):
        routed = None
        for r, e in enumerate(row_ids):
            gate_up = torch.mv(w_gate_up[e], x[m])
            y = torch.mv(w_down[e], F.silu(gate_up[:inter]) * gate_up[inter:])
            term = weights[m, r] * y.float()
            routed = term if routed is None else routed + term
        out[m] = (routed + _gated(shared, shared_gate, m)).to(out.dtype)
    for m in range(n, shared.shape[0]):
        out[m] = _gated(shared, shared_gate, m).to(out.dtype)
    return out


def _gated(shared: torch.Tensor, shared_gate: torch.Tensor, m: int) -> torch.Tensor:
    """Row m of sigmoid(shared_gate) * shared in fp32. The sigmoid of one element at a time: a vectorised CPU
    sigmoid rounds an element by where it falls in the tensor (vector body or scalar tail)."""
    return torch.sigmoid(shared_gate[m].float()) * shared[m].float()
