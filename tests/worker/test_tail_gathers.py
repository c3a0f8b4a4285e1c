"""The gathers of engine/tail_replay.py's graph form (per-row [B] replay and tail_from tensors) against a loop
over the rows: each places exactly the rows the row's own counts say, padding rows included, whole rows at a
time. Any device (`--device cuda` runs them on the GPU)."""
import pytest
import torch

from capsulert.engine.tail_replay import gather_rows, keep_tail, new_rows, with_tail

# (rows of a batch, tail rows a slot holds, new rows, channels)
SHAPES = {"one row": (1, 64, 16, 8), "a crowd's turns": (5, 64, 32, 6), "short tail": (3, 8, 3, 2)}


@pytest.fixture(params=list(SHAPES.values()), ids=list(SHAPES))
def shape(request):
    return request.param


def test_with_tail_puts_each_rows_replayed_tail_before_its_new_rows(shape, device):
    B, held, T, C = shape
    g = torch.Generator().manual_seed(B)
    tail, new = torch.randn(B, held, C, generator=g).to(device), torch.randn(B, T, C, generator=g).to(device)
    replay = torch.randint(0, held, (B,), generator=g)
    replay[0] = 0  # a row with nothing to replay
    got = with_tail(tail, new, replay.to(device))
    assert got.shape == (B, held + T, C)
    for b, r in enumerate(replay.tolist()):
        assert torch.equal(got[b, :r], tail[b, :r]) and torch.equal(got[b, r:r + T], new[b])
        assert torch.equal(got[b, r + T:], new[b, -1].expand(held - r, C))  # padding: the last new row


def test_new_rows_takes_each_rows_outputs_after_its_replayed_tail(shape, device):
    B, held, T, C = shape
    g = torch.Generator().manual_seed(B + 1)
    o = torch.randn(B, held + T, 2, C, generator=g).to(device)
    replay = torch.randint(0, held, (B,), generator=g)
    got = new_rows(o, replay.to(device), T)
    assert got.shape == (B, T, 2, C)
    for b, r in enumerate(replay.tolist()):
        assert torch.equal(got[b], o[b, r:r + T])


def test_keep_tail_writes_each_slot_its_rows_from_tail_from_on(shape, device):
    B, held, T, C = shape
    g = torch.Generator().manual_seed(B + 2)
    L = held + T
    buf = torch.zeros(B + 2, held, C, device=device)
    slots = torch.randperm(B + 2, generator=g)[:B]
    # a view of a wider projection, as the model's split projections are: rows strided past their width
    rows = torch.randn(B, L, C + 3, generator=g)[..., :C].to(device)
    tail_from = torch.randint(0, L, (B,), generator=g)
    keep_tail(buf, slots.to(device), rows, tail_from.to(device))
    for b, (s, f) in enumerate(zip(slots.tolist(), tail_from.tolist())):
        want = rows[b, [min(f + j, L - 1) for j in range(held)]]
        assert torch.equal(buf[s], want)
    others = sorted(set(range(B + 2)) - set(slots.tolist()))
    assert not buf[others].any()


def test_gather_rows_reads_a_strided_view_as_its_rows(device):
    x = torch.arange(2 * 4 * 6, dtype=torch.float32, device=device).view(2, 4, 6)[..., 1:4]
    idx = torch.tensor([[3, 0], [1, 1]], device=device)
    assert torch.equal(gather_rows(x, idx), torch.stack([x[0, [3, 0]], x[1, [1, 1]]]))
