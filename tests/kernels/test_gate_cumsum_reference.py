"""kernels/gate_cumsum.py: the in-chunk gate cumsum added in token order, so padding gates (0) after a row's
last real token leave the cumsum there unchanged: a piece padded to a graph's bucket or to a batched forward's
longest row decays its last chunk's state by bitwise the same amount as the piece alone. On the CPU; the
Triton kernel is held to this reference in test_gate_cumsum_kernel.py (CUDA)."""
import pytest
import torch

from capsulert.kernels.gate_cumsum import chunk_gate_cumsum_ref
from capsulert.kernels.gated_delta import chunk_gated_delta_rule_ref

SHAPES = {  # B, T, H
    "one-row": (1, 1, 4),
    "ragged-75": (1, 75, 32),
    "two-chunks": (2, 128, 8),
    "rows-3-t200": (3, 200, 16),
}


def _gates(B, T, H, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return -torch.rand(B, T, H, generator=gen) * 0.3


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_the_cumsum_adds_each_chunk_in_token_order_then_scales(shape):
    g = _gates(*shape)
    got = chunk_gate_cumsum_ref(g, 64, 1.5)
    want = torch.empty_like(g)
    for c in range(0, g.shape[1], 64):
        acc = torch.zeros(g.shape[0], g.shape[2])
        for t in range(c, min(c + 64, g.shape[1])):
            acc = acc + g[:, t]
            want[:, t] = acc * 1.5
    assert torch.equal(got, want)
    assert torch.equal(chunk_gate_cumsum_ref(g, 64), chunk_gate_cumsum_ref(g, 64, None))


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_zero_padding_leaves_every_real_row_and_repeats_the_last(shape):
    B, T, H = shape
    g = _gates(*shape, seed=1)
    padded = torch.cat([g, torch.zeros(B, -(-T // 64) * 64 + 64 - T, H)], dim=1)
    a, b = chunk_gate_cumsum_ref(g, 64), chunk_gate_cumsum_ref(padded, 64)
    assert torch.equal(b[:, :T], a)
    last_chunk_end = -(-T // 64) * 64
    assert torch.equal(b[:, last_chunk_end - 1], a[:, T - 1])


@pytest.mark.parametrize("device", ["cpu"])
def test_the_plain_torch_chunked_rule_ignores_zero_gate_padding_bitwise(device):
    """The reference chunked rule (the kernel set of `kernels: triton`) keeps the same property: a row padded
    with tokens whose gate and write strength are 0 ends in bitwise the state of the row alone."""
    gen = torch.Generator().manual_seed(2)
    B, T, H, K, V = 1, 75, 2, 16, 16
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v, g = torch.randn(B, T, H, V, generator=gen), -torch.rand(B, T, H, generator=gen)
    beta, h0 = torch.rand(B, T, H, generator=gen), torch.randn(B, H, K, V, generator=gen)
    pad = 40
    o, s = chunk_gated_delta_rule_ref(q, k, v, g, beta, h0)
    o2, s2 = chunk_gated_delta_rule_ref(*(torch.cat([x, x[:, :pad]], 1) for x in (q, k, v)),
                                        torch.cat([g, torch.zeros(B, pad, H)], 1),
                                        torch.cat([beta, torch.zeros(B, pad, H)], 1), h0)
    assert torch.equal(o2[:, :T], o) and torch.equal(s2, s)
