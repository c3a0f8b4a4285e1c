"""The embedded default model: generation, caching, determinism, and that it behaves like a model."""
from __future__ import annotations

import copy
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

import capsulert.engine.default_model as dm
from capsulert.config.model import ModelConfig
from capsulert.engine.loader import load_checkpoint, load_tokenizer, weights_fingerprint

pytestmark = pytest.mark.usefixtures("hf_on_cpu")  # HF runs its torch path on the CPU

P = 384  # prefix length for the recurrent-state test
N_EVAL = 768  # tokens of corpus text for the margin test


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return dm.ensure_default_model(tmp_path_factory.mktemp("cache") / "default")


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import Qwen3_5ForCausalLM

    model, info = Qwen3_5ForCausalLM.from_pretrained(model_dir, output_loading_info=True, dtype=torch.float32)
    return model.eval(), info


@pytest.fixture(scope="module")
def corpus_ids(model_dir) -> list[int]:
    tok = load_tokenizer(model_dir)
    text = dm.CORPUS_PATH.read_text(encoding="utf-8")
    return tok.encode(text[30_000:60_000]).ids[:N_EVAL]


def test_files_and_config(model_dir):
    assert {p.name for p in model_dir.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json"}
    cfg, weights = load_checkpoint(model_dir)
    yaml_cfg = ModelConfig.from_file(dm.DEFAULT_CONFIG_PATH)
    assert cfg == yaml_cfg  # the YAML is the single source of the shape (eos id included)
    assert all(t.dtype == torch.float32 for t in weights.values())
    tok = load_tokenizer(model_dir)
    assert tok.get_vocab_size() <= cfg.vocab_size
    assert tok.token_to_id(dm.EOS_TOKEN) == cfg.eos_token_id
    text = "Return a new list containing all items from the iterable in ascending order."
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    assert len(ids) < len(text) / 3  # the BPE actually learned merges


def test_cache_reuse(model_dir):
    before = dm.generation_count
    mtimes = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert dm.ensure_default_model(model_dir) == model_dir
    assert dm.generation_count == before
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == mtimes


def test_default_cache_dir_is_keyed():
    d = dm.default_cache_dir()
    assert d.name.startswith("default-") and len(d.name) == len("default-") + 12
    assert d.parent.name == "models"


def test_deterministic_bytes(model_dir, tmp_path, terminal):
    # generated on a (fake) terminal: the progress bar is drawn there, and changes nothing of the bytes
    terminal.attach()
    dm.generate(tmp_path)
    drawn = terminal.getvalue()
    n_steps = len(dm.expected_shapes(dm.default_config())) + 2
    assert "capsulert: generating the default model" in drawn and f"0/{n_steps}" in drawn
    assert "files]" in drawn  # it was drawn up to the last step (tqdm need not draw the final count)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / name).read_bytes() == (model_dir / name).read_bytes(), name
    cfg, w = load_checkpoint(tmp_path)
    assert weights_fingerprint(cfg, w) == weights_fingerprint(*load_checkpoint(model_dir))


def test_lost_race_uses_winner(model_dir, tmp_path, monkeypatch, capsys, caplog):
    target = tmp_path / "shared" / "default"

    def fake_generate(out_dir, *a, **k):  # another process finishes first, while we "generate"
        shutil.copytree(model_dir, target)
        for f in dm.FILES:
            (Path(out_dir) / f).write_text("ours")
        dm.generation_count += 1

    monkeypatch.setattr(dm, "generate", fake_generate)
    with caplog.at_level(logging.INFO, logger=dm.__name__):
        assert dm.ensure_default_model(target) == target
    assert (target / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
    assert os.listdir(target.parent) == ["default"]  # our temp dir is gone
    # the library logs what it did (generating, then that it uses the winner's copy) and prints nothing
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == dm.__name__]
    assert said == [(logging.INFO, f"generating the default model into {target} (once: later runs reuse it)"),
                    (logging.INFO, f"another process generated the default model into {target} first; using its copy")]
    assert capsys.readouterr() == ("", "")


def test_generation_logs_its_time_and_draws_no_bar_off_a_terminal(tmp_path, monkeypatch, capsys, caplog):
    calls = []

    def fake_generate(out_dir, *a, progress=None, **k):
        calls.append(progress)
        for f in dm.FILES:
            (Path(out_dir) / f).write_text("x")
    monkeypatch.setattr(dm, "generate", fake_generate)
    with caplog.at_level(logging.INFO, logger=dm.__name__):
        dm.ensure_default_model(tmp_path / "m", progress=False)
    assert calls == [False]  # the caller's choice reaches the generation
    said = [r.getMessage() for r in caplog.records if r.name == dm.__name__]
    assert said[0].startswith("generating the default model into") and said[1].startswith("generated the default model in")
    assert capsys.readouterr() == ("", "")


def test_hf_loads_without_missing_or_unexpected(hf_model):
    _, info = hf_model
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_clear_top1_margin(hf_model, corpus_ids):
    model, _ = hf_model
    with torch.no_grad():
        logits = model(torch.tensor([corpus_ids])).logits[0]
    top = logits.topk(2, dim=-1).values
    margin = (top[:, 0] - top[:, 1]).median().item()
    assert margin > 1.0, margin
    assert logits.argmax(-1).unique().numel() > 100  # not one token everywhere


def test_recurrent_state_is_load_bearing(hf_model, corpus_ids):
    model, _ = hf_model
    cfg = model.config
    linear = [i for i, t in enumerate(cfg.layer_types) if t == "linear_attention"]
    x = torch.tensor([corpus_ids])
    with torch.no_grad():
        out = model(x[:, :P], use_cache=True)
        kept = out.past_key_values
        zeroed = copy.deepcopy(kept)
        for i in linear:
            zeroed.layers[i].recurrent_states[0].zero_()

        # teacher-forced: the next 16 corpus tokens, with and without the recurrent state
        nxt = x[:, P : P + 16]
        a = model(nxt, past_key_values=copy.deepcopy(kept)).logits[0].argmax(-1)
        b = model(nxt, past_key_values=copy.deepcopy(zeroed)).logits[0].argmax(-1)
        differ = (a != b).tolist()
        assert any(differ[:4]), differ
        assert sum(differ) >= 8, differ

        # greedy: 8 tokens from the same first token
        def greedy(cache):
            t, toks = out.logits[:, -1:].argmax(-1), []
            for _ in range(8):
                t = model(t, past_key_values=cache).logits[:, -1:].argmax(-1)
                toks.append(t.item())
            return toks

        ga, gb = greedy(copy.deepcopy(kept)), greedy(copy.deepcopy(zeroed))
    assert ga[:4] != gb[:4], (ga, gb)


def test_decay_is_slow(model_dir):
    _, w = load_checkpoint(model_dir)
    for name, a_log in w.items():
        if name.endswith("A_log"):
            dt_bias = w[name.replace("A_log", "dt_bias")]
            rate = a_log.exp() * torch.nn.functional.softplus(dt_bias)
            assert rate.max() < 0.05 and rate.min() > 1e-5, (name, rate)  # memory ~20..100k tokens
