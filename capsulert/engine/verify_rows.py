"""The rows of a speculative verify forward (HybridModel.verify): every fed position of every slot as one row.

A slot fed n tokens (its sampled token and n - 1 drafts) gets n rows, slot after slot; row t of a slot is the
decode row of its slot at position pos + t. Dense ops run on all rows at once (batch invariance makes each
row decode's); the ops on per-slot state run wave by wave (wave t: the t-th row of every slot fed more than t
tokens), so each slot's conv and recurrent state advance token by token as decode advances them.

`fixed_grid` lays b slots out on a fixed (b, width) grid, the shape a captured CUDA graph replays: a slot fed
fewer than `width` tokens has its missing rows in the scratch slot (their state is garbage nobody reads), and
every row of the first width - 1 waves keeps its slot's state in its rollback set (the scratch set for a slot
without one), so the graph never depends on who speculates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class VerifyRows:
    tokens: torch.Tensor  # [R] the fed token of each row
    row_slots: torch.Tensor  # [R] its slot
    offsets: torch.Tensor  # [R] its index t among its slot's fed tokens: it sits at pos + t
    prev_rows: torch.Tensor  # [R] the row before it of the same slot (itself for t = 0): the MTP head's seed
    waves: tuple[torch.Tensor, ...]  # wave t: the rows at offset t
    # per wave: (rows, rollback sets) whose slot's state after that wave is kept, or None
    keeps: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]
    slots: torch.Tensor  # [B] the slots fed
    last_rows: torch.Tensor  # [B] each slot's last row: its new last_hidden
    counts: torch.Tensor  # [B] int32: how far each slot's position advances

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]


def verify_rows(slots: list[int], fed: list[list[int]], set_of: Callable[[int], int | None],
                device: torch.device) -> VerifyRows:
    """The rows of slots[i] fed fed[i], exactly (no padding); `set_of(slot)`: its rollback set, None for a
    slot fed one token."""
    tokens, row_slots, offsets, prev, last, row_fed = [], [], [], [], [], []
    for slot, f in zip(slots, fed):
        first = len(tokens)
        for t, token in enumerate(f):
            tokens.append(token)
            row_slots.append(slot)
            offsets.append(t)
            prev.append(first + t - 1 if t else first)
            row_fed.append(len(f))
        last.append(len(tokens) - 1)
    waves, keeps = [], []
    for t in range(max(len(f) for f in fed)):
        wave = [r for r, o in enumerate(offsets) if o == t]
        waves.append(wave)
        kept = [r for r in wave if t + 1 < row_fed[r]]
        keeps.append(None if not kept else (kept, [set_of(row_slots[r]) for r in kept]))
    return _on(device, tokens, row_slots, offsets, prev, waves, keeps, slots, last, [len(f) for f in fed])


def fixed_grid(slots: list[int], fed: list[list[int]], batch: int, width: int, scratch_slot: int,
               set_of: Callable[[int], int | None], scratch_set: int, device: torch.device) -> VerifyRows:
    """The rows of `verify_rows` on a (batch, width) grid: slot i's row t at i * width + t; the slots past
    len(slots) and the rows past a slot's fed tokens run in the scratch slot."""
    tokens, row_slots, offsets, prev = [], [], [], []
    sets = []
    for i in range(batch):
        f = fed[i] if i < len(slots) else []
        s = set_of(slots[i]) if i < len(slots) else None
        for t in range(width):
            tokens.append(f[t] if t < len(f) else 0)
            row_slots.append(slots[i] if t < len(f) else scratch_slot)
            offsets.append(t)
            prev.append(i * width + max(t - 1, 0))
            sets.append(scratch_set if s is None or t >= len(f) else s)
    waves = [[i * width + t for i in range(batch)] for t in range(width)]
    keeps = [(w, [sets[r] for r in w]) for w in waves[:-1]] + [None]
    real = slots + [scratch_slot] * (batch - len(slots))
    last = [i * width + (len(fed[i]) if i < len(slots) else 1) - 1 for i in range(batch)]
    counts = [len(fed[i]) if i < len(slots) else 0 for i in range(batch)]
    return _on(device, tokens, row_slots, offsets, prev, waves, keeps, real, last, counts)


def step_inputs(rows: VerifyRows) -> list[torch.Tensor]:
    """The tensors of a `fixed_grid` that differ between steps of one (batch, width) shape, in a fixed order:
    what a graph's replay copies into its static rows. The rest (offsets, prev_rows, waves and the rows of
    each keep) follow from the shape alone."""
    return [rows.tokens, rows.row_slots, rows.slots, rows.last_rows, rows.counts,
            *(k[1] for k in rows.keeps if k is not None)]


def _on(device, tokens, row_slots, offsets, prev, waves, keeps, slots, last, counts) -> VerifyRows:
    def t(x, dtype=torch.long):
        return torch.tensor(x, dtype=dtype, device=device)
    return VerifyRows(t(tokens), t(row_slots), t(offsets), t(prev), tuple(t(w) for w in waves),
                      tuple(None if k is None else (t(k[0]), t(k[1])) for k in keeps), t(slots), t(last),
                      t(counts, torch.int32))
