"""Which captured graph a batched append replays (engine/graphs.py): the shapes captured under the rows cap and
the smallest that holds a batch. Plain bookkeeping, checked on the CPU (capture itself needs CUDA:
tests/worker/test_graphs.py)."""
import pytest

from capsulert.engine.graphs import GraphPlans, ShapeKey


@pytest.fixture
def plans(engine):
    def make(piece_rows: int, tail_replay: bool = True) -> GraphPlans:
        r = engine.runner
        return GraphPlans(r.model, r.state, r.scratch_slot, 1024, 128, (1, 2, 4, 8), 64, tail_replay,
                          piece_rows=piece_rows)
    return make


def test_batched_appends_are_captured_for_every_shape_under_the_rows_cap(plans):
    g = plans(256)
    assert g.piece_shapes == [(2, 16), (2, 32), (2, 64), (2, 128), (4, 16), (4, 32), (4, 64), (8, 16), (8, 32)]
    keys = set(g.shape_keys())
    assert {ShapeKey(p, b, t) for p in ("pieces", "pieces_replay") for b, t in g.piece_shapes} <= keys
    assert not any(k.phase.startswith("pieces") for k in g.shape_keys(prefill=False))
    # without kept tails no piece replays one: no replaying graphs
    assert not any(k.phase == "pieces_replay" for k in plans(256, tail_replay=False).shape_keys())
    assert plans(0).piece_shapes == [] and not any(k.phase.startswith("pieces") for k in plans(0).shape_keys())


@pytest.mark.parametrize("sessions, tokens, shape", [
    (2, 16, (2, 16)), (3, 40, (4, 64)), (5, 1, (8, 16)), (8, 32, (8, 32)),
    (1, 100, (2, 128)),  # one piece alone pads to two rows
    (8, 33, None), (9, 16, None), (2, 129, None),  # past the cap, the batch buckets, the chunk: eager
], ids=lambda v: str(v))
def test_a_batch_replays_the_smallest_captured_shape_that_holds_it(plans, sessions, tokens, shape):
    assert plans(256).pieces_shape(sessions, tokens) == shape
