"""Copies of capsule tensors between the device and host memory.

On CUDA a copy runs on the store's copy stream (or the current one) and records an event; readers make
their stream wait on it, so decode on the default stream is not blocked by a tier move.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch


def copy_tensors(tensors: Mapping[str, torch.Tensor], device: torch.device, *, pin: bool, stream: Any,
                 wait: Any = None) -> tuple[dict[str, torch.Tensor], Any]:
    """Fresh copies of `tensors` on `device` (pinned host memory when `pin`), and the CUDA event that marks
    the copy done (None when it ran synchronously). `stream`: the CUDA stream to copy on (None: current);
    `wait`: a CUDA event (or a list of them) the sources are complete after."""
    dst = {k: torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin) for k, t in tensors.items()}
    srcs, dsts = [t.detach() for t in tensors.values()], list(dst.values())
    if not srcs:
        return dst, None
    if not torch.cuda.is_available() or not (device.type == "cuda" or any(t.is_cuda for t in srcs)):
        torch._foreach_copy_(dsts, srcs)
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
        if all(d.device == s.device for d, s in zip(dsts, srcs)):
            torch._foreach_copy_(dsts, srcs, non_blocking=True)  # one fused launch on device
        else:
            for d, s in zip(dsts, srcs):
                d.copy_(s, non_blocking=True)
    if stream is not cur:
        for t in srcs + dsts:
            if t.is_cuda:
                t.record_stream(stream)  # the allocator must not reuse them before the copy ends
    ev = torch.cuda.Event()
    ev.record(stream)
    return dst, ev
