"""Rollback states of speculative decode: the per-slot live state after each verified position but the last.

A speculative step feeds a slot its sampled token and up to MAX_SPECULATE drafts, one decode position each
(ModelRunner.verify); the slot's state then stands after the last of them, and if a draft is rejected it must
go back to the position of the last accepted token. Of the state set only the buffers in
`StateLayout.rollback_names()` change as a whole per step (recurrent and conv state, position, last hidden
state, and whatever buffer a later layout adds that is neither positional nor prefill-only); the KV rows past
the kept position need no rollback (a later step writes a position's rows before anything reads them).

Two ways were measured on the CPU (default model, one slot, the 2-core box: RollbackStates.keep / restore
against ModelRunner.decode): keeping a copy of those buffers
after each position and copying the chosen one back ("slot selection": 431 KB a position, keep 0.14 ms,
restore 0.13 ms) against snapshotting them once and re-running the accepted tokens after a rejection (a
decode step per token re-run: 29 ms each there, and on a GPU a pass of the weights each, which is what
speculation exists to save). Slot selection costs a copy per position whatever is accepted and never a
forward, so it is the one here.

Owned by the runner, allocated once at start: `capacity` sets (EngineConfig.speculate_slots) of
MAX_SPECULATE copies each. A step speculates for at most `capacity` sessions; the others decode plainly that
step (exact either way).
"""
from __future__ import annotations

import torch

from capsulert.engine.state import StateSet
from capsulert.protocol.sampling import MAX_SPECULATE


class RollbackStates:
    def __init__(self, state: StateSet, capacity: int):
        self.state = state
        self.capacity = capacity
        self.names = state.layout.rollback_names()
        self.buffers: dict[str, torch.Tensor] = {}
        if capacity:
            for name in self.names:
                view = state.slot_view(name, 0)
                self.buffers[name] = torch.zeros((capacity, MAX_SPECULATE) + tuple(view.shape), dtype=view.dtype,
                                                 device=view.device)
        self._sets: dict[int, int] = {}  # slot -> its set, for the step that verifies it

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    def assign(self, slots: list[int]) -> None:
        """The slots of this step's speculating sessions (at most capacity), each given a set."""
        if len(slots) > self.capacity:
            raise ValueError(f"{len(slots)} speculating slots in one step, room for {self.capacity}")
        self._sets = {slot: i for i, slot in enumerate(slots)}

    def keep(self, slot: int, position: int) -> None:
        """The slot's state after its `position`-th verified token (0-based) is kept."""
        i = self._sets[slot]
        for name in self.names:
            self.buffers[name][i, position].copy_(self.state.slot_view(name, slot))

    def restore(self, slot: int, position: int) -> None:
        """The slot's state goes back to what `keep(slot, position)` kept in this step."""
        i = self._sets[slot]
        for name in self.names:
            self.state.slot_view(name, slot).copy_(self.buffers[name][i, position])
