"""The Qwen3.5-MoE MLP of a layer (the model's `_mlp` for an MoE config), as HF's Qwen3_5MoeSparseMoeBlock
computes it:

    logits = router @ x                        (E experts; softmax, top-k, renormalised: kernels.moe_route)
    out    = sum over the k chosen experts, in rank order, of weight_r * expert_r(x)
             + sigmoid(shared_gate @ x) * shared_expert(x)         (kernels.moe_experts)

The whole block runs in the MoE kernels: the router with the shared expert's gate (kernels.moe_route), then the
experts, the shared one included, and the combine (kernels.moe_experts). They compute each row alone
(reference: the logits are GEMMs over all R rows, like the model's projections) or with fixed tiles and fixed
K slices (Triton), so a row's bits do not depend on the rest of the batch nor on how many tokens chose the same
expert. Padding rows of a decode step are not routed: they get the shared expert only,
and nothing they hold reaches a real row.
"""
from __future__ import annotations

import torch

from capsulert.kernels.moe import AddNorm, ExpertWeights
from capsulert.kernels.ops import KernelSet
from capsulert.config.model import ModelConfig
from capsulert.engine.moe_weights import (
    DOWN, GATE_UP, ROUTER, SHARED_DOWN_PROJ, SHARED_GATE, SHARED_GATE_PROJ, SHARED_UP_PROJ)


def moe_mlp(cfg: ModelConfig, kernels: KernelSet, w: dict[str, torch.Tensor], x: torch.Tensor,
            real_rows: int, add_norm: AddNorm | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [R, T, H] (after the post-attention norm) -> the MoE block's output [R, T, H]. Rows real_rows..R-1
    are padding (a fixed-shape decode step): they get the shared expert only. With `add_norm` (h [R, T, H], the
    next layer's input norm) -> (h + output, the next layer's normalised input), both [R, T, H]."""
    R, T, H = x.shape
    rows = x.reshape(R * T, H)
    if add_norm is not None:
        add_norm = add_norm._replace(h=add_norm.h.reshape(R * T, H))
    ids, weights, shared_logit = kernels.moe_route(rows, w[ROUTER], w[SHARED_GATE], real_rows * T,
                                                   cfg.num_experts_per_tok, cfg.norm_topk_prob)
    experts = ExpertWeights(w[GATE_UP], w[DOWN], w[SHARED_GATE_PROJ], w[SHARED_UP_PROJ], w[SHARED_DOWN_PROJ])
    out = kernels.moe_experts(rows, ids, weights, experts, shared_logit, add_norm)
    if add_norm is not None:
        return out[0].view(R, T, H), out[1].view(R, T, H)
    return out.view(R, T, H)
