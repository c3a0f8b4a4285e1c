"""Copies of capsule tensors between the device and host memory.

On CUDA a copy runs on the store's copy stream (or the current one) and records an event; readers make
their stream wait on it, so decode on the default stream is not blocked by a tier move. The copies within
one device (a snapshot of a slot's strided rows into fresh blocks) go in one grouped launch
(kernels/triton_copy.py), not one per block.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from capsulert.kernels.triton_copy import copy_pairs

Run = tuple[torch.Tensor, int, Sequence[str]]  # (src, dim, names): see copy_tensors


def copy_tensors(tensors: Mapping[str, torch.Tensor], device: torch.device, *, pin: bool, stream: Any,
                 wait: Any = None, runs: Sequence[Run] = ()) -> tuple[dict[str, torch.Tensor], Any]:
    """Fresh copies of `tensors` on `device` (pinned host memory when `pin`), and the CUDA event that marks
    the copy done (None when it ran synchronously). `stream`: the CUDA stream to copy on (None: current);
    `wait`: a CUDA event (or a list of them) the sources are complete after. `runs`: (src, dim, names) where
    tensors[names] are, in order, the consecutive pieces of `src` along `dim` that make all of it (a capsule
    tensor cut into blocks); each piece is still copied into a tensor of its own, but a contiguous `src` on
    the copies' device is copied in one op (on CUDA one kernel) instead of one copy per piece."""
    dst = {k: torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin) for k, t in tensors.items()}
    srcs = list(tensors.values())
    if not srcs:
        return dst, None
    if not torch.cuda.is_available() or not (device.type == "cuda" or any(t.is_cuda for t in srcs)):
        _copy_into(dst, tensors, runs, non_blocking=False)
        return dst, None
    cuda_dev = device if device.type == "cuda" else next(t.device for t in srcs if t.is_cuda)
    cur = torch.cuda.current_stream(cuda_dev)
    stream = stream if stream is not None else cur
    if stream is not cur:
        stream.wait_stream(cur)  # sources / fresh allocations are ordered on the current stream
    for ev in wait if isinstance(wait, (list, tuple)) else (wait,):
        if ev is not None:
            stream.wait_event(ev)
    with torch.cuda.stream(stream):
        _copy_into(dst, tensors, runs, non_blocking=True)
    if stream is not cur:
        for t in srcs + list(dst.values()):
            if t.is_cuda:
                t.record_stream(stream)  # the allocator must not reuse them before the copy ends
    ev = torch.cuda.Event()
    ev.record(stream)
    return dst, ev


def _copy_into(dst: dict[str, torch.Tensor], tensors: Mapping[str, torch.Tensor], runs: Sequence[Run], *,
               non_blocking: bool) -> None:
    rest = dict(tensors)
    with torch.no_grad():  # a copy, never part of a graph (and no detach per tensor)
        for src, dim, names in runs:
            out = [dst[n] for n in names]
            # contiguous only: what the CUDA kernel of split_with_sizes_copy assumes (others gain nothing)
            if src.is_contiguous() and all(o.device == src.device for o in out):
                torch.split_with_sizes_copy(src, [o.shape[dim] for o in out], dim, out=out)
                for n in names:
                    del rest[n]
        pairs = [(dst[k], t) for k, t in rest.items()]
        if pairs and all(d.device == s.device for d, s in pairs):  # one launch on CUDA (a slot's strided rows)
            copy_pairs(pairs)
        else:
            for d, s in pairs:
                d.copy_(s, non_blocking=non_blocking)
