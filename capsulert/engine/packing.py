"""Projections that read the same input, packed into one weight so a decode step reads each activation once
and launches one GEMM instead of several (q/k/v of attention; qkv/z/b/a of Gated DeltaNet; gate/up of the
MLP; the shared expert's gate/up and the router of an MoE MLP).

Packing is in place on the model's weight mapping: the packed buffer is allocated once, and every original
name becomes a view into it. So the HF names stay the model's public weights (checkpoint checks, RL weight
updates, fingerprints) and an in-place update of a named weight is an update of the packed GEMM: captured
CUDA graphs keep reading the same buffers.
"""
from __future__ import annotations

from typing import MutableMapping

import torch

from capsulert.engine.moe_weights import ROUTER, SHARED_GATE_PROJ, SHARED_UP_PROJ

# packed name -> the weights it concatenates (output rows, in this order)
PACKS: dict[str, tuple[str, ...]] = {
    "attn_in": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "gdn_in": ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
               "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"),
    "mlp_in": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    # the shared-expert gate (one output row) stays apart: an odd packed width makes GEMM output rows that are
    # not 16-byte aligned, which costs cuBLAS its fast kernels
    "moe_in": (SHARED_GATE_PROJ, SHARED_UP_PROJ, ROUTER),
}


@torch.no_grad()  # not inference_mode: the named views must stay updatable in place outside it
def pack_layer(weights: MutableMapping[str, torch.Tensor], prefix: str, layer_w: dict[str, torch.Tensor]) -> None:
    """Pack every group of PACKS the layer has: layer_w[pack] is the packed weight; `weights[prefix + name]`
    and `layer_w[name]` become row views of it (the originals are released)."""
    for pack, names in PACKS.items():
        if not all(n in layer_w for n in names):
            continue
        packed = torch.cat([layer_w[n] for n in names])
        row = 0
        for n in names:
            rows = layer_w[n].shape[0]
            view = packed[row:row + rows]
            layer_w[n] = view
            weights[prefix + n] = view
            row += rows
        layer_w[pack] = packed


def split_sizes(layer_w: dict[str, torch.Tensor], pack: str) -> list[int]:
    return [layer_w[n].shape[0] for n in PACKS[pack]]
