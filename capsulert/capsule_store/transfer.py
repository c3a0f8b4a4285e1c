"""Copies of capsule tensors within the device and between the device and host memory.

On CUDA a copy runs on the store's copy stream (or the current one) and records an event; readers make
their stream wait on it, so decode on the default stream is not blocked by a tier move. The copies within
one device (a snapshot of a slot's strided rows into fresh blocks) go in one grouped launch
(kernels/triton_copy.py), not one per block.

Destinations are allocated before the copy: one tensor per own tensor, and the KV blocks of a capsule in
*slabs*: one tensor of [n, *block shape] per block tensor for up to SLAB_BLOCKS consecutive blocks, each
block a row of it (`slabs_for`). A 16k-token capsule's 256 blocks were 512 allocations (and, with the
allocator's cache cold, as many trips to cudaMalloc): the snapshot's main host cost. A slab's memory goes
back when its last block does; blocks of one slab are consecutive blocks of one token chain, and a capsule
that references a block references every block before it, so what a slab keeps beyond the live blocks is
at most the tail of one chain (fewer than SLAB_BLOCKS blocks).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from capsulert.capsule_store.capsule import TensorSpec
from capsulert.kernels.triton_copy import Pair, copy_pairs

# KV blocks per allocation (2,048 tokens on the 64-token grid). Half as many made a 16k snapshot's host time 1.24x
# on the CPU (more allocations, copy pairs and block views); the cost is the dead tail a slab may keep
SLAB_BLOCKS = 32


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device=device, pin_memory=pin)


def slabs_for(specs: Mapping[str, TensorSpec], count: int, device: torch.device, *, pin: bool) -> dict[str, torch.Tensor]:
    """`count` blocks of these tensors in one allocation per tensor: the slabs, [count, *shape] each (block i
    is row i of every slab; its views are made where asked for: blocks.SlabRow)."""
    return {n: empty((count, *s.shape), s.dtype, device, pin) for n, s in specs.items()}


def blocked(whole: torch.Tensor, dim: int, count: int, rows: int) -> torch.Tensor:
    """The first `count` blocks of `whole` (cut every `rows` along `dim`) as one view, [count, *block shape]:
    a slab's source is its rows of it, one copy pair for the slab instead of one per block (and one view per
    slab: a 16k snapshot's 16 slabs of 4 tensors made 192 views where this makes 64 and 12)."""
    return whole.narrow(dim, 0, count * rows).unflatten(dim, (count, rows)).movedim(dim, 0)


def copy_into(pairs: Sequence[Pair], *, stream: Any = None, wait: Any = None) -> Any:
    """Copy each (dst, src) pair (dsts allocated by the caller, none overlapping), and return the CUDA event
    that marks the copies done (None when they ran synchronously). `stream`: the CUDA stream to copy on
    (None: the current one); `wait`: a CUDA event (or a list of them) the sources are complete after."""
    if not pairs:
        return None
    cuda = [t.device for p in pairs for t in p if t.is_cuda]
    if not cuda:
        _copy(pairs, non_blocking=False)
        return None
    cur = torch.cuda.current_stream(cuda[0])
    stream = stream if stream is not None else cur
    if stream is not cur:
        stream.wait_stream(cur)  # sources / fresh allocations are ordered on the current stream
    for ev in wait if isinstance(wait, (list, tuple)) else (wait,):
        if ev is not None:
            stream.wait_event(ev)
    with torch.cuda.stream(stream):
        _copy(pairs, non_blocking=True)
    if stream is not cur:
        for p in pairs:
            for t in p:
                if t.is_cuda:
                    t.record_stream(stream)  # the allocator must not reuse them before the copy ends
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def copy_tensors(tensors: Mapping[str, torch.Tensor], device: torch.device, *, pin: bool, stream: Any,
                 wait: Any = None) -> tuple[dict[str, torch.Tensor], Any]:
    """Fresh copies of `tensors` on `device` (pinned host memory when `pin`), and the CUDA event that marks
    the copy done (None when it ran synchronously); `stream` and `wait` as for copy_into."""
    dst = {k: empty(t.shape, t.dtype, device, pin) for k, t in tensors.items()}
    return dst, copy_into([(dst[k], t) for k, t in tensors.items()], stream=stream, wait=wait)


def _copy(pairs: Sequence[Pair], *, non_blocking: bool) -> None:
    with torch.no_grad():  # a copy, never part of a graph (and no detach per tensor)
        if all(d.device == s.device for d, s in pairs):  # one launch on CUDA (a slot's strided rows)
            copy_pairs(pairs)
            return
        for d, s in pairs:
            d.copy_(s, non_blocking=non_blocking)
