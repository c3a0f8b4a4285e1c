"""The Qwen3.5-MoE MLP of a layer (the model's `_mlp` for an MoE config), as HF's Qwen3_5MoeSparseMoeBlock
computes it:

    logits = router @ x                        (E experts; softmax, top-k, renormalised: kernels.moe_route)
    out    = sum over the k chosen experts, in rank order, of weight_r * expert_r(x)
             + sigmoid(shared_gate @ x) * shared_expert(x)         (kernels.moe_experts)

Batch invariance follows the dense model's scheme (engine/model.py): the projections every row goes through
(router, shared expert, shared-expert gate: one packed GEMM, then the shared expert's down projection) are dense
GEMMs over all R rows of the step, exactly like the dense MLP's. Only the routed experts
depend on the other rows (how many tokens chose an expert); their kernels compute each row alone (reference)
or with fixed tiles and no split-K (Triton), so a row's bits do not depend on the rest of the batch. Padding
rows of a decode step are not routed: no expert work, and nothing they hold reaches a real row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from capsulert.kernels.ops import KernelSet
from capsulert.config.model import ModelConfig
from capsulert.engine.packing import split_sizes
from capsulert.engine.moe_weights import (
    DOWN, GATE_UP, ROUTER, SHARED_DOWN_PROJ, SHARED_GATE, SHARED_GATE_PROJ, SHARED_UP_PROJ)


def moe_mlp(cfg: ModelConfig, kernels: KernelSet, w: dict[str, torch.Tensor], x: torch.Tensor,
            real_rows: int) -> torch.Tensor:
    """x [R, T, H] (after the post-attention norm) -> the MoE block's output [R, T, H]. Rows real_rows..R-1
    are padding (a fixed-shape decode step): they get the shared expert only."""
    R, T, H = x.shape
    rows = x.reshape(R * T, H)
    n = real_rows * T
    if "moe_in" in w:  # packed (engine/packing.py): shared expert gate | up, the router, the shared expert's gate
        gate, up, e, one = split_sizes(w, "moe_in")
        packed = F.linear(rows, w["moe_in"])
        shared_act = kernels.silu_mul(packed[:, :gate + up])  # [gate | up], as silu_mul reads them
        logits, shared_gate = packed[:, gate + up:gate + up + e], packed[:, gate + up + e:gate + up + e + one]
    else:
        shared_act = F.silu(F.linear(rows, w[SHARED_GATE_PROJ])) * F.linear(rows, w[SHARED_UP_PROJ])
        logits = F.linear(rows, w[ROUTER])
        shared_gate = F.linear(rows, w[SHARED_GATE])
    shared = F.linear(shared_act, w[SHARED_DOWN_PROJ])
    ids, weights = kernels.moe_route(logits[:n], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    out = kernels.moe_experts(rows[:n], ids, weights, w[GATE_UP], w[DOWN], shared, shared_gate)
    return out.view(R, T, H)
