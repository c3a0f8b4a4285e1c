"""Parity with HF transformers' Qwen3_5ForCausalLM on identical weights (fp32, CPU)."""
import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from capsulert.model_config import ModelConfig
from capsulert.worker.default_model import REPO_ROOT, init_weights
from capsulert.worker.engine import Engine

pytestmark = pytest.mark.usefixtures("hf_on_cpu")  # HF runs its torch path on the CPU

CONFIGS = ["test_a", "test_b", "test_c"]


def hf_model(name):
    cfg = ModelConfig.from_file(REPO_ROOT / "capsulert" / "configs" / "models" / f"{name}.yaml")
    hf_cfg = transformers.Qwen3_5TextConfig(**{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")})
    model = transformers.Qwen3_5ForCausalLM(hf_cfg).eval()
    weights = init_weights(cfg, seed=11)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return cfg, model


def write_checkpoint(name, model, cfg, path):
    if name == "test_b":  # sharded
        model.save_pretrained(path, max_shard_size="20KB")
        assert (path / "model.safetensors.index.json").exists()
    elif name == "test_c":  # Qwen3_5ForConditionalGeneration layout: language-model prefix, extra towers
        path.mkdir()
        sd = {k.replace("model.", "model.language_model.", 1): v.contiguous() for k, v in model.state_dict().items()}
        sd["model.visual.patch_embed.weight"] = torch.zeros(4, 4)
        sd["mtp.fc.weight"] = torch.zeros(4, 4)
        save_file(sd, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": cfg.to_hf_dict()}))
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
        eng.decode([s], [tok])
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
