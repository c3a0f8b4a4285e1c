"""The on-disk format: one safetensors file per capsule, metadata in the header, never pickle.

File `<sha256(namespace NUL name)[:40]>` + names.FILE_SUFFIX; header `__metadata__` =
{"capsulert.format": "1", "capsulert.meta": CapsuleMeta JSON with `checksum` filled}. The checksum is
sha256 over (name, dtype, shape, raw bytes) of the tensors in sorted-name order
(checksum.py). Writes are crash-safe (staging.py: temp file, fsync, rename, fsync dir). Reads check
everything before trusting anything, and every refusal is a typed error, never a raw exception.

Format "2" is a capsule cut into prefix blocks (capsule_store/blocks.py): the file holds its own tensors (state, KV
tail) and `capsulert.blocks`, the BlockRefs JSON naming its blocks; each block is a file of its own in
the same directory (blockfiles.py). Format "3" also names its grid-state block (the recurrent and conv
state at its grid point, a block file too; its file then holds only the state computed past the grid
point). `meta.nbytes` stays the whole capsule's bytes; the checksum covers the tensors of the file. A
format 1 file may record `capsulert.origin`, the numerics that computed its bytes (export_file writes it
for a canonical capsule): a store of that origin loading it cuts it into blocks; without it it stays whole.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open

from capsulert.capsule_store.blocks import BlockRefs, Parts
from capsulert.capsule_store.capsule import CapsuleMeta, model_of, tensor_nbytes
from capsulert.capsule_store.format.block_refs import refs_to_json
from capsulert.capsule_store.format.blockfiles import read_block
from capsulert.capsule_store.format.checksum import tensors_checksum
from capsulert.capsule_store.format.headers import (  # noqa: F401  (read_header & co. are this module's API too)
    BLOCKED_FORMAT, FORMAT_VERSION, MAX_HEADER_BYTES, ORIGIN_KEY, STATE_FORMAT, _corrupt, parse_file, read_header,
    read_header_origin, read_header_refs)
from capsulert.capsule_store.format.listing import list_capsule_files, scan_capsule_files  # noqa: F401  (API too)
from capsulert.capsule_store.format.meta import meta_to_json
from capsulert.capsule_store.format.names import FILE_SUFFIX, capsule_file  # noqa: F401  (FILE_SUFFIX: API too)
from capsulert.capsule_store.format.staging import (  # noqa: F401  (fsync_dir, StagedWrite: this module's API too)
    StagedWrite, fsync_dir, stage_file, to_cpu_owned)
from capsulert.errors import CorruptCapsuleError, IncompatibleCapsuleError

log = logging.getLogger(__name__)


def stage_capsule(directory: str | Path, meta: CapsuleMeta, tensors: Mapping[str, torch.Tensor],
                  refs: BlockRefs | None = None, origin: str | None = None) -> StagedWrite:
    """Write one capsule file under a temp name and fsync it; CapsuleIOError (nothing left) on failure.
    With `refs` the tensors are the capsule's own ones and the file references those blocks (format 2, or 3
    with a grid-state block). `origin` (whole capsules): recorded, for a store of that origin to share its
    blocks when it loads the file."""
    cpu = {k: to_cpu_owned(v) for k, v in tensors.items()}
    nbytes = tensor_nbytes(cpu) + (refs.nbytes if refs is not None else 0)
    if nbytes != meta.nbytes:
        raise ValueError(f"capsule {meta.name!r}: meta.nbytes={meta.nbytes} but tensors hold {nbytes} bytes")
    meta = meta.replace(checksum=tensors_checksum(cpu))
    if refs is not None:
        extra = {"capsulert.format": STATE_FORMAT if refs.state is not None else BLOCKED_FORMAT,
                 "capsulert.blocks": refs_to_json(refs)}
    else:
        extra = {ORIGIN_KEY: origin} if origin else {}
    final = capsule_file(directory, meta.namespace, meta.name)
    tmp = stage_file(final, cpu, {"capsulert.format": FORMAT_VERSION, "capsulert.meta": meta_to_json(meta), **extra})
    return StagedWrite(tmp, final, meta)


def write_capsule_with_meta(directory: str | Path, meta: CapsuleMeta, tensors: Mapping[str, torch.Tensor],
                            refs: BlockRefs | None = None, origin: str | None = None) -> tuple[Path, CapsuleMeta]:
    """Write one capsule file crash-safely (temp file, fsync, rename, fsync dir); return its path and
    the meta with `checksum` filled. With `refs`: the capsule's own tensors, referencing those blocks
    (whose files must be in `directory` already). `origin`: see stage_capsule."""
    staged = stage_capsule(directory, meta, tensors, refs, origin)
    staged.commit()
    fsync_dir(staged.final.parent)
    return staged.final, staged.meta  # type: ignore[return-value]


def write_capsule(directory: str | Path, meta: CapsuleMeta, tensors: Mapping[str, torch.Tensor]) -> Path:
    """Write one capsule file crash-safely into `directory`; return its path."""
    return write_capsule_with_meta(directory, meta, tensors)[0]


def read_capsule(path: str | Path, expected_fingerprint: str, expected_layout: int,
                 max_bytes: int | None = None) -> tuple[CapsuleMeta, dict[str, torch.Tensor]]:
    """Read and fully verify one capsule file; tensors come back on CPU.

    Refusals: CorruptCapsuleError (truncated, malformed, renamed, too large, checksum mismatch),
    IncompatibleCapsuleError (another model fingerprint or state layout version).
    """
    meta, tensors, _ = read_capsule_origin(path, expected_fingerprint, expected_layout, max_bytes)
    return meta, tensors


def read_capsule_origin(path: str | Path, expected_fingerprint: str, expected_layout: int,
                        max_bytes: int | None = None) -> tuple[CapsuleMeta, dict[str, torch.Tensor], str | None]:
    """read_capsule, and the origin of the bytes as the file records it (None: it records none). Passed to
    `CapsuleStore.put(..., origin=)`, a capsule of the store's own origin shares its blocks there."""
    meta, parts = read_capsule_parts(path, expected_fingerprint, expected_layout, max_bytes)
    if parts.refs is None:
        return meta, dict(parts.own), parts.origin
    return meta, parts.full(), parts.origin


def read_capsule_parts(path: str | Path, expected_fingerprint: str, expected_layout: int,
                       max_bytes: int | None = None, have: frozenset = frozenset()) -> tuple[CapsuleMeta, Parts]:
    """read_capsule, as the store holds it: own tensors and, for a capsule cut into blocks, the tensors
    of each of its blocks read (and verified) from their files beside it. Blocks whose key is in `have`
    are not read (their entry in `blocks` is empty): the caller holds them already."""
    path = Path(path)
    meta, header, refs, origin = read_header_origin(path, max_bytes)
    own = _read_verified(path, meta, header, expected_fingerprint, expected_layout)
    if refs is None:
        return meta, Parts(own, file_origin=origin)
    return meta, Parts.of(own, refs, {k: {} if k in have else read_block(path.parent, k, refs) for k in refs.all_keys})


def _read_verified(path: Path, meta: CapsuleMeta, header: dict, expected_fingerprint: str,
                   expected_layout: int) -> dict[str, torch.Tensor]:
    if model_of(meta.fingerprint) != model_of(expected_fingerprint):
        raise IncompatibleCapsuleError(
            f"capsule {meta.namespace}/{meta.name} was made by model {meta.fingerprint!r}, this store "
            f"serves {expected_fingerprint!r}; load it with the model that made it")
    if meta.layout_version != expected_layout:
        raise IncompatibleCapsuleError(
            f"capsule {meta.namespace}/{meta.name} has state layout version {meta.layout_version}, this "
            f"build uses {expected_layout}; recreate the capsule")
    if not meta.checksum:
        raise _corrupt(path, "metadata carries no checksum")
    try:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names = set(f.keys())
            if names != set(header):
                raise _corrupt(path, "tensor names changed while reading")
            for name in sorted(names):
                tensors[name] = f.get_tensor(name).clone()
    except CorruptCapsuleError:
        raise
    except Exception as e:  # safetensors raises its own error types and OSError/RuntimeError
        raise _corrupt(path, f"cannot load tensors: {type(e).__name__}: {e}") from None
    if tensors_checksum(tensors) != meta.checksum:
        raise _corrupt(path, "checksum mismatch: the tensor bytes were altered")
    return tensors


