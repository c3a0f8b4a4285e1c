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

The one-forward verify (HybridModel.verify) keeps inside the forward: each linear-attention layer's conv and
recurrent state of a slot after each wave but its last (keep_layer), and the position and hidden state its
rows leave (keep_rows), so no whole-state copy follows a pass. The per-position path (ModelRunner's stepwise
verify, the reference) keeps whole slots after each decode step (keep).

Owned by the runner, allocated once at start: `capacity` sets (EngineConfig.speculate_slots) of
MAX_SPECULATE copies each, and one scratch set (`scratch`) that a captured verify graph writes the rows of
non-speculating slots to. A step speculates for at most `capacity` sessions; the others decode plainly that
step (exact either way).
"""
from __future__ import annotations

import torch

from capsulert.engine.state import StateSet
from capsulert.protocol.sampling import MAX_SPECULATE

# what a verify forward keeps: the linear-attention layers' state, by layer, and the state a slot's rows leave
LAYER_BUFFERS = ("ssm", "conv")
ROW_BUFFERS = ("pos", "last_hidden")


class RollbackStates:
    def __init__(self, state: StateSet, capacity: int):
        self.state = state
        self.capacity = capacity
        self.names = state.layout.rollback_names()
        self.buffers: dict[str, torch.Tensor] = {}
        if capacity:
            for name in self.names:
                view = state.slot_view(name, 0)
                self.buffers[name] = torch.zeros((capacity + 1, MAX_SPECULATE) + tuple(view.shape), dtype=view.dtype,
                                                 device=view.device)
        self._sets: dict[int, int] = {}  # slot -> its set, for the step that verifies it

    @property
    def scratch(self) -> int:
        """The set that rows of slots without one keep to (nothing restores from it)."""
        return self.capacity

    @property
    def keeps_in_forward(self) -> bool:
        """A verify forward keeps every buffer this layout rolls back (the per-position path serves one that
        adds another)."""
        return set(self.names) == set(LAYER_BUFFERS + ROW_BUFFERS)

    def set_of(self, slot: int) -> int | None:
        """The set of an `assign`ed slot, else None."""
        return self._sets.get(slot)

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

    def keep_layer(self, layer: int, position: int, sets: torch.Tensor, slots: torch.Tensor) -> None:
        """Linear-attention layer `layer`'s conv and recurrent state of `slots` after their `position`-th token
        go to their `sets` (device tensors: a captured graph replays this)."""
        for name in LAYER_BUFFERS:
            self.buffers[name][:, position, layer].index_copy_(0, sets, self.state.buffers[name][layer, slots])

    def keep_rows(self, position: int, sets: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor) -> None:
        """The hidden state [n, H] and position [n] that the rows at `position` leave their slots, into `sets`."""
        self.buffers["last_hidden"][:, position].index_copy_(0, sets, hidden)
        self.buffers["pos"][:, position].index_copy_(0, sets, pos.to(torch.int32))

    def restore(self, slot: int, position: int) -> None:
        """The slot's state goes back to what `keep(slot, position)` kept in this step."""
        i = self._sets[slot]
        for name in self.names:
            self.state.slot_view(name, slot).copy_(self.buffers[name][i, position])
