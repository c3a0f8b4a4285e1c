"""Reference kernels against their plain definitions, over labelled shapes."""
import pytest
import torch
import torch.nn.functional as F

from capsulert.kernels.attention import attention_ref, tiled_attention_ref, write_kv_ref
from capsulert.kernels.conv import causal_conv1d_ref, causal_conv1d_step_ref
from capsulert.kernels.gated_delta import (
    chunk_gated_delta_rule_ref,
    gated_delta_step_ref,
    recurrent_gated_delta_rule_ref,
)

GDR_SHAPES = {
    "one-token": (1, 1, 2, 16, 16),
    "partial-chunk": (2, 37, 2, 16, 32),
    "exact-chunk": (1, 64, 4, 32, 16),
    "multi-chunk-ragged": (1, 200, 2, 32, 32),
}


def gdr_inputs(B, T, H, K, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1) * K**-0.5
    k = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, H, V, generator=g)
    gate = -torch.rand(B, T, H, generator=g) * 0.5
    beta = torch.rand(B, T, H, generator=g)
    state = torch.randn(B, H, K, V, generator=g) * 0.3
    return q, k, v, gate, beta, state


@pytest.mark.parametrize("shape", GDR_SHAPES.values(), ids=GDR_SHAPES.keys())
def test_chunk_matches_recurrent(shape):
    args = gdr_inputs(*shape)
    o_ref, s_ref = recurrent_gated_delta_rule_ref(*args)
    o, s = chunk_gated_delta_rule_ref(*args)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, s_ref, rtol=1e-4, atol=1e-4)


def test_step_matches_recurrent():
    q, k, v, g, beta, s = gdr_inputs(3, 1, 2, 16, 8)
    o_ref, s_ref = recurrent_gated_delta_rule_ref(q, k, v, g, beta, s)
    o, s2 = gated_delta_step_ref(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s)
    torch.testing.assert_close(o, o_ref[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s2, s_ref, rtol=1e-5, atol=1e-5)


def test_chunk_split_on_64_grid_is_bitwise():
    q, k, v, g, beta, s = gdr_inputs(1, 256, 2, 32, 32, seed=3)
    o_all, s_all = chunk_gated_delta_rule_ref(q, k, v, g, beta, s)
    o1, s1 = chunk_gated_delta_rule_ref(q[:, :128], k[:, :128], v[:, :128], g[:, :128], beta[:, :128], s)
    o2, s2 = chunk_gated_delta_rule_ref(q[:, 128:], k[:, 128:], v[:, 128:], g[:, 128:], beta[:, 128:], s1)
    assert torch.equal(torch.cat([o1, o2], 1), o_all)
    assert torch.equal(s2, s_all)


CONV_SHAPES = {"short": (1, 3, 8, 4), "long": (2, 50, 16, 4), "kernel2": (1, 10, 4, 2)}


@pytest.mark.parametrize("shape", CONV_SHAPES.values(), ids=CONV_SHAPES.keys())
def test_conv_prefill_and_steps_agree_with_full_conv(shape):
    B, T, C, K = shape
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, C, generator=g)
    w = torch.randn(C, K, generator=g)
    hist = torch.randn(B, C, K - 1, generator=g)
    full = F.silu(F.conv1d(torch.cat([hist, x.transpose(1, 2)], -1), w[:, None], groups=C)).transpose(1, 2)
    out, new_state = causal_conv1d_ref(x, hist, w)
    torch.testing.assert_close(out, full)
    state = hist
    for t in range(T):
        o, state = causal_conv1d_step_ref(x[:, t], state, w)
        torch.testing.assert_close(o, full[:, t], rtol=1e-5, atol=1e-5)
    assert torch.equal(state, new_state)


ATTN_SHAPES = {"decode-gqa2": (2, 1, 4, 2, 16), "chunk-mha": (1, 9, 2, 2, 8), "chunk-gqa4": (2, 5, 8, 2, 16)}


@pytest.mark.parametrize("shape", ATTN_SHAPES.values(), ids=ATTN_SHAPES.keys())
def test_attention_over_static_kv_matches_causal_sdpa(shape):
    B, T, Hq, Hkv, D = shape
    g = torch.Generator().manual_seed(2)
    slots_total, max_seq = 4, 64
    kv_k = torch.randn(slots_total, max_seq, Hkv, D, generator=g)
    kv_v = torch.randn(slots_total, max_seq, Hkv, D, generator=g)
    slots = torch.tensor([3, 1][:B])
    start = torch.tensor([17, 5][:B])
    k = torch.randn(B, T, Hkv, D, generator=g)
    v = torch.randn(B, T, Hkv, D, generator=g)
    q = torch.randn(B, T, Hq, D, generator=g)
    write_kv_ref(kv_k, kv_v, slots, start, k, v)
    out = attention_ref(q, kv_k, kv_v, slots, start, 32, D**-0.5)
    for b in range(B):
        L = int(start[b]) + T
        keys = kv_k[slots[b], :L].repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
        vals = kv_v[slots[b], :L].repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
        mask = torch.ones(T, L, dtype=torch.bool).tril(int(start[b]))
        ref = F.scaled_dot_product_attention(q[b].transpose(0, 1), keys, vals, attn_mask=mask)
        torch.testing.assert_close(out[b], ref.transpose(0, 1), rtol=1e-5, atol=1e-5)
        assert torch.equal(kv_k[slots[b], start[b]:start[b] + T], k[b])


PREFILL_ATTN_SHAPES = {"gqa2-d64": (4, 2, 64), "gqa4-d32": (8, 2, 32), "mqa-d128": (4, 1, 128)}


@pytest.mark.parametrize("shape", PREFILL_ATTN_SHAPES.values(), ids=PREFILL_ATTN_SHAPES.keys())
def test_tiled_prefill_attention_matches_sdpa_and_is_split_invariant(shape):
    """Prefill attention (CPU): close to the SDPA reference, and a query row's bits do not depend on the
    piece it is computed in (its length, its start on or off the 64 grid, the key bound) or on the batch."""
    Hq, Hkv, D = shape
    g = torch.Generator().manual_seed(3)
    kv_k = torch.randn(3, 768, Hkv, D, generator=g)
    kv_v = torch.randn(3, 768, Hkv, D, generator=g)
    q = torch.randn(1, 640, Hq, D, generator=g)
    one = torch.tensor([1])
    full = tiled_attention_ref(q, kv_k, kv_v, one, torch.tensor([0]), 640, 0.1)
    torch.testing.assert_close(full, attention_ref(q, kv_k, kv_v, one, torch.tensor([0]), 640, 0.1), rtol=1e-5, atol=1e-5)
    for a, n, kv_len in [(0, 1, 64), (0, 3, 768), (64, 40, 128), (64, 64, 640), (128, 256, 384), (600, 40, 640),
                         (5, 70, 768)]:
        part = tiled_attention_ref(q[:, a:a + n], kv_k, kv_v, one, torch.tensor([a]), kv_len, 0.1)
        assert torch.equal(part, full[:, a:a + n]), (a, n, kv_len)
    two = tiled_attention_ref(torch.cat([q[:, 64:128], q[:, 64:128]]), kv_k, kv_v, torch.tensor([1, 2]),
                              torch.tensor([64, 64]), 640, 0.1)
    assert torch.equal(two[0], full[0, 64:128])
