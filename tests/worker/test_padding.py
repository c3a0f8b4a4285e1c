"""Padded forwards (what captured graphs run) equal unpadded ones on the real tokens and rows."""
import pytest
import torch

from tests.worker.test_engine import slot_state
from tests.models import MODELS


def close(a, b):
    tol = 1e-4 if a.dtype == torch.float32 else 3e-2
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_padded_prefill_chunk_matches_exact_length(engine, text):
    tokens = engine.tokenize(text)[:37]
    exact = engine.open()
    exact.append(tokens)
    padded = engine.open()
    dev = engine.device
    ids = torch.zeros(1, 64, dtype=torch.long, device=dev)
    ids[0, :37] = torch.tensor(tokens)
    engine.model.forward(engine.state, torch.tensor([padded.slot], device=dev), ids, 128, torch.tensor([37], device=dev))
    padded.tokens = list(tokens)
    a, b = slot_state(engine, exact), slot_state(engine, padded)
    assert torch.equal(a["pos"], b["pos"])
    for k in ("kv_k", "kv_v", "ssm", "conv", "last_hidden"):
        close(a[k], b[k])
    close(exact.logits(), padded.logits())
    assert exact.generate(8) == padded.generate(8)


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_padded_decode_rows_touch_only_the_scratch_slot(engine, text):
    s = engine.open()
    s.append(text[:300])
    bystander = engine.open()
    bystander.append(text[300:500])
    before = slot_state(engine, bystander)
    ref = engine.open()
    ref.append(text[:300])
    ref_logits = engine.table.step([ref], [7])
    scratch = engine.runner.scratch_slot
    engine.state.pos[scratch] = 0
    dev = engine.device
    slots = torch.tensor([s.slot, scratch, scratch], device=dev)
    engine.model.forward(engine.state, slots, torch.tensor([[7], [0], [0]], device=dev), engine.config.max_seq,
                         decode=True)
    # batch-invariant decode: the row equals the one computed alone, bitwise
    assert torch.equal(engine.model.logits(engine.state, slots[:1])[0], ref_logits[0])
    after = slot_state(engine, bystander)
    for k in before:
        assert torch.equal(before[k], after[k]), k


def test_prefill_buckets_cover_the_chunk():
    from capsulert.engine.graphs import prefill_buckets

    assert prefill_buckets(256) == [16, 32, 64, 128, 256]
    assert prefill_buckets(64) == [16, 32, 64]


def test_decode_buckets_always_cover_the_largest_batch():
    """Every decode batch up to min(slots, 64) has a captured graph (a batch above the largest bucket used
    to crash with a bare StopIteration)."""
    from capsulert.engine.graphs import decode_buckets

    assert decode_buckets((1, 2, 4, 8), 12) == (1, 2, 4, 8, 12)
    assert decode_buckets((1, 2, 4, 8, 16, 32, 64), 64) == (1, 2, 4, 8, 16, 32, 64)
    assert decode_buckets((1, 2, 4, 8, 16, 32, 64), 5) == (1, 2, 4, 5)
    assert decode_buckets((), 3) == (3,)
