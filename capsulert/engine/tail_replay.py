"""Exact replay of a slot's tail in the linear-attention layers of a prefill piece.

A slot whose last grid point G lies before its length P keeps, per linear-attention layer, the conv inputs
and the raw gate projections of the prefilled tokens [G, P) (state.tail_in / tail_gates, engine/state.py).
An append then runs only its new tokens through the model; each linear-attention layer prepends the tail's
rows to the new rows' and runs the conv and the chunked rule from the state at G over both, as a re-run of
[G, P) would, and keeps the new rows' outputs. Exact because a token's conv inputs and gate projections are
the same whatever piece computed them (split-invariant prefill), and the conv and chunk math then see the
very tensors a re-run gives them.

`replay` (rows of the tail to prepend) and `tail_from` (where, in the layer's piece, the rows to keep as the
new tail start) are ints on an eager pass and [B] device tensors in a captured graph, which gathers with
indices clamped to the piece: rows past the real ones are padding the `valid` counts leave out. Those gathers
move whole rows (one index a row, `gather_rows`): an index per element moved four times the bytes of the bf16
rows themselves (a 9B crowd's forward of 32 turns at 3,500 tokens: 62 ms with those on one H100, 58 ms without
on another; bench/RESULTS.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from capsulert.kernels.gated_delta import GATED_DELTA_CHUNK

Index = int | torch.Tensor


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, L, ...], idx [B, J] -> [B, J, ...]: row idx[b, j] of x[b], whole rows at a time."""
    B, L = x.shape[:2]
    flat = (idx + torch.arange(B, device=x.device)[:, None] * L).reshape(-1)
    return x.reshape(B * L, *x.shape[2:]).index_select(0, flat).view(B, idx.shape[1], *x.shape[2:])


def with_tail(tail: torch.Tensor, new: torch.Tensor, replay: Index) -> torch.Tensor:
    """tail [B, TAIL, C] (a slot's buffer rows), new [B, T, C] -> the first replay[b] tail rows followed by
    the new rows: [B, rows, C], rows a whole number of grid chunks on an eager pass (the padding the chunked
    rule adds anyway), TAIL + T in a graph."""
    B, T, C = new.shape
    if isinstance(replay, int):
        rows = -(-(replay + T) // GATED_DELTA_CHUNK) * GATED_DELTA_CHUNK
        return F.pad(torch.cat([tail[:, :replay], new], dim=1), (0, 0, 0, rows - replay - T))
    held = tail.shape[1]
    j = torch.arange(held + T, device=new.device)[None, :]
    src = torch.where(j < replay[:, None], j, held + j - replay[:, None]).clamp(max=held + T - 1)
    return gather_rows(torch.cat([tail, new], dim=1), src)


def new_rows(o: torch.Tensor, replay: Index, T: int) -> torch.Tensor:
    """The rows of the T new tokens of a layer's output o [B, rows, ...] that with_tail made."""
    if isinstance(replay, int):
        return o[:, replay:replay + T]
    return gather_rows(o, replay[:, None] + torch.arange(T, device=o.device)[None, :])


def keep_tail(buf: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, tail_from: Index) -> None:
    """buf [slots, TAIL, C] <- rows [B, L, C] from tail_from on (TAIL of them, fewer at the end of rows; the
    rest is never read: the session's length says how many rows its tail holds)."""
    held = buf.shape[1]
    L = rows.shape[1]
    start = torch.as_tensor(tail_from, device=rows.device).reshape(-1, 1)
    idx = (start + torch.arange(held, device=rows.device)[None, :]).clamp(max=L - 1)
    buf.index_copy_(0, slots, gather_rows(rows, idx.expand(rows.shape[0], held)))
