"""A restore writes a capsule's pieces (its KV blocks, the rows past them, its state) into the slot in one
grouped copy (kernels/triton_copy.py): exactly the capsule's bytes land, in the capsule's rows of the
capsule's slot, and nothing else moves. Engine tests on the default model, at lengths around the grid,
for capsules held as blocks and held whole; and the store's readers wait on each copy's event once."""
from __future__ import annotations

import pytest
import torch

from capsulert.capsule_store.moves import distinct_events
from capsulert.engine.engine import GRID
from capsulert.engine.slot_views import capsule_views

SENTINEL = 7.0
BUFFERS = ("kv_k", "kv_v", "ssm", "conv", "ssm_grid", "conv_grid", "last_hidden")


def names(eng) -> tuple[str, ...]:
    """The buffers a restore writes: with an MTP head its KV rows and its seed at the grid point too."""
    mtp = ("mtp_k", "mtp_v", "grid_hidden") if eng.runner.has_mtp else ()
    return BUFFERS + mtp


def toks(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 4096, (n,), generator=g).tolist()


def snapshot_of(eng, P: int, name: str) -> dict[str, torch.Tensor]:
    """A capsule of P tokens, and the slot's bytes it was made from."""
    s = eng.open()
    s.append(toks(P, P))
    want = {k: v.clone() for k, v in capsule_views(eng.state, s.slot, P, P // GRID * GRID).items()}
    s.snapshot(name)
    s.close()
    return want


def buffers(eng) -> dict[str, torch.Tensor]:
    return {k: eng.state.buffers[k].clone() for k in names(eng)}


def assert_restored_exactly(eng, target, name: str, want: dict[str, torch.Tensor], P: int) -> None:
    """An in-place restore of `name` into target's slot (filled with SENTINEL first) writes the capsule's
    bytes into its rows [0, P) and state, and leaves every other row and slot as it was."""
    slot = target.slot
    for k in names(eng):
        eng.state.slot_view(k, slot).fill_(SENTINEL)
    before = buffers(eng)
    target.restore(name)
    after = buffers(eng)
    rows = eng.state.layout.block_tensors
    for k in rows:
        assert torch.equal(after[k][:, slot, :P], want[k]), k
        assert (after[k][:, slot, P:] == SENTINEL).all(), f"{k}: rows past the capsule were written"
    for k in want.keys() - set(rows):
        assert torch.equal(eng.state.slot_view(k, slot), want[k]), k
    if P % GRID == 0:  # on the grid the grid checkpoint is the live state
        assert torch.equal(eng.state.ssm_grid[:, slot], want["ssm"])
        assert torch.equal(eng.state.conv_grid[:, slot], want["conv"])
        if eng.runner.has_mtp:
            assert torch.equal(eng.state.grid_hidden[slot], want["last_hidden"])
    others = torch.tensor([i for i in range(eng.state.kv_k.shape[1]) if i != slot], device=eng.device)
    for k in names(eng):
        dim = 1 if eng.state.buffers[k].dim() >= 4 else 0
        assert torch.equal(after[k].index_select(dim, others), before[k].index_select(dim, others)), \
            f"{k}: another slot changed"
    assert int(eng.state.pos[slot]) == P and target.tokens == toks(P, P)


@pytest.mark.parametrize("P", [1, GRID - 1, GRID, GRID + 1, 2 * GRID + 2, 3 * GRID, 200])
def test_a_restore_writes_the_capsules_rows_and_state_and_nothing_else(engine, P):
    want = snapshot_of(engine, P, "c")
    target = engine.open()
    assert_restored_exactly(engine, target, "c", want, P)
    assert engine.store.info("c").blocks == (P // GRID + (P >= GRID))  # its KV blocks and its grid-state block


@pytest.mark.parametrize("P", [GRID + 5, 2 * GRID])
def test_a_capsule_held_whole_restores_the_same(engine, P):
    """A capsule of no known origin is held in one piece per tensor: one pair per KV tensor, all its rows."""
    want = snapshot_of(engine, P, "c")
    meta, tensors = engine.store.get("c")
    engine.store.put(meta.replace(name="whole"), tensors)
    assert engine.store.info("whole").blocks == 0
    target = engine.open()
    assert_restored_exactly(engine, target, "whole", want, P)


def test_restores_of_several_lengths_one_after_another_into_one_slot(engine):
    lengths = (3 * GRID + 7, GRID, 2 * GRID - 1)
    wants = {P: snapshot_of(engine, P, f"c{P}") for P in lengths}
    target = engine.open()
    for P in lengths + lengths[::-1]:
        assert_restored_exactly(engine, target, f"c{P}", wants[P], P)


class Event:
    pass


def test_readers_wait_on_each_distinct_event_once():
    a, b = Event(), Event()
    assert distinct_events([a, None, a, b, a, None, b]) == [a, b]
    assert distinct_events([None, None]) == []
