"""Decode steps on the batch's own rows: the engine drops the 64-row padding of a CUDA decode step only where
every GEMM shape of its model keeps a row's bits at every row count (numerics.first_row_variant_gemm), and says
so when it keeps the padding."""
import dataclasses
import logging

import pytest
import torch

from capsulert.engine import runner as runner_module
from capsulert.engine import numerics
from capsulert.engine.engine import MAX_DECODE_BATCH
from capsulert.engine.loader import load_checkpoint
from capsulert.engine.model import HybridModel
from capsulert.engine.moe_weights import MOE_KERNEL_WEIGHTS
from capsulert.kernels.ops import reference_kernels
from capsulert.engine.packing import PACKS
from capsulert.engine.numerics import first_row_variant_gemm
from tests.models import MODELS


def _rowwise_linear(x, w, b=None):
    """A GEMM that computes each row alone: row-invariant by construction."""
    return torch.cat([x[i:i + 1] @ w.T for i in range(x.shape[0])]) if x.shape[0] else x @ w.T


def test_row_invariant_gemms_pass_and_each_shape_is_checked_once(monkeypatch):
    seen = []
    monkeypatch.setattr(numerics.F, "linear", lambda x, w, b=None: seen.append(tuple(w.shape)) or _rowwise_linear(x, w))
    a, b = torch.randn(24, 16), torch.randn(8, 16)
    assert first_row_variant_gemm([a, b, a.clone(), b], 8) is None
    assert sorted(set(seen)) == [(8, 16), (24, 16)] and len(seen) == 2 * 8  # one full GEMM + 7 row counts each


def test_a_gemm_whose_rows_change_at_some_row_count_is_named(monkeypatch):
    def variant(x, w, b=None):
        out = _rowwise_linear(x, w)
        return out + 1e-3 if x.shape[0] == 5 and w.shape[0] == 8 else out
    monkeypatch.setattr(numerics.F, "linear", variant)
    assert first_row_variant_gemm([torch.randn(24, 16), torch.randn(8, 16)], 8) == ((8, 16), 5)


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_gemm_weights_are_the_packed_projections_and_the_lm_head(model_dir):
    cfg, weights = load_checkpoint(model_dir)
    model = HybridModel(cfg, weights, dataclasses.replace(reference_kernels(), packed_projections=True))
    gemm = model.gemm_weights()
    assert gemm[0] is model.lm_head
    for layer in model.layers:
        packs = [p for p in PACKS if p in layer.w]
        assert len(packs) == (1 if cfg.is_moe else 2)  # the mixer's input projections, and a dense MLP's
        for p in packs:
            assert any(t is layer.w[p] for t in gemm)
            for name in PACKS[p]:  # the named views are not multiplied on their own
                assert not any(t is layer.w[name] for t in gemm)
        assert not any(t is layer.w["conv"] for t in gemm if "conv" in layer.w)
    assert all(t.dim() == 2 for t in gemm)  # the routed experts' 3-D weights run in the MoE kernels
    for layer in model.layers:  # and so do an MoE MLP's router and shared expert
        assert not any(t is layer.w[n] for n in MOE_KERNEL_WEIGHTS if n in layer.w for t in gemm)
    # per layer: the mixer's input pack and output projection, and a dense MLP's input pack and down projection
    assert len(gemm) == 1 + (2 if cfg.is_moe else 4) * cfg.num_hidden_layers


def test_the_engine_drops_the_padding_only_when_every_gemm_passes(engine, monkeypatch, caplog):
    engine.model.decode_rows = MAX_DECODE_BATCH
    monkeypatch.setattr(runner_module, "first_row_variant_gemm", lambda weights, rows: ((2048, 4096), 3))
    with caplog.at_level(logging.WARNING, logger="capsulert.engine"):
        engine.runner.choose_decode_rows()
    assert engine.model.decode_rows == MAX_DECODE_BATCH
    assert "padded to 64 rows" in caplog.text and "2048x4096 GEMM" in caplog.text and "at 3 rows" in caplog.text
    monkeypatch.setattr(runner_module, "first_row_variant_gemm", lambda weights, rows: None)
    engine.runner.choose_decode_rows()
    assert engine.model.decode_rows is None


@pytest.mark.gpu
@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_a_cuda_engine_decodes_unpadded_where_its_gemms_are_row_invariant(make_engine):
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device: run with -m gpu --device cuda on the GPU machine")
    eng = make_engine(device="cuda", slots=4)
    variant = first_row_variant_gemm(eng.model.gemm_weights(), MAX_DECODE_BATCH)
    assert (eng.model.decode_rows is None) == (variant is None)
    assert eng.runner.pad_logits([torch.zeros(8, device=eng.device)]).shape[0] == MAX_DECODE_BATCH  # the sampler's block
