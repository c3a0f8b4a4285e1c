"""The bytes of one slot that make up a capsule or a prefix checkpoint: views into the state set, no copies.

A capsule of a session of length P holds the rows [0, P) of the per-token buffers (the KV, and an MTP head's
KV: StateLayout.block_tensors), the live recurrent and conv state at P, the last hidden state at P and, off
the grid (P != G = floor(P / grid) * grid), the grid checkpoint (StateLayout.grid_state: with an MTP head the
hidden state before G too); a grid view holds the rows [0, G) and the state at G. capsules.py and
prefix_reuse.py read and write slots through these.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from capsulert.capsule_store.blocks import Parts
from capsulert.capsule_store.capsule import CapsuleMeta
from capsulert.engine.state import StateSet
from capsulert.kernels.triton_copy import Pair, Strided

def row_views(st: StateSet, slot: int, length: int) -> dict[str, torch.Tensor]:
    """The slot's rows [0, length) of every per-token buffer ([layers, length, heads, head_dim]: token rows
    along dim 1, cut into prefix blocks)."""
    return {name: st.buffers[name][:, slot, :length] for name in st.layout.block_tensors}


def rows_not_made(st: StateSet, slot: int, length: int) -> dict[str, Strided]:
    """row_views as views not made yet (Strided): a restore copies into them (copy_pairs) and a crowd's restore
    would otherwise make them for every capsule."""
    out = {}
    for name in st.layout.block_tensors:
        size, stride, at = _slot_geometry(st, name, slot)
        out[name] = Strided(st.buffers[name], (size[0], length, *size[2:]), stride, at)
    return out


def _slot_geometry(st: StateSet, name: str, slot: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Shape, strides and storage offset of the slot's view of buffer `name` ([layers, max_seq, ...]), read from
    the view the state set made at start."""
    view = st.slot_view(name, slot)
    return tuple(view.shape), view.stride(), view.storage_offset()


def capsule_views(st: StateSet, slot: int, length: int, grid_pos: int) -> dict[str, torch.Tensor]:
    """The slot's bytes that make up a capsule of `length` tokens."""
    return {**row_views(st, slot, length), **state_views(st, slot, length != grid_pos)}


def tail_views(st: StateSet, slot: int, rows: int) -> dict[str, torch.Tensor]:
    """The slot's exact-replay rows of the first `rows` tokens past its grid point (engine/tail_replay.py),
    none for rows = 0."""
    if not rows:
        return {}
    return {"tail_in": st.slot_view("tail_in", slot)[:, :rows], "tail_gates": st.slot_view("tail_gates", slot)[:, :rows]}


def state_views(st: StateSet, slot: int, off_grid: bool) -> dict[str, torch.Tensor]:
    """`capsule_views` but the KV rows: the live state, the last hidden state and, off the grid (where the
    live state and the grid checkpoint differ), the grid checkpoint."""
    views = {name: st.slot_view(name, slot) for name in ("ssm", "conv", "last_hidden")}
    if off_grid:
        views.update({off: st.slot_view(off, slot) for _, off in st.layout.grid_state})
    return views


def grid_views(st: StateSet, slot: int, grid_pos: int) -> dict[str, torch.Tensor]:
    """The slot's per-token rows [0, grid_pos) and its state at its last grid point."""
    return {**row_views(st, slot, grid_pos), **grid_state_views(st, slot)}


def grid_state_views(st: StateSet, slot: int) -> dict[str, torch.Tensor]:
    """The slot's grid checkpoint, by the names an on-grid capsule gives it (ssm, conv, last_hidden)."""
    return {on: st.slot_view(off, slot) for on, off in st.layout.grid_state}


def set_positions(st: StateSet, slots: Sequence[int], positions: Sequence[int]) -> None:
    """pos[slots[i]] = positions[i], in one stream-ordered copy (no host wait) however many slots."""
    if len(slots) == 1:
        st.pos[slots[0]] = positions[0]
        return
    pin = st.pos.is_cuda
    index = torch.tensor(list(slots), dtype=torch.long, pin_memory=pin).to(st.pos.device, non_blocking=True)
    values = torch.tensor(list(positions), dtype=st.pos.dtype, pin_memory=pin).to(st.pos.device, non_blocking=True)
    st.pos.index_copy_(0, index, values)


def live_state_views(st: StateSet, slot: int) -> dict[str, torch.Tensor]:
    """The slot's live buffers of the grid checkpoint's names: at a grid point they hold the same state."""
    return {on: st.slot_view(on, slot) for on, _ in st.layout.grid_state}


def stored_grid_state(st: StateSet, meta: CapsuleMeta, own: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A stored checkpoint's state at its grid point by on-grid name (the live state of one held on the
    grid, the grid checkpoint of one held past it)."""
    on_grid = meta.held == meta.held_grid
    return {on: own[on if on_grid else off] for on, off in st.layout.grid_state}


def kv_pairs(st: StateSet, slot: int, grid: int, parts: Parts, first: int, end: int | None) -> list[Pair]:
    """(slot rows, piece) of the KV tensors for blocks first.. of a capsule's parts and, when `end` is
    given, its own rows past its blocks up to `end`. The slot's rows are cut by one split per tensor, not
    one indexing per block (the views were most of a restore's host time)."""
    if parts.runs is not None:  # blocks in slab runs: one pair per run and tensor
        return _run_pairs(st, slot, grid, parts, first, end)
    n = len(parts.blocks)
    sizes = [grid] * (n - first) + ([end - n * grid] if end is not None else [])
    pairs: list[Pair] = []
    for k in st.layout.block_tensors:
        rows = st.buffers[k][:, slot].narrow(1, first * grid, sum(sizes)).split_with_sizes(sizes, 1)
        pieces = [b[k] for b in parts.blocks[first:]] + ([parts.own[k]] if end is not None else [])
        pairs += zip(rows, pieces)
    return pairs


def _run_pairs(st: StateSet, slot: int, grid: int, parts: Parts, first: int, end: int | None) -> list[Pair]:
    """kv_pairs over the parts' slab runs: the slot's rows of each run, viewed [count, layers, grid, ...] like
    the run's slab rows, against those rows (a 2k capsule's 32 blocks in one slab: 4 pairs instead of 128).
    Both sides are views not made yet (Strided): on the GPU the copy plan reads their addresses alone."""
    n, pairs = len(parts.blocks), []
    for k in st.layout.block_tensors:
        full = st.buffers[k]  # the base of the slot's rows: one per buffer however many slots a restore writes
        size, stride, at = _slot_geometry(st, k, slot)
        for run in parts.runs:  # type: ignore[union-attr]
            lo, hi = max(run.first, first), run.first + run.count
            if lo < hi:  # the slot's rows [lo * grid, hi * grid) as [hi - lo, layers, grid, ...]
                rows = Strided(full, (hi - lo, size[0], grid, *size[2:]), (grid * stride[1], *stride),
                               at + lo * grid * stride[1])
                pairs.append((rows, run.rows(k, lo - run.first)))
        if end is not None:
            pairs.append((Strided(full, (size[0], end - n * grid, *size[2:]), stride, at + n * grid * stride[1]),
                          parts.own[k]))
    return pairs
