"""Projections that read the same input, packed into one weight so a decode step reads each activation once
and launches one GEMM instead of several (q/k/v of attention; qkv/z/b/a of Gated DeltaNet; gate/up of the
MLP; an MoE MLP has none: its router and experts run in the MoE kernels, kernels/triton_moe*.py).

Packing is in place on the model's weight mapping: the packed buffer is allocated once, and every original
name becomes a view into it. So the HF names stay the model's public weights (checkpoint checks, RL weight
updates, fingerprints) and an in-place update of a named weight is an update of the packed GEMM: captured
CUDA graphs keep reading the same buffers.
"""
from __future__ import annotations

from typing import MutableMapping

import torch

# packed name -> the weights it concatenates (output rows, in this order)
PACKS: dict[str, tuple[str, ...]] = {
    "attn_in": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "gdn_in": ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
               "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"),
    "mlp_in": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
# A packed weight's rows are rounded up to a whole ALIGN_ROWS with zero rows that no caller reads: GEMM output rows
# short of 16-byte alignment cost cuBLAS its fast kernels (a pack of odd width once did: bench/RESULTS.md).
ALIGN_ROWS = 8


@torch.no_grad()  # not inference_mode: the named views must stay updatable in place outside it
def pack_layer(weights: MutableMapping[str, torch.Tensor], prefix: str, layer_w: dict[str, torch.Tensor]) -> None:
    """Pack every group of PACKS the layer has: layer_w[pack] is the packed weight; `weights[prefix + name]`
    and `layer_w[name]` become row views of it (the originals are released)."""
    for pack, names in PACKS.items():
        if not all(n in layer_w for n in names):
            continue
        parts = [layer_w[n] for n in names]
        pad = -sum(p.shape[0] for p in parts) % ALIGN_ROWS
        packed = torch.cat(parts + [parts[0].new_zeros((pad,) + tuple(parts[0].shape[1:]))] if pad else parts)
        row = 0
        for n in names:
            rows = layer_w[n].shape[0]
            view = packed[row:row + rows]
            layer_w[n] = view
            weights[prefix + n] = view
            row += rows
        layer_w[pack] = packed


def split_sizes(layer_w: dict[str, torch.Tensor], pack: str) -> list[int]:
    """The output widths of the pack's named weights, in order (the alignment rows after them not included)."""
    return [layer_w[n].shape[0] for n in PACKS[pack]]
