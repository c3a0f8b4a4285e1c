"""Parity with HF transformers' Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM on identical weights (fp32, CPU),
loaded through our loader from the checkpoint layouts HF and the released models use."""
import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from capsulert.config.model import ModelConfig
from capsulert.engine.default_model import REPO_ROOT, init_weights
from capsulert.engine.engine import Engine

pytestmark = pytest.mark.usefixtures("hf_on_cpu")  # HF runs its torch path on the CPU

# dense configs, then MoE ones (tiny_moe: save_pretrained's per-expert tensors, sharded; test_moe_b: the
# fused expert tensors of HF's state dict, in the multimodal layout)
CONFIGS = ["test_a", "test_b", "test_c", "tiny_moe", "test_moe_b"]
SHARDED = {"test_b": "20KB", "tiny_moe": "300KB"}
MULTIMODAL = {"test_c": "qwen3_5", "test_moe_b": "qwen3_5_moe"}  # ...ForConditionalGeneration checkpoints


def hf_model(name):
    cfg = ModelConfig.from_file(REPO_ROOT / "capsulert" / "configs" / "models" / f"{name}.yaml")
    config_cls, model_cls = ((transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM) if cfg.is_moe
                             else (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM))
    hf_cfg = config_cls(**{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")})
    model = model_cls(hf_cfg).eval()
    # transformers has no MTP head (tests/worker/test_mtp.py checks ours against a reference of its own)
    weights = {k: v for k, v in init_weights(cfg, seed=11).items() if not k.startswith("mtp.")}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return cfg, model


def write_checkpoint(name, model, cfg, path):
    if name in SHARDED:
        model.save_pretrained(path, max_shard_size=SHARDED[name])
        assert (path / "model.safetensors.index.json").exists()
    elif name in MULTIMODAL:  # language-model prefix, extra towers
        path.mkdir()
        sd = {k.replace("model.", "model.language_model.", 1): v.contiguous().clone()  # tied tensors: two copies
              for k, v in model.state_dict().items()}
        sd["model.visual.patch_embed.weight"] = torch.zeros(4, 4)
        sd["mtp.fc.weight"] = torch.zeros(4, 4)
        save_file(sd, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps({"model_type": MULTIMODAL[name], "text_config": cfg.to_hf_dict(),
                                                      "vision_config": {"depth": 2}}))
    else:
        model.save_pretrained(path)
    return path


def rel_err(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_and_greedy_match_hf(name, tmp_path):
    cfg, model = hf_model(name)
    path = write_checkpoint(name, model, cfg, tmp_path / "ckpt")
    eng = Engine.from_config(model=str(path), device="cpu", dtype="float32", slots=2, max_seq=512, prefill_chunk=64)
    prompt = torch.randint(0, cfg.vocab_size, (1, 100), generator=torch.Generator().manual_seed(5))

    s = eng.open()
    ours = s.append(prompt[0])
    with torch.no_grad():
        out = model(prompt, use_cache=True)
    assert rel_err(ours, out.logits[0, -1]) < 1e-4
    cache, tok = out.past_key_values, int(out.logits[0, -1].argmax())
    for _ in range(32):
        eng.table.step([s], [tok])
        with torch.no_grad():
            out = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        assert rel_err(s.logits(), out.logits[0, -1]) < 1e-4
        tok = int(out.logits[0, -1].argmax())

    g = eng.open()
    g.append(prompt[0])
    with torch.no_grad():
        hf_tokens = model.generate(prompt, max_new_tokens=48, do_sample=False, min_new_tokens=48)[0, 100:].tolist()
    assert g.generate(48) == hf_tokens
