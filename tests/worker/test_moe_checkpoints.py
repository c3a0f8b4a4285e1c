"""Loading Qwen3.5-MoE configs and checkpoints: the config fields (and HF's defaults for the ones left out),
per-expert tensors fused into HF's 3-D experts, and every refusal. (Loading and parity of whole MoE
checkpoints in every layout: test_loader.py and test_parity.py, parametrized over the MoE configs.)"""
import pytest
import torch

from capsulert.errors import ConfigError, ModelLoadError
from capsulert.config.model import ModelConfig
from capsulert.engine.loader import load_checkpoint
from tests.worker.test_loader import _assert_matches_hf, _cfg, _hf_model, _random_weights, _write

def test_moe_config_from_the_multimodal_config_and_hf_defaults():
    text = {k: v for k, v in _cfg("tiny_moe").to_hf_dict().items()
            if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")}
    cfg = ModelConfig.from_hf_dict({"model_type": "qwen3_5_moe", "text_config": text, "vision_config": {}})
    # the fields the text config leaves out take HF Qwen3_5MoeTextConfig's defaults (the 35B-A3B's)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size, cfg.norm_topk_prob) == (256, 8, 512, 512, True)
    assert cfg.is_moe and cfg.intermediate_size == 0
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    raw = ModelConfig.from_hf_dict({**cfg.to_hf_dict(), "norm_topk_prob": False})  # Qwen3-Next's field
    assert not raw.norm_topk_prob and ModelConfig.from_hf_dict(raw.to_hf_dict()) == raw


@pytest.mark.parametrize("change,error", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),  # more than the 8 experts
    (dict(num_experts_per_tok=0), "num_experts_per_tok"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size"),
    (dict(model_type="qwen3_5_text"), "intermediate_size"),  # a dense config needs the dense MLP's size
    (dict(model_type="qwen3_next"), "qwen3_next"),
])
def test_bad_moe_configs_are_refused(change, error):
    with pytest.raises(ConfigError, match=error):
        ModelConfig.from_hf_dict({**_cfg("tiny_moe").to_hf_dict(), **change})


@pytest.fixture
def moe_checkpoint(tmp_path):
    """A tiny MoE config, an HF model of it and its save_pretrained state (experts one by one) as tensors."""
    from safetensors.torch import load_file

    cfg = _cfg("tiny_moe")
    model = _hf_model(cfg, seed=4)
    model.save_pretrained(tmp_path / "hf")
    return cfg, model, load_file(str(tmp_path / "hf" / "model.safetensors")), tmp_path / "ckpt"


def test_per_expert_tensors_are_fused_into_hfs_3d_experts(moe_checkpoint):
    cfg, model, tensors, d = moe_checkpoint
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in tensors
    assert "model.layers.0.mlp.experts.gate_up_proj" not in tensors
    _, weights = load_checkpoint(_write(d, cfg.to_hf_dict(), tensors))
    _assert_matches_hf(weights, model, tied=False)


@pytest.mark.parametrize("damage,error", [
    ("missing-expert", "missing per-expert tensor.*experts.5.down_proj"),
    ("expert-shape", "experts.2.gate_proj.weight has shape"),
    ("both-forms", "layer 1 has its experts both fused"),
    ("expert-past-the-last", "experts.8.up_proj"),
])
def test_bad_per_expert_checkpoints_are_refused(moe_checkpoint, damage, error):
    cfg, model, tensors, d = moe_checkpoint
    if damage == "missing-expert":
        del tensors["model.layers.3.mlp.experts.5.down_proj.weight"]
    elif damage == "expert-shape":
        tensors["model.layers.0.mlp.experts.2.gate_proj.weight"] = torch.zeros(3, cfg.hidden_size)
    elif damage == "both-forms":
        tensors["model.layers.1.mlp.experts.gate_up_proj"] = model.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    else:
        tensors["model.layers.0.mlp.experts.8.up_proj.weight"] = tensors["model.layers.0.mlp.experts.0.up_proj.weight"].clone()
    with pytest.raises(ModelLoadError, match=error):
        load_checkpoint(_write(d, cfg.to_hf_dict(), tensors))


def test_per_expert_tensors_in_a_dense_checkpoint_are_unexpected(tmp_path):
    cfg = _cfg("test_a")
    w, d = _random_weights(cfg), tmp_path / "ckpt"
    w["model.layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(4, cfg.hidden_size)
    with pytest.raises(ModelLoadError, match="unexpected tensor.*experts.0.up_proj"):
        load_checkpoint(_write(d, cfg.to_hf_dict(), w))
