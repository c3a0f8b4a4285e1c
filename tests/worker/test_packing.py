"""Packed projections (one GEMM for the projections that read one input): the same model within fp32 rounding,
and the HF-named weights stay the model's weights: views of the packed buffers, so an in-place update of a
named weight (RL weight sync) is an update of the packed GEMM."""
import dataclasses

import pytest
import torch

from capsulert.kernels.ops import reference_kernels
from capsulert.engine.loader import load_checkpoint
from capsulert.engine.model import HybridModel
from capsulert.engine.packing import ALIGN_ROWS, PACKS
from capsulert.engine.state import StateLayout, StateSet
from tests.models import MODELS

PACKED = dataclasses.replace(reference_kernels(), packed_projections=True)


def build(cfg, weights, kernels):
    model = HybridModel(cfg, weights, kernels, rowwise=True)
    state = StateSet(StateLayout.for_model(cfg, 2, 256, torch.float32, "cpu"))
    return model, state


def run(model, state, tokens, steps=4):
    """Prefill `tokens` into slot 0, then greedy decode steps; every step's logits."""
    slots = torch.tensor([0])
    model.forward(state, slots, torch.tensor([tokens]), 256)
    out = [model.logits(state, slots)]
    for _ in range(steps):
        model.forward(state, slots, out[-1].argmax(-1)[:, None], 256, decode=True)
        out.append(model.logits(state, slots))
    return torch.stack(out)


@pytest.fixture
def checkpoint(model_dir):
    return load_checkpoint(model_dir)


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_packed_model_matches_the_unpacked_one(checkpoint, text):
    cfg, weights = checkpoint
    tokens = list(text.encode())[:40]
    plain = run(*build(cfg, dict(weights), reference_kernels()), tokens)
    packed = run(*build(cfg, {k: v.clone() for k, v in weights.items()}, PACKED), tokens)
    torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-4)
    assert torch.equal(packed.argmax(-1), plain.argmax(-1))


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_named_weights_are_views_of_the_packed_buffers(checkpoint):
    cfg, weights = checkpoint
    weights = {k: v.clone() for k, v in weights.items()}
    model, _ = build(cfg, weights, PACKED)
    packed_groups = 0
    for layer in model.layers:
        for pack, names in PACKS.items():
            if pack not in layer.w:
                continue
            packed_groups += 1
            buf = layer.w[pack]
            rows = 0
            for n in names:
                view = weights[f"model.layers.{layer.index}.{n}"]
                assert view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
                assert torch.equal(buf[rows:rows + view.shape[0]], view)
                rows += view.shape[0]
            assert buf.shape[0] == rows + (-rows % ALIGN_ROWS)  # whole ALIGN_ROWS, the alignment rows zero
            assert not buf[rows:].any()
    # a mixer group in every layer, and a dense MLP's group (an MoE MLP's weights are read by its kernels)
    assert packed_groups == (1 if cfg.is_moe else 2) * cfg.num_hidden_layers


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_in_place_update_of_a_named_weight_reaches_the_packed_gemm(checkpoint, text):
    cfg, weights = checkpoint
    tokens = list(text.encode())[:40]
    live = {k: v.clone() for k, v in weights.items()}
    model, state = build(cfg, live, PACKED)
    before = run(model, state, tokens)
    g = torch.Generator().manual_seed(0)
    for name in [n for n in live if n.endswith(("in_proj_z.weight", "k_proj.weight", "up_proj.weight",
                                                         "shared_expert_gate.weight"))]:
        live[name].add_(0.05 * torch.randn(live[name].shape, generator=g))
    after = run(model, StateSet(state.layout), tokens)
    fresh = run(*build(cfg, {k: v.clone() for k, v in live.items()}, PACKED), tokens)
    assert torch.equal(after, fresh)
    assert not torch.equal(after, before)
