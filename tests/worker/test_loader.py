"""capsulert.engine.loader against checkpoints written by HF transformers (and broken ones)."""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from capsulert.config.model import ModelConfig
from capsulert.errors import ConfigError, ModelLoadError, UnsupportedModelError
from capsulert.engine.loader import MTP_PREFIX, expected_shapes, load_checkpoint, load_tokenizer, weights_fingerprint

CONFIGS = Path(__file__).resolve().parents[2] / "capsulert" / "configs" / "models"
TEST_CONFIGS = ["test_a", "test_b", "test_c", "tiny_moe", "test_moe_b"]


def _cfg(name: str) -> ModelConfig:
    return ModelConfig.from_file(CONFIGS / f"{name}.yaml")


def _hf_model(cfg: ModelConfig, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    if cfg.is_moe:
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**cfg.to_hf_dict()))
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**cfg.to_hf_dict()))
    with torch.no_grad():  # HF inits norms to constants; make every tensor distinct
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("dt_bias", "A_log")):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in expected_shapes(cfg).items()}


def _write(path: Path, cfg_dict: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg_dict))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def _assert_matches_hf(weights: dict[str, torch.Tensor], model, tied: bool) -> None:
    sd = model.state_dict()
    names = set(sd) - ({"lm_head.weight"} if tied else set())
    assert set(weights) == names
    for n in names:
        assert weights[n].dtype == torch.float32
        assert torch.equal(weights[n], sd[n]), n


@pytest.mark.parametrize("name", TEST_CONFIGS)
def test_expected_shapes_match_hf(name):
    cfg = _cfg(name)
    model = _hf_model(cfg)
    hf = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        hf.pop("lm_head.weight")
    # transformers has no MTP head (engine/mtp.py): its weights are ours alone
    assert {k: v for k, v in expected_shapes(cfg).items() if not k.startswith(MTP_PREFIX)} == hf


@pytest.mark.parametrize("name", TEST_CONFIGS)
def test_load_hf_save_pretrained(name, tmp_path):
    cfg = _cfg(name)
    model = _hf_model(cfg)
    model.save_pretrained(tmp_path)
    got_cfg, weights = load_checkpoint(tmp_path)
    # save_pretrained writes no MTP head (transformers has none): such a checkpoint loads without one
    assert got_cfg == dataclasses.replace(cfg, mtp_num_hidden_layers=0)
    _assert_matches_hf(weights, model, cfg.tie_word_embeddings)


def test_load_sharded(tmp_path, terminal):
    cfg = _cfg("test_b")
    model = _hf_model(cfg, seed=1)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1
    terminal.attach()
    _, weights = load_checkpoint(tmp_path)  # on a (fake) terminal: a bar over the tensors, naming each shard
    _assert_matches_hf(weights, model, tied=True)
    drawn = terminal.getvalue()
    n_tensors = len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"])
    assert "capsulert: loading weights" in drawn and f"0/{n_tensors}" in drawn
    assert all(f"{shard}]" in drawn for shard in shards)
    terminal.seek(0)
    terminal.truncate()
    load_checkpoint(tmp_path, progress=False)  # the caller turns it off
    assert terminal.getvalue() == ""


def _vlm_checkpoint(path: Path, cfg: ModelConfig, model) -> Path:
    """The layout of Qwen3_5(Moe)ForConditionalGeneration: a language-model prefix, vision and MTP towers."""
    tensors = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # the embedding itself, as tied checkpoints store it
        if k.startswith("model."):
            tensors["model.language_model." + k[len("model."):]] = v
        else:
            tensors[k] = v
    tensors["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2, 2)
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(24, 8)
    tensors["mtp.fc.weight"] = torch.randn(cfg.hidden_size, 2 * cfg.hidden_size)
    tensors["mtp.norm.weight"] = torch.randn(cfg.hidden_size)
    conf = {
        "model_type": "qwen3_5_moe" if cfg.is_moe else "qwen3_5",
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if cfg.is_moe else "Qwen3_5ForConditionalGeneration"],
        "text_config": cfg.to_hf_dict(),
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 8},
    }
    return _write(path, conf, tensors)


@pytest.mark.parametrize("name", ["test_c", "test_moe_b"])
def test_load_conditional_generation_layout(name, tmp_path, caplog):
    cfg = _cfg(name)
    model = _hf_model(cfg, seed=2)
    _vlm_checkpoint(tmp_path, cfg, model)
    with caplog.at_level(logging.INFO, logger="capsulert.engine.loader"):
        got_cfg, weights = load_checkpoint(tmp_path)
    assert got_cfg == cfg
    _assert_matches_hf(weights, model, tied=cfg.tie_word_embeddings)
    notes = [r for r in caplog.records if r.name == "capsulert.engine.loader"]
    assert len(notes) == 1 and "4" in notes[0].getMessage()


def test_dtype_conversion_and_fingerprint(tmp_path):
    cfg = _cfg("test_a")
    w = _random_weights(cfg)
    _write(tmp_path, cfg.to_hf_dict(), w)
    _, f32 = load_checkpoint(tmp_path)
    _, bf16 = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    assert torch.equal(bf16["model.norm.weight"], w["model.norm.weight"].bfloat16())
    fp = weights_fingerprint(cfg, f32)
    assert fp == weights_fingerprint(cfg, dict(reversed(list(f32.items()))))
    assert len(fp) == 64 and fp != weights_fingerprint(cfg, bf16)
    assert weights_fingerprint(cfg, bf16) == weights_fingerprint(cfg, {k: v.clone() for k, v in bf16.items()})
    changed = dict(f32)
    changed["model.norm.weight"] = f32["model.norm.weight"].clone()
    changed["model.norm.weight"][3] += 1e-3
    assert weights_fingerprint(cfg, changed) != fp
    import dataclasses

    assert weights_fingerprint(dataclasses.replace(cfg, rms_norm_eps=1e-5), f32) != fp


def test_load_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models

    assert load_tokenizer(tmp_path) is None
    Tokenizer(models.BPE()).save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path) is not None
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_tokenizer(tmp_path)


# ---- errors ---------------------------------------------------------------------------------------


@pytest.fixture
def good(tmp_path) -> tuple[ModelConfig, dict[str, torch.Tensor], Path]:
    cfg = _cfg("test_a")
    return cfg, _random_weights(cfg), tmp_path / "ckpt"


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_missing_config(good):
    cfg, w, d = good
    _write(d, cfg.to_hf_dict(), w)
    (d / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_checkpoint(d)


def test_other_architecture(good):
    cfg, w, d = good
    _write(d, {"model_type": "llama", "hidden_size": 64}, w)
    with pytest.raises(UnsupportedModelError, match="llama"):
        load_checkpoint(d)


def test_bad_config_value(good):
    cfg, w, d = good
    bad = cfg.to_hf_dict()
    del bad["hidden_size"]
    _write(d, bad, w)
    with pytest.raises(ConfigError, match="hidden_size"):
        load_checkpoint(d)


def test_no_weights_file(good):
    cfg, w, d = good
    _write(d, cfg.to_hf_dict(), w)
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_checkpoint(d)


def test_missing_tensor(good):
    cfg, w, d = good
    del w["model.layers.1.self_attn.k_norm.weight"], w["model.layers.0.linear_attn.A_log"]
    _write(d, cfg.to_hf_dict(), w)
    with pytest.raises(ModelLoadError, match="missing") as e:
        load_checkpoint(d)
    assert "model.layers.1.self_attn.k_norm.weight" in str(e.value)
    assert "model.layers.0.linear_attn.A_log" in str(e.value)


def test_missing_lm_head_untied(good):
    cfg, w, d = good
    del w["lm_head.weight"]
    _write(d, cfg.to_hf_dict(), w)
    with pytest.raises(ModelLoadError, match="lm_head.weight"):
        load_checkpoint(d)


def test_shape_mismatch(good):
    cfg, w, d = good
    w["model.layers.0.linear_attn.conv1d.weight"] = torch.zeros(cfg.conv_dim, 1, 3)
    _write(d, cfg.to_hf_dict(), w)
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(d)
    msg = str(e.value)
    assert "model.layers.0.linear_attn.conv1d.weight" in msg
    assert str([cfg.conv_dim, 1, 3]) in msg and str([cfg.conv_dim, 1, 4]) in msg


def test_unexpected_tensor(good):
    cfg, w, d = good
    w["model.layers.0.linear_attn.mystery.weight"] = torch.zeros(2)
    _write(d, cfg.to_hf_dict(), w)
    with pytest.raises(ModelLoadError, match="unexpected") as e:
        load_checkpoint(d)
    assert "model.layers.0.linear_attn.mystery.weight" in str(e.value)


def test_duplicate_after_normalisation(good):
    cfg, w, d = good
    w["model.language_model.norm.weight"] = w["model.norm.weight"].clone()
    _write(d, cfg.to_hf_dict(), w)
    with pytest.raises(ModelLoadError, match="model.norm.weight"):
        load_checkpoint(d)


def test_index_references_missing_shard(tmp_path):
    cfg = _cfg("test_b")
    _hf_model(cfg).save_pretrained(tmp_path, max_shard_size="100KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        load_checkpoint(tmp_path)


def test_index_lists_tensor_not_in_shard(tmp_path):
    cfg = _cfg("test_b")
    _hf_model(cfg).save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = next(iter(index["weight_map"].values()))
    index["weight_map"]["model.layers.0.ghost.weight"] = shard
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="model.layers.0.ghost.weight"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_unreadable_safetensors(good, damage):
    cfg, w, d = good
    _write(d, cfg.to_hf_dict(), w)
    f = d / "model.safetensors"
    data = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        f.write_bytes(b"\x13\x00\x00\x00\x00\x00\x00\x00not a header at all" + data[:100])
    else:
        f.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_checkpoint(d)


def test_tied_lm_head(tmp_path):
    cfg = _cfg("test_b")
    assert cfg.tie_word_embeddings
    w = _random_weights(cfg)
    w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()
    _write(tmp_path / "same", cfg.to_hf_dict(), w)
    _, got = load_checkpoint(tmp_path / "same")
    assert "lm_head.weight" not in got
    w["lm_head.weight"] = w["lm_head.weight"] + 1
    _write(tmp_path / "differs", cfg.to_hf_dict(), w)
    with pytest.raises(ModelLoadError, match="lm_head.weight"):
        load_checkpoint(tmp_path / "differs")
