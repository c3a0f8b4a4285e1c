"""A capsule as host bytes for another worker (ExportCapsule / ImportCapsule through the object store):
its metadata as JSON (meta.py) with the checksum filled, the checksum of its tensors (checksum.py),
and its tensors as one safetensors blob (never pickle). The importer checks the checksum against the bytes
it received, so a capsule changed in transit is refused, never stored.
"""
from __future__ import annotations

from typing import Mapping

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from capsulert.capsule_store.capsule import CapsuleMeta
from capsulert.capsule_store.format.checksum import tensors_checksum
from capsulert.capsule_store.format.meta import meta_from_json, meta_to_json
from capsulert.errors import CorruptCapsuleError


def encode_export(meta: CapsuleMeta, cpu: Mapping[str, torch.Tensor]) -> tuple[str, str, bytes]:
    """(meta JSON with its checksum filled, the checksum, the safetensors blob) of a capsule whose tensors
    are `cpu` (contiguous host tensors with their own storage)."""
    checksum = tensors_checksum(cpu)
    return meta_to_json(meta.replace(checksum=checksum)), checksum, st_save(dict(cpu))


def decode_export_meta(meta_json: str) -> CapsuleMeta:
    """The metadata of an export (CorruptCapsuleError when it is not valid), read before its bytes."""
    return meta_from_json(meta_json)


def decode_export_tensors(meta: CapsuleMeta, checksum: str, blob: bytes) -> tuple[CapsuleMeta, dict[str, torch.Tensor]]:
    """The tensors of an export, verified against its checksum, and `meta` with that checksum filled;
    CorruptCapsuleError when the blob is not a safetensors blob or its bytes changed in transit."""
    try:
        tensors = st_load(bytes(blob))
    except Exception as e:  # safetensors raises its own error types for a truncated or malformed blob
        raise CorruptCapsuleError(f"capsule {meta.name!r}: its bytes are not a safetensors blob "
                                  f"({type(e).__name__}: {e})") from None
    if tensors_checksum(tensors) != checksum:
        raise CorruptCapsuleError(f"capsule {meta.name!r} changed in transit (checksum mismatch)")
    return meta.replace(checksum=checksum), tensors
