"""The weights of a Qwen3.5-MoE layer's MLP: their HF names and shapes, and the fusion of per-expert tensors.

HF transformers 5.17 holds a layer's routed experts as two 3-D tensors, in memory and in `state_dict()`:
`mlp.experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up rows) and `mlp.experts.down_proj`
[E, H, I]. Its `save_pretrained` writes them per expert instead (`mlp.experts.{e}.gate_proj.weight` [I, H],
`up_proj` [I, H], `down_proj` [H, I]), as the released checkpoints are. capsulert's weights are the fused
tensors; per-expert tensors of a checkpoint or a weight update are fused on the way in (`fuse_experts`).

The router is `mlp.gate.weight` [E, H]; the shared expert is a dense SwiGLU MLP (`mlp.shared_expert.*`) whose
output is scaled by sigmoid(`mlp.shared_expert_gate.weight` . x) (capsulert/engine/moe.py has the maths).
"""
from __future__ import annotations

import re
from typing import Mapping

import torch

from capsulert.errors import CapsuleRTError
from capsulert.config.model import ModelConfig

ROUTER = "mlp.gate.weight"
GATE_UP = "mlp.experts.gate_up_proj"
DOWN = "mlp.experts.down_proj"
SHARED_GATE_PROJ = "mlp.shared_expert.gate_proj.weight"
SHARED_UP_PROJ = "mlp.shared_expert.up_proj.weight"
SHARED_DOWN_PROJ = "mlp.shared_expert.down_proj.weight"
SHARED_GATE = "mlp.shared_expert_gate.weight"  # [1, H]: the sigmoid gate of the shared expert's output
# the 2-D weights the MoE kernels read themselves (kernels.moe_route, kernels.moe_experts), not through a GEMM of
# the model's
MOE_KERNEL_WEIGHTS = (ROUTER, SHARED_GATE, SHARED_GATE_PROJ, SHARED_UP_PROJ, SHARED_DOWN_PROJ)

# the main model's layers, and the MTP head's (mtp.layers.{i}., engine/mtp.py)
_PER_EXPERT = re.compile(r"^(model|mtp)\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MAX_NAMES = 8


def moe_mlp_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """The MLP weights of one MoE layer (names under `prefix`, e.g. "model.layers.3.") with their shapes."""
    h, e, i, s = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    return {
        prefix + ROUTER: (e, h),
        prefix + GATE_UP: (e, 2 * i, h),
        prefix + DOWN: (e, h, i),
        prefix + SHARED_GATE_PROJ: (s, h),
        prefix + SHARED_UP_PROJ: (s, h),
        prefix + SHARED_DOWN_PROJ: (h, s),
        prefix + SHARED_GATE: (1, h),
    }


def is_per_expert(name: str) -> bool:
    """Whether `name` is one expert's tensor as HF's save_pretrained writes it."""
    return _PER_EXPERT.match(name) is not None


def _some(names) -> str:
    """The first few of `names` and how many there are (one error message for thousands of experts)."""
    first = sorted(names)[:_MAX_NAMES]
    return f"{len(names)}: {', '.join(first)}{', ...' if len(names) > len(first) else ''}"


def fuse_experts(per_expert: Mapping[str, torch.Tensor], cfg: ModelConfig, fused_present: set[str],
                 error: type[CapsuleRTError]) -> dict[str, torch.Tensor]:
    """The fused gate_up_proj / down_proj tensors (by name) of every layer whose experts `per_expert` holds one by
    one. Raises `error` naming the tensors unless each such layer has every expert's three tensors with their
    shapes and no fused tensor of its own (`fused_present`: the fused names the caller has already)."""
    if per_expert and not cfg.is_moe:
        raise error(f"per-expert tensor(s) in a dense model's weights: {_some(per_expert)}")
    h, e_count, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    want = {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    layers: dict[tuple[str, int], dict[tuple[int, str], torch.Tensor]] = {}
    counts = {"model": cfg.num_hidden_layers, "mtp": cfg.mtp_num_hidden_layers}
    bad = []
    for name, t in per_expert.items():
        group, layer, expert, kind = _PER_EXPERT.match(name).groups()
        layer, expert = int(layer), int(expert)
        if not isinstance(t, torch.Tensor):
            bad.append(f"{name} is a {type(t).__name__}, not a tensor")
        elif layer >= counts[group] or expert >= e_count:
            bad.append(f"{name} (the model has {counts[group]} {group}.layers of {e_count} experts)")
        elif tuple(t.shape) != want[kind]:
            bad.append(f"{name} has shape {list(t.shape)}, expected {list(want[kind])}")
        else:
            layers.setdefault((group, layer), {})[(expert, kind)] = t
    if bad:
        raise error(f"bad per-expert tensor(s): {_some(bad)}")
    out: dict[str, torch.Tensor] = {}
    for group, layer in sorted(layers):
        parts = layers[(group, layer)]
        prefix = f"{group}.layers.{layer}."
        both = {prefix + GATE_UP, prefix + DOWN} & fused_present
        if both:
            where = "layer" if group == "model" else "mtp layer"
            raise error(f"{where} {layer} has its experts both fused ({_some(both)}) and one by one")
        missing = [f"{prefix}mlp.experts.{e}.{kind}.weight" for e in range(e_count) for kind in want
                   if (e, kind) not in parts]
        if missing:
            raise error(f"missing per-expert tensor(s): {_some(missing)}")
        out[prefix + GATE_UP] = torch.stack([torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]])
                                             for e in range(e_count)])
        out[prefix + DOWN] = torch.stack([parts[(e, "down_proj")] for e in range(e_count)])
    return out
