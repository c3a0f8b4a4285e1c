"""The expert kernels' work plan (capsulert/kernels/triton_moe_plan.py) against its plain-torch reference,
over labelled shapes: the one-program bucket sort of a step of few pairs (the chosen experts only, their
bounds, empty programs after them) and the torch sort of a longer piece (one program per expert)."""
import pytest
import torch

import triton  # noqa: F401  (tests/conftest.py ignores this module where triton is not installed)

from capsulert.kernels.triton_moe_plan import BUCKET_PAIRS, expert_plan, expert_plan_ref

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_or_interpreter")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (n tokens, k ranks, E experts, all tokens on the same experts)
SHAPES = {
    "b1-35b": (1, 8, 256, False),
    "b8-35b": (8, 8, 256, False),
    "b64-35b": (64, 8, 256, False),
    "b128-35b-largest-bucket": (BUCKET_PAIRS // 8, 8, 256, False),
    "b64-same-experts": (64, 8, 256, True),
    "tiny": (3, 2, 8, False),
    "more-pairs-than-experts": (40, 2, 8, False),
}


def _ids(n, k, E, same, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(1 if same else n)])
    return ids.expand(n, k).contiguous().to(torch.int32).to(DEVICE)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_bucket_plan_lists_the_chosen_experts_only(shape):
    n, k, E, same = shape
    ids = _ids(n, k, E, same)
    plan = expert_plan(ids, E)
    order, chosen, bounds = expert_plan_ref(ids, E)
    c = chosen.numel()
    assert plan.programs == min(E, n * k) and plan.experts is not None
    assert torch.equal(plan.order.cpu(), order.cpu())
    assert torch.equal(plan.experts[:c].cpu(), chosen.cpu())
    assert torch.equal(plan.bounds[:c + 1].cpu(), bounds.cpu())
    assert (plan.bounds[c:].cpu() == n * k).all()  # the programs after the chosen experts have no pairs


def test_a_longer_piece_keeps_one_program_per_expert():
    n, k, E = BUCKET_PAIRS // 2 + 1, 2, 64
    ids = _ids(n, k, E, False, seed=3)
    plan = expert_plan(ids, E)
    assert plan.experts is None and plan.programs == E
    order, chosen, bounds = expert_plan_ref(ids, E)
    assert torch.equal(plan.order.cpu(), order.cpu())
    counts = torch.zeros(E, dtype=torch.int32)
    counts[chosen.cpu().long()] = (bounds[1:] - bounds[:-1]).cpu()
    assert torch.equal(plan.bounds.cpu(), torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).int()]))
