"""The reference mixture-of-experts stages (capsulert/kernels/moe.py) and the MoE MLP built on them
(capsulert/engine/moe.py): HF's Qwen3_5MoeSparseMoeBlock's maths, and a token's bits independent of the
other tokens of its step."""
import pytest
import torch
import transformers

from capsulert.kernels import moe as ref
from capsulert.kernels.ops import reference_kernels
from capsulert.config.model import ModelConfig
from capsulert.engine.default_model import REPO_ROOT
from capsulert.engine.moe import moe_mlp
from tests.kernels.routing import route_logits

MOE_CONFIGS = ["tiny_moe", "test_moe_b"]


def _hf_block(name, seed=0):
    cfg = ModelConfig.from_file(REPO_ROOT / "capsulert" / "configs" / "models" / f"{name}.yaml")
    hf_cfg = transformers.Qwen3_5MoeTextConfig(
        **{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")})
    torch.manual_seed(seed)
    block = transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeSparseMoeBlock(hf_cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    return cfg, block


@pytest.mark.parametrize("name", MOE_CONFIGS)
def test_the_moe_mlp_computes_hfs_sparse_moe_block(name):
    cfg, block = _hf_block(name)
    w = {k: v.detach() for k, v in block.state_dict().items()}
    w = {f"mlp.{k}": v for k, v in w.items()}  # the layer-relative names the model's _mlp reads
    x = torch.randn(2, 37, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = block(x)
    got = moe_mlp(cfg, reference_kernels(), w, x, real_rows=2)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-6


def test_routing_normalised_or_raw_probabilities():
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))
    probs = torch.softmax(logits, dim=-1)
    ids, raw = route_logits(ref.moe_route, logits, 3, normalize=False)
    assert torch.equal(ids, torch.topk(probs, 3).indices)
    assert torch.equal(raw, probs.gather(1, ids))
    _, normed = route_logits(ref.moe_route, logits, 3, normalize=True)
    torch.testing.assert_close(normed, raw / raw.sum(-1, keepdim=True), rtol=0, atol=0)


def test_route_ties_go_to_the_lowest_expert_id():
    logits = torch.zeros(2, 8)
    logits[1, 6] = logits[1, 5] = 1.0
    assert route_logits(ref.moe_route, logits, 3, True)[0].tolist() == [[0, 1, 2], [5, 6, 0]]


def _inputs(n, H=64, I=32, E=8, k=2, S=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g)
    logits = torch.randn(n, E, generator=g)
    experts = ref.ExpertWeights(torch.randn(E, 2 * I, H, generator=g) * H ** -0.5,
                                torch.randn(E, H, I, generator=g) * I ** -0.5,
                                torch.randn(S, H, generator=g) * H ** -0.5, torch.randn(S, H, generator=g) * H ** -0.5,
                                torch.randn(H, S, generator=g) * S ** -0.5)
    return x, logits, experts, torch.randn(n, 1, generator=g)


def _run(x, logits, experts, shared_logit, k=2):
    ids, weights = route_logits(ref.moe_route, logits, k, True)
    return ref.moe_experts(x, ids, weights, experts, shared_logit)


def _to(t, dtype):
    return ref.ExpertWeights(*(w.to(dtype) for w in t)) if isinstance(t, ref.ExpertWeights) else t.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_tokens_output_does_not_depend_on_the_other_tokens(dtype):
    """Alone, or at any position among other tokens, also when all of them chose its experts."""
    solo_in = [_to(t, dtype) for t in _inputs(1, seed=5)]
    solo = _run(*solo_in)[0]
    for n, pos, same in [(2, 1, False), (17, 8, False), (33, 32, True), (64, 0, True)]:
        x, logits, _, shared_logit = [_to(t, dtype) for t in _inputs(n, seed=10 + n)]
        if same:
            logits[:] = solo_in[1][0]
        x[pos], logits[pos], shared_logit[pos] = solo_in[0][0], solo_in[1][0], solo_in[3][0]
        got = _run(x, logits, solo_in[2], shared_logit)
        assert torch.equal(got[pos], solo), f"row at {pos} of {n} differs from the row alone"


def test_padding_rows_are_not_routed_and_get_the_gated_shared_expert():
    x, logits, experts, shared_logit = _inputs(6)
    ids, weights = route_logits(ref.moe_route, logits[:2], 2, True)
    out = ref.moe_experts(x, ids, weights, experts, shared_logit)
    assert out.shape == (6, 64)
    assert torch.equal(out[:2], _run(x[:2], logits[:2], experts, shared_logit[:2]))
    act = torch.nn.functional.silu(x[2:] @ experts.shared_gate_proj.T) * (x[2:] @ experts.shared_up_proj.T)
    shared = act @ experts.shared_down_proj.T
    torch.testing.assert_close(out[2:], torch.sigmoid(shared_logit[2:]) * shared, rtol=1e-5, atol=1e-6)
