"""What batch-invariant decode on CUDA relies on (engine/model.py): at a fixed 64 rows, every 9B-shape
projection computes a row the same whatever the other rows hold and wherever the row sits. (Which row
counts differ from a lone row is measured by bench/probes/row_stability.py; the padding makes it moot.)"""
import pytest
import torch
import torch.nn.functional as F

SHAPES_9B = [(8192, 4096), (4096, 4096), (64, 4096), (1024, 4096), (12288, 4096), (4096, 12288), (248320, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES_9B, ids=[f"{n}x{k}" for n, k in SHAPES_9B])
def test_a_64_row_projection_is_position_and_content_invariant(shape):
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device: run with -m gpu --device cuda on the GPU machine")
    g = torch.Generator(device="cuda").manual_seed(0)
    n, k = shape
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    row = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
    want = F.linear(torch.cat([row, torch.zeros(63, k, device="cuda", dtype=torch.bfloat16)]), w)[0]
    for pos in (0, 1, 7, 31, 63):
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16, generator=g)
        x[pos] = row[0]
        assert torch.equal(F.linear(x, w)[pos], want), pos
