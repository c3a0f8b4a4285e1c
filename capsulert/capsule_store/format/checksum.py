"""The checksum every capsule file, block file and export carries: sha256 over (name, dtype, shape, raw
bytes) of each tensor, in sorted-name order."""
from __future__ import annotations

import hashlib
from typing import Mapping

import torch


def tensors_checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 hex over (name, dtype, shape, raw bytes) of every tensor, in sorted-name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        head = f"{name}\x00{t.dtype}\x00{tuple(t.shape)}\x00{t.numel() * t.element_size()}\x00"
        h.update(head.encode("utf-8"))
        if t.numel():
            flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            h.update(flat.numpy().data)
    return h.hexdigest()
