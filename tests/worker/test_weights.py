"""Weight updates in place: same buffers, bitwise the engine a fresh load of the new weights gives,
stale capsules refused until rebuilt, bad updates refused with the engine unchanged."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from capsulert.errors import StaleCapsuleError, WeightUpdateError
from capsulert.engine.engine import Engine
from capsulert.protocol.sampling import SamplingParams
from tests.models import MODELS


def _config_path(name):
    from pathlib import Path

    import capsulert

    return Path(capsulert.__file__).parent / "configs" / "models" / f"{name}.yaml"


def perturbed(model_dir, tmp_path, scale=0.05):
    """A copy of the checkpoint with every weight nudged (a 'training step')."""
    out = tmp_path / "updated"
    shutil.copytree(model_dir, out)
    weights = load_file(str(model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    new = {k: (v + scale * torch.randn(v.shape, generator=g) * v.abs().mean()).contiguous() for k, v in weights.items()}
    save_file(new, str(out / "model.safetensors"))
    return out, new


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_update_in_place_equals_a_fresh_load(model_dir, make_engine, tmp_path, text):
    engine = make_engine()
    before = engine.state.data_ptrs()
    weight_ptrs = {k: v.data_ptr() for k, v in engine.model_weights.items()}
    old = engine.open()
    old_logits = old.append(text[:300])
    new_dir, _ = perturbed(model_dir, tmp_path)
    assert engine.update_weights(new_dir) == 1
    assert engine.state.data_ptrs() == before
    assert {k: v.data_ptr() for k, v in engine.model_weights.items()} == weight_ptrs
    fresh = Engine.from_config(dict(model=str(new_dir), device=engine.device.type, slots=2, max_seq=2048,
                                    prefill_chunk=128))
    a, b = engine.open(), fresh.open()
    got, want = a.append(text[:300]), b.append(text[:300])
    assert torch.equal(got, want) and not torch.equal(got, old_logits)
    assert a.generate(12, SamplingParams(ignore_eos=True)) == b.generate(12, SamplingParams(ignore_eos=True))
    assert a.generate(1).weights_version == 1


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_an_update_may_leave_out_the_mtp_head(model_dir, make_engine, tmp_path, text):
    """A trainer built on transformers has no MTP head: its update (a dict or a save_pretrained directory without
    mtp.*) replaces the main model's weights and the head keeps its own."""
    engine = make_engine()
    head = {k: v.clone() for k, v in engine.model_weights.items() if k.startswith("mtp.")}
    assert head
    new_dir, new = perturbed(model_dir, tmp_path)
    main = {k: v for k, v in new.items() if not k.startswith("mtp.")}
    assert engine.update_weights(main) == 1
    assert all(torch.equal(engine.model_weights[k], v) for k, v in head.items())
    without = tmp_path / "without-mtp"
    shutil.copytree(new_dir, without)
    save_file(main, str(without / "model.safetensors"))
    assert engine.update_weights(without) == 2
    save_file({**main, **head}, str(without / "model.safetensors"))  # the main model's new weights, the old head
    fresh = Engine.from_config(dict(model=str(without), device=engine.device.type, slots=2, max_seq=2048,
                                    prefill_chunk=128))
    a, b = engine.open(), fresh.open()
    assert torch.equal(a.append(text[:300]), b.append(text[:300]))
    nxt = int(b.logits().argmax())
    assert torch.equal(engine.runner.mtp_draft([a.slot], [nxt], 3), fresh.runner.mtp_draft([b.slot], [nxt], 3))


def test_stale_capsules_are_refused_until_rebuilt(model_dir, make_engine, tmp_path, text):
    engine = make_engine()
    s = engine.open()
    s.append(text[:250])
    s.snapshot("start", pin=True)
    s.snapshot("other")
    s.close()
    _, new = perturbed(model_dir, tmp_path)
    engine.update_weights(new)
    listing = [(i.name, i.tier, i.pinned) for i in engine.store.list()]
    with pytest.raises(StaleCapsuleError):
        engine.restore("start")
    assert [(i.name, i.tier, i.pinned) for i in engine.store.list()] == listing and engine.free_slots == 4
    engine.rebuild("start")
    assert engine.rebuild("start") is None  # already current
    cold = engine.open()
    want = cold.append(text[:250])
    r = engine.restore("start")
    assert torch.equal(r.logits(), want) and engine.store.info("start").pinned
    r.close()
    # rebuild_pinned: pinned capsules follow the next update, unpinned ones stay stale
    engine.update_weights(load_file(str(model_dir / "model.safetensors")), rebuild_pinned=True)
    engine.restore("start").close()
    with pytest.raises(StaleCapsuleError):
        engine.restore("other")


@pytest.mark.parametrize("bad", ["missing", "extra", "shape", "dtype", "not-tensor", "architecture", "nan", "inf"])
def test_bad_updates_change_nothing(model_dir, make_engine, tmp_path, text, bad):
    engine = make_engine()
    s = engine.open()
    want = s.append(text[:200])
    snapshot = {k: v.clone() for k, v in engine.model_weights.items()}
    _, new = perturbed(model_dir, tmp_path)
    name = "model.layers.0.mlp.down_proj.weight"
    if bad == "missing":
        del new[name]
    elif bad == "extra":
        new["model.layers.99.mlp.down_proj.weight"] = new[name]
    elif bad == "shape":
        new[name] = new[name][:, :-1]
    elif bad == "dtype":
        new[name] = new[name].to(torch.int32)
    elif bad == "not-tensor":
        new[name] = [1.0]
    elif bad in ("nan", "inf"):  # generate then sampled token 0 with logprob nan
        new[name] = new[name].clone()
        new[name][3, 5] = float(bad)
    else:  # a complete, consistent checkpoint of another architecture
        import json

        from capsulert.config.model import ModelConfig
        from capsulert.engine.default_model import init_weights

        cfg = ModelConfig.from_file(_config_path("test_a"))
        new = tmp_path / "other"
        new.mkdir()
        save_file(init_weights(cfg, seed=3), str(new / "model.safetensors"))
        (new / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    with pytest.raises(WeightUpdateError):
        engine.update_weights(new)
    assert engine.weights_version == 0
    assert all(torch.equal(engine.model_weights[k], v) for k, v in snapshot.items())
    t = engine.open()
    assert torch.equal(t.append(text[:200]), want)


def per_expert(weights):
    """`weights` with each layer's fused expert tensors written one by one, as HF's save_pretrained does."""
    out = {}
    for name, t in weights.items():
        prefix, _, leaf = name.partition("mlp.experts.")
        if leaf == "gate_up_proj":
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = t[e, inter:]
        elif leaf == "down_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("model_dir", ["moe"], indirect=True)
def test_an_moe_update_may_name_its_experts_one_by_one(model_dir, make_engine, tmp_path, text):
    _, new = perturbed(model_dir, tmp_path)
    fused, split = make_engine(), make_engine()
    fused.update_weights(new)
    split.update_weights(per_expert(new))
    assert all(torch.equal(split.model_weights[k], v) for k, v in fused.model_weights.items())
    assert torch.equal(split.open().append(text[:200]), fused.open().append(text[:200]))


@pytest.mark.parametrize("bad", ["missing-expert", "expert-shape", "both-forms", "expert-past-the-last"])
@pytest.mark.parametrize("model_dir", ["moe"], indirect=True)
def test_bad_per_expert_updates_change_nothing(model_dir, make_engine, tmp_path, text, bad):
    engine = make_engine()
    snapshot = {k: v.clone() for k, v in engine.model_weights.items()}
    _, new = perturbed(model_dir, tmp_path)
    update = per_expert(new)
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    if bad == "missing-expert":
        del update[name]
    elif bad == "expert-shape":
        update[name] = update[name][:, :-1]
    elif bad == "both-forms":
        update["model.layers.1.mlp.experts.gate_up_proj"] = new["model.layers.1.mlp.experts.gate_up_proj"]
    else:
        update["model.layers.1.mlp.experts.8.up_proj.weight"] = update[name]
    with pytest.raises(WeightUpdateError):
        engine.update_weights(update)
    assert engine.weights_version == 0
    assert all(torch.equal(engine.model_weights[k], v) for k, v in snapshot.items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_nonfinite_counts_on_the_weights_device(device, monkeypatch, dtype):
    """Counted where the weights live; a host tensor bound for a GPU is read there in chunks, and a bad value at
    a chunk's edge or in a short last chunk is counted once."""
    import capsulert.engine.weights as weights

    monkeypatch.setattr(weights, "FINITE_CHUNK_ELEMENTS", 64)
    dev = torch.device(device)
    a = torch.randn(7, 37, dtype=dtype)  # 259 values: four whole chunks and a last one of 3
    for i, v in ((0, float("nan")), (63, float("inf")), (64, float("-inf")), (258, float("nan"))):
        a.view(-1)[i] = v
    b = torch.randn(5, 3, dtype=dtype)
    host = {"a": a.pin_memory() if dev.type == "cuda" else a, "b": b}
    counts = weights.nonfinite_counts({k: (t, dev) for k, t in host.items()})
    assert counts == {"a": 4, "b": 0}
    on_device = weights.nonfinite_counts({"a": (a.to(dev), dev), "b": (b.to(dev), dev)})
    assert on_device == {"a": 4, "b": 0}
    assert weights.nonfinite_counts({}) == {}
