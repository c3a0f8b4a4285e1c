"""A capsule packed for a worker-to-worker transfer: its tensors in one contiguous uint8 buffer on the
engine device (one send, one receive), the specs that turn the buffer back into views, and a digest both
ends compute where the bytes live.

The digest is exact integer arithmetic (sums of the buffer's 64-bit words, plain and position-weighted, mod
2**64): integer sums do not depend on the order of the reduction, so the sender's GPU, the receiver's GPU
and a CPU all compute the same value, and no byte has to be copied to the host for a sha256 (which would
cost more than the transfer). It is not cryptographic: it guards the transfer against bytes that changed
or went missing, as the sha256 of an object-store export does; capsule files keep their sha256.
"""
from __future__ import annotations

import torch

from capsulert.errors import CorruptCapsuleError

ALIGN = 256  # every tensor of a packed buffer starts at a multiple of this (typed views need alignment)


def pack_tensors(tensors: dict[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, list]:
    """The tensors copied into one contiguous uint8 buffer on `device`, in sorted-name order, and their specs
    [name, dtype, shape, offset] (tensor_views turns them back into tensors)."""
    specs, size = [], 0
    for name in sorted(tensors):
        t = tensors[name]
        specs.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), size])
        size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    for view, (name, *_) in zip(tensor_views(buf, specs).values(), specs):
        view.copy_(tensors[name])
    return buf, specs


def tensor_views(buf: torch.Tensor, specs: list) -> dict[str, torch.Tensor]:
    """The tensors a packed buffer holds, as views of it (no copy)."""
    out = {}
    try:
        for name, dtype, shape, offset in specs:
            dt = getattr(torch, dtype)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"no dtype {dtype!r}")
            n = dt.itemsize
            for d in shape:
                n *= d
            if offset % ALIGN or offset + n > buf.numel():
                raise ValueError(f"{name}: {n} bytes at offset {offset} do not fit a {buf.numel()} byte buffer")
            out[name] = buf[offset:offset + n].view(dt).view(shape)
    except (AttributeError, TypeError, ValueError, RuntimeError) as e:
        raise CorruptCapsuleError(f"a packed capsule's tensor specs do not match its buffer: {e}") from None
    return out


_DIGEST_WORDS = 1 << 23  # 64 MiB of words per pass: the weights and one product stay small


def buffer_digest(buf: torch.Tensor) -> str:
    """32 hex digits over a packed buffer (its size a multiple of ALIGN), computed on its device."""
    words = buf.view(torch.int64)
    n = words.numel()
    weights = torch.arange(1, min(n, _DIGEST_WORDS) + 1, dtype=torch.int64, device=buf.device)
    parts = []
    for a in range(0, n, _DIGEST_WORDS):
        part = words[a:a + _DIGEST_WORDS]
        parts.append(torch.stack([part.sum(), (part * weights[:part.numel()]).sum()]))
    total = weighted = 0
    for a, (s, ws) in zip(range(0, n, _DIGEST_WORDS), torch.stack(parts).tolist() if parts else []):
        total, weighted = total + s, weighted + ws + a * s  # word a + k has weight a + k + 1
    m = 1 << 64
    return f"{n:x}:{total % m:016x}{weighted % m:016x}"
