"""kernels/triton_gate_cumsum.py against its plain-torch reference (kernels/gate_cumsum.py), bitwise, over
labelled shapes, and the property it exists for: a chunk padded with zero gates ends on its last real row's
value (fla's scan does not: 78 of 200 random chunks differed on an H100). CUDA (or Triton's interpreter)."""
import pytest
import torch

from capsulert.kernels.gate_cumsum import chunk_gate_cumsum_ref
from capsulert.kernels.triton_gate_cumsum import chunk_gate_cumsum

pytestmark = pytest.mark.gpu

SHAPES = {  # B, T, H
    "one-row": (1, 1, 4),
    "ragged-75": (1, 75, 32),
    "9b-heads-two-chunks": (2, 128, 32),
    "rows-7-t200": (7, 200, 16),
    "moe-heads-4096": (1, 4096, 32),
    "odd-heads": (2, 100, 12),
}


def _gates(B, T, H, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return -torch.rand(B, T, H, device="cuda", generator=gen) * 0.3


@pytest.mark.parametrize("scale", [None, 1.4426950408889634], ids=["unscaled", "log2"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_the_kernel_is_the_reference_bitwise(shape, scale, cuda_or_interpreter):
    g = _gates(*shape)
    assert torch.equal(chunk_gate_cumsum(g, 64, scale), chunk_gate_cumsum_ref(g, 64, scale))


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_a_zero_padded_chunk_ends_on_its_last_real_row(shape, cuda_or_interpreter):
    B, T, H = shape
    g = _gates(*shape, seed=1)
    end = -(-T // 64) * 64
    padded = torch.cat([g, torch.zeros(B, end - T + 64, H, device="cuda")], dim=1)
    a, b = chunk_gate_cumsum(g, 64), chunk_gate_cumsum(padded, 64)
    assert torch.equal(b[:, :T], a) and torch.equal(b[:, end - 1], a[:, T - 1])


def test_a_strided_input_is_read_as_its_values(cuda_or_interpreter):
    g = _gates(2, 130, 8).transpose(1, 2).contiguous().transpose(1, 2)  # last dim not contiguous
    assert torch.equal(chunk_gate_cumsum(g, 64, 2.0), chunk_gate_cumsum_ref(g.contiguous(), 64, 2.0))
