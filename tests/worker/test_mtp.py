"""The MTP head (engine/mtp.py): parity with a plain-torch reference, its state through every verb, drafting.

The reference below is written from the architecture as vLLM (its qwen3_5_mtp and
qwen3_next_mtp models) and LightLLM (its qwen3next_mtp model) implement it; transformers has no MTP module. The
main model's hidden states it starts from come from HF transformers' Qwen3_5ForCausalLM /
Qwen3_5MoeForCausalLM on the same weights (its final-normed last hidden state, what its LM head reads)."""
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from capsulert.engine import capsules
from capsulert.engine.engine import Engine
from capsulert.engine.loader import load_checkpoint
from capsulert.errors import IncompatibleCapsuleError, InvalidRequestError, NoMtpHeadError
from tests.models import MODELS
from tests.worker.test_engine import assert_state_equal, slot_state


def toks(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 4096, (n,), generator=g).tolist()


# ---------------------------------------------------------------------------------------------- reference
def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def rotate(x, cos, sin, rot):
    x1, x2 = x[..., :rot // 2], x[..., rot // 2:rot]
    return torch.cat([x[..., :rot] * cos + torch.cat([-x2, x1], -1) * sin, x[..., rot:]], -1)


def reference_mlp(cfg, W, p, x):
    if not cfg.is_moe:
        return (F.silu(x @ W[p + "mlp.gate_proj.weight"].T) * (x @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T
    probs = torch.softmax(x @ W[p + "mlp.gate.weight"].T, -1)
    top, ids = probs.topk(cfg.num_experts_per_tok, -1)
    top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    inter = cfg.moe_intermediate_size
    for n in range(x.shape[0]):
        for r in range(ids.shape[1]):
            e = int(ids[n, r])
            gu = W[p + "mlp.experts.gate_up_proj"][e] @ x[n]
            out[n] += top[n, r] * (W[p + "mlp.experts.down_proj"][e] @ (F.silu(gu[:inter]) * gu[inter:]))
    s = p + "mlp.shared_expert."
    shared = (F.silu(x @ W[s + "gate_proj.weight"].T) * (x @ W[s + "up_proj.weight"].T)) @ W[s + "down_proj.weight"].T
    return out + torch.sigmoid(x @ W[p + "mlp.shared_expert_gate.weight"].T) * shared


def reference_mtp(cfg, W, hidden, tokens):
    """The head over entries 0..n-1 (positions 0..n-1): hidden [n, H] (main model, final-normed, or the head's
    own output when chained) and tokens [n] (the token after each position). Returns (m [n, H], logits, k)."""
    eps, D = cfg.rms_norm_eps, cfg.head_dim
    n = hidden.shape[0]
    e = rms(W["model.embed_tokens.weight"][tokens], W["mtp.pre_fc_norm_embedding.weight"], eps)
    y = torch.cat([e, rms(hidden, W["mtp.pre_fc_norm_hidden.weight"], eps)], -1) @ W["mtp.fc.weight"].T
    p = "mtp.layers.0."
    x = rms(y, W[p + "input_layernorm.weight"], eps)
    q, gate = (x @ W[p + "self_attn.q_proj.weight"].T).view(n, -1, 2 * D).chunk(2, -1)
    k = (x @ W[p + "self_attn.k_proj.weight"].T).view(n, -1, D)
    v = (x @ W[p + "self_attn.v_proj.weight"].T).view(n, -1, D)
    rot = cfg.rotary_dim
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    freqs = torch.arange(n, dtype=torch.float32)[:, None] * inv
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
    q = rotate(rms(q, W[p + "self_attn.q_norm.weight"], eps), cos, sin, rot)
    k = rotate(rms(k, W[p + "self_attn.k_norm.weight"], eps), cos, sin, rot)
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv) * torch.sigmoid(gate)
    y = y + o.reshape(n, -1) @ W[p + "self_attn.o_proj.weight"].T
    y = y + reference_mlp(cfg, W, p, rms(y, W[p + "post_attention_layernorm.weight"], eps))
    m = rms(y, W["mtp.norm.weight"], eps)
    return m, m @ W["lm_head.weight"].T, k


def hf_hidden(cfg, W, tokens):
    """The main model's final-normed hidden states (HF transformers)."""
    config_cls, model_cls = ((transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM) if cfg.is_moe
                             else (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM))
    hf_cfg = config_cls(**{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")})
    model = model_cls(hf_cfg).eval()
    model.load_state_dict({k: v for k, v in W.items() if not k.startswith("mtp.")}, strict=False)
    with torch.no_grad():
        return model.model(torch.tensor([tokens])).last_hidden_state[0]


def rel_err(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.usefixtures("hf_on_cpu")
@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_head_matches_the_reference(model_dir, make_engine):
    engine = make_engine(device="cpu")  # fp32 on the CPU, whatever device the suite runs
    cfg, W = load_checkpoint(model_dir)
    assert cfg.has_mtp and "mtp.fc.weight" in W
    prompt = toks(150, 1)
    s = engine.open()
    nxt = int(s.append(prompt).argmax())
    drafts, logits = engine.runner.mtp.chain(engine.state, engine.runner.slot_ids([s.slot]),
                                             torch.tensor([nxt]), 3, engine.config.max_seq)
    hidden = hf_hidden(cfg, W, prompt)
    seq, hid = prompt[1:] + [nxt], hidden
    for j in range(3):  # the chain: each step's output and greedy token feed the next
        m, ref_logits, k = reference_mtp(cfg, W, hid, torch.tensor(seq))
        assert rel_err(logits[0, j], ref_logits[-1]) < 1e-4, j
        assert int(drafts[0, j]) == int(ref_logits[-1].argmax())
        seq, hid = seq + [int(drafts[0, j])], torch.cat([hid, m[-1:]])
    # the committed cache rows: entry i (position i, token i + 1) in row i + 1, up to the prompt's end
    n = len(prompt)
    mine = engine.state.mtp_k[0, s.slot, 1:n].float().view(n - 1, -1)
    assert rel_err(mine, k[:n - 1].reshape(n - 1, -1)) < 1e-4


# ---------------------------------------------------------------------------------------------- exactness
def draft(engine, s, k=3):
    return engine.runner.mtp_draft([s.slot], [int(s.logits().argmax())], k)


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
@pytest.mark.parametrize("tail_replay", [True, False], ids=["tail-replay", "re-run"])
def test_split_prefill_and_restore_append_equal_cold(make_engine, tail_replay):
    engine = make_engine(tail_replay=tail_replay)
    tokens = toks(420, 2)
    cold = engine.open()
    cold.append(tokens)
    split = engine.open()
    for a, b in [(0, 37), (37, 100), (100, 130), (130, 301)]:
        split.append(tokens[a:b])
    split.snapshot("at-301")
    split.append(tokens[301:])
    assert_state_equal(slot_state(engine, cold), slot_state(engine, split))
    restored = engine.restore("at-301")
    restored.append(tokens[301:])
    assert_state_equal(slot_state(engine, cold), slot_state(engine, restored))
    assert torch.equal(draft(engine, cold), draft(engine, restored))
    assert torch.equal(draft(engine, cold), draft(engine, split))


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_decode_to_a_grid_point_rederives_the_head_rows(engine):
    tokens = toks(50, 3)
    s = engine.open()
    s.append(tokens)
    s.generate(20)  # crosses 64
    cold = engine.open()
    cold.append(s.tokens[:64])
    st = engine.state
    for name in ("mtp_k", "mtp_v"):
        assert torch.equal(st.buffers[name][:, s.slot, :64], st.buffers[name][:, cold.slot, :64])
    assert torch.equal(st.grid_hidden[s.slot], st.last_hidden[cold.slot])
    # an append from there re-runs from the grid point with its seed: a cold prefill's state
    s.append(tokens[:30])
    again = engine.open()
    again.append(list(s.tokens))
    assert_state_equal(slot_state(engine, again), slot_state(engine, s))


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_fork_truncate_and_drafts_after_restore(engine):
    tokens = toks(300, 4)
    s = engine.open()
    s.append(tokens)
    s.generate(6)
    want = draft(engine, s)
    s.snapshot("c")
    a, b = engine.fork("c", 2)
    assert torch.equal(draft(engine, a), want) and torch.equal(draft(engine, b), want)
    assert_state_equal(slot_state(engine, a), slot_state(engine, s))
    assert a.generate(8) == s.generate(8)
    assert torch.equal(draft(engine, a), draft(engine, s))
    b.truncate(250)
    cold = engine.open()
    cold.append(tokens[:250])
    assert_state_equal(slot_state(engine, cold), slot_state(engine, b))


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_prefix_cache_hit_and_disk_round_trip(make_engine, tmp_path):
    engine = make_engine(prefix_cache=True, disk_dir=str(tmp_path / "disk"))
    tokens = toks(400, 5)
    first = engine.open(namespace="default")
    first.append(tokens[:300])
    first.generate(5)
    first.close()  # keeps its grid checkpoint at 256 (its head's rows and seed among it)
    hit = engine.open(namespace="default")
    hit.append(tokens)
    assert engine.store.stats()["prefix"]["hits"] >= 1
    cold = engine.open(namespace=None)
    cold.append(tokens)
    assert_state_equal(slot_state(engine, cold), slot_state(engine, hit))
    cold.snapshot("d", tier="disk")
    engine.store.save(tmp_path / "saved")
    other = make_engine(prefix_cache=True)  # another store of the same numerics reads the file
    assert other.store.load(tmp_path / "saved") == 1
    back = other.restore("d")
    assert_state_equal(slot_state(engine, cold), slot_state(other, back))
    assert torch.equal(draft(other, back).cpu(), draft(engine, cold).cpu())


def test_drafts_are_batch_invariant_and_leave_no_trace(engine):
    a, b = engine.open(), engine.open()
    a.append(toks(90, 6))
    b.append(toks(200, 7))
    before = {k: v.clone() for k, v in slot_state(engine, a).items()}
    nxt = [int(a.logits().argmax()), int(b.logits().argmax())]
    both = engine.runner.mtp_draft([a.slot, b.slot], nxt, 3)
    assert torch.equal(both[0], engine.runner.mtp_draft([a.slot], nxt[:1], 3)[0])
    assert torch.equal(both[1], engine.runner.mtp_draft([b.slot], nxt[1:], 3)[0])
    assert_state_equal(before, slot_state(engine, a))
    ref = engine.open()
    ref.append(list(a.tokens))
    assert a.generate(10) == ref.generate(10)  # decode after drafting: as if nothing was drafted


def test_draft_arguments_are_checked(engine):
    s = engine.open()
    empty = engine.open()
    s.append(toks(20, 8))
    for k in (0, 17, True):
        with pytest.raises(InvalidRequestError):
            engine.runner.mtp_draft([s.slot], [1], k)
    with pytest.raises(InvalidRequestError):
        engine.runner.mtp_draft([empty.slot], [1], 3)
    with pytest.raises(InvalidRequestError):
        engine.runner.mtp_draft([s.slot], [5000], 3)


def test_capsules_of_the_older_layout_are_refused(make_engine, monkeypatch, tmp_path):
    monkeypatch.setattr(capsules, "LAYOUT_VERSION", 3)  # an engine of the layout before the MTP state
    old = make_engine()
    s = old.open()
    s.append(toks(100, 9))
    s.snapshot("old", tier="disk" if old.config.disk_dir else "host")
    old.store.save(tmp_path / "v3")
    monkeypatch.undo()
    engine = make_engine()
    with pytest.raises(IncompatibleCapsuleError, match="layout"):
        engine.store.load(tmp_path / "v3")
    assert engine.store.list() == []


def test_a_checkpoint_without_mtp_weights_runs_without_a_head(default_model_dir, device, tmp_path):
    path = tmp_path / "no-mtp"
    shutil.copytree(default_model_dir, path)
    weights = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.startswith("mtp.")}, str(path / "model.safetensors"))
    cfg, _ = load_checkpoint(path)
    assert not cfg.has_mtp
    engine = Engine.from_config(dict(model=str(path), device=device, slots=2, max_seq=512, prefill_chunk=128))
    assert not engine.runner.has_mtp and "mtp_k" not in engine.state.buffers
    s = engine.open()
    s.append(toks(70, 10))
    assert len(s.generate(4)) == 4
    s.snapshot("c")
    assert engine.restore("c").tokens == s.tokens
    with pytest.raises(NoMtpHeadError):
        engine.runner.mtp_draft([s.slot], [1], 3)
