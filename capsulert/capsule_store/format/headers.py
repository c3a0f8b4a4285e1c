"""Capsule file headers: the checks every reader runs before trusting a byte of a safetensors file
(lengths, offsets, JSON, format, metadata, the file name against the capsule it holds, and for a capsule
cut into prefix blocks its block references). No tensor is read here (`capsules ls` runs on this alone).

Formats: "1" a whole capsule (optionally recording the origin of its bytes, `capsulert.origin`: a store of
that origin loading it shares its blocks again; files without it stay whole); "2" own tensors + KV block
references; "3" as 2, plus a grid-state block (capsule_store/blocks.py). A build that reads only 1 and 2 refuses a 3 by
its format, never misreads it.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from capsulert.capsule_store.blocks import BlockRefs, keys_for, state_key
from capsulert.capsule_store.capsule import CapsuleMeta
from capsulert.capsule_store.format.block_refs import refs_from_json
from capsulert.capsule_store.format.meta import meta_from_json
from capsulert.capsule_store.format.names import capsule_file_name
from capsulert.errors import CorruptCapsuleError

FORMAT_VERSION = "1"
BLOCKED_FORMAT = "2"  # own tensors + references to block files
STATE_FORMAT = "3"  # as 2, with the state at the grid point in a block file too
ORIGIN_KEY = "capsulert.origin"  # format 1: the numerics that computed the bytes (optional)
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit; token lists make headers large
_DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
_ST_DTYPES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.float16: "F16",
              torch.bfloat16: "BF16", torch.int32: "I32", torch.float32: "F32", torch.int64: "I64", torch.float64: "F64"}


def _corrupt(path: Path, why: str) -> CorruptCapsuleError:
    return CorruptCapsuleError(f"capsule file {path.name}: {why}")


def parse_file(path: Path, max_bytes: int | None = None) -> tuple[dict, dict, int]:
    """A safetensors file's checked header: (tensor entries, __metadata__, data bytes). Checks: header
    length within the file, JSON well formed, every tensor entry well formed, the declared data size equal
    to the bytes the file holds and within `max_bytes`."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _corrupt(path, f"file is {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > MAX_HEADER_BYTES:
                raise _corrupt(path, f"header claims {n} bytes but the file holds {size - 8} after the length")
            raw = f.read(n)
    except OSError as e:
        raise CorruptCapsuleError(f"capsule file {path}: cannot read: {e}") from None
    if len(raw) != n:
        raise _corrupt(path, "file shrank while reading its header")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _corrupt(path, f"header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    md = header.pop("__metadata__", None)
    if not isinstance(md, dict):
        raise _corrupt(path, "not a capsulert capsule (no capsulert.format in the header metadata)")
    data_len = size - 8 - n
    spans = []
    for name, e in header.items():
        if not (isinstance(e, dict) and set(e) == {"dtype", "shape", "data_offsets"}
                and isinstance(e["dtype"], str) and e["dtype"] in _DTYPE_SIZES and isinstance(e["shape"], list)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in e["shape"])
                and isinstance(e["data_offsets"], list) and len(e["data_offsets"]) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in e["data_offsets"])):
            raise _corrupt(path, f"malformed header entry for tensor {name!r}")
        b, end = e["data_offsets"]
        numel = 1
        for d in e["shape"]:
            numel *= d
        if not 0 <= b <= end or end - b != numel * _DTYPE_SIZES[e["dtype"]]:
            raise _corrupt(path, f"tensor {name!r}: data_offsets {e['data_offsets']} do not match its shape and dtype")
        spans.append((b, end))
    spans.sort()
    declared = 0
    for b, end in spans:
        if b != declared:
            raise _corrupt(path, "tensor data regions overlap or leave gaps")
        declared = end
    if declared != data_len:
        raise _corrupt(path, f"header declares {declared} data bytes but the file holds {data_len} (truncated?)")
    if max_bytes is not None and declared > max_bytes:
        raise _corrupt(path, f"capsule declares {declared} bytes, more than the allowed {max_bytes}")
    return header, md, declared


def read_header(path: str | Path, max_bytes: int | None = None) -> tuple[CapsuleMeta, dict]:
    """Parse and check a capsule file's header without loading tensors.

    Returns (meta, tensor entries). Checks: header length within the file, JSON well formed, format
    version, metadata valid, file name matches (namespace, name), every tensor entry well formed, the
    declared data size equal to the bytes the file holds and within `max_bytes`; for a capsule cut into
    blocks, its block references (their keys derive from its tokens).
    """
    meta, header, _ = read_header_refs(path, max_bytes)
    return meta, header


def read_header_refs(path: str | Path, max_bytes: int | None = None) -> tuple[CapsuleMeta, dict, BlockRefs | None]:
    """read_header, and the capsule's block references (None for a whole capsule, format 1)."""
    return read_header_origin(path, max_bytes)[:3]


def read_header_origin(path: str | Path, max_bytes: int | None = None,
                       ) -> tuple[CapsuleMeta, dict, BlockRefs | None, str | None]:
    """read_header_refs, and the origin of the capsule's bytes: its blocks' origin, what a whole capsule's
    file records, or None (a file that records none)."""
    path = Path(path)
    header, md, declared = parse_file(path, max_bytes)
    fmt = md.get("capsulert.format")
    if fmt is None:
        raise _corrupt(path, "not a capsulert capsule (no capsulert.format in the header metadata)")
    if fmt not in (FORMAT_VERSION, BLOCKED_FORMAT, STATE_FORMAT):
        raise _corrupt(path, f"unknown capsule format {fmt!r}; this build reads {FORMAT_VERSION!r}, "
                             f"{BLOCKED_FORMAT!r} and {STATE_FORMAT!r}")
    meta_json = md.get("capsulert.meta")
    if not isinstance(meta_json, str):
        raise _corrupt(path, "header metadata has no capsulert.meta string")
    meta = meta_from_json(meta_json)
    if path.name != capsule_file_name(meta.namespace, meta.name):
        raise _corrupt(path, f"file name does not match the capsule it holds "
                             f"({meta.namespace!r}/{meta.name!r}); files must not be renamed")
    refs = _block_refs(path, md, meta, header, fmt) if fmt != FORMAT_VERSION else None
    shared = refs.nbytes if refs is not None else 0
    if declared + shared != meta.nbytes:
        raise _corrupt(path, f"metadata says {meta.nbytes} bytes but the tensors hold {declared + shared}")
    if refs is not None:
        return meta, header, refs, refs.origin
    origin = md.get(ORIGIN_KEY)
    if origin is not None and (not isinstance(origin, str) or not origin):
        raise _corrupt(path, f"{ORIGIN_KEY} must be a non-empty string")
    return meta, header, None, origin


def _block_refs(path: Path, md: dict, meta: CapsuleMeta, header: dict, fmt: str) -> BlockRefs:
    raw = md.get("capsulert.blocks")
    try:
        refs = refs_from_json(raw) if isinstance(raw, str) else None
    except (ValueError, TypeError, RecursionError) as e:
        raise _corrupt(path, f"block references are malformed: {e}") from None
    if refs is None:
        raise _corrupt(path, f"a capsule of format {fmt} carries no capsulert.blocks")
    if (refs.state is not None) != (fmt == STATE_FORMAT):
        raise _corrupt(path, f"a capsule of format {fmt} must {'' if fmt == STATE_FORMAT else 'not '}reference a "
                             "grid-state block")
    if refs.state is not None and (not refs.keys or refs.state != state_key(refs.keys[-1])
                                   or set(refs.state_names) & set(header)):
        raise _corrupt(path, "its grid-state block does not derive from its last block, or its file holds that state too")
    if refs.rows != meta.grid or refs.grid != meta.held_grid or refs.grid > meta.held:
        raise _corrupt(path, f"its {len(refs.keys)} blocks of {refs.rows} rows do not match its grid point {meta.grid_pos}")
    if list(refs.keys) != keys_for(meta, refs.origin, len(refs.keys)):
        raise _corrupt(path, "its block keys do not derive from its tokens (altered header?)")
    for name, s in refs.specs.items():
        e = header.get(name)
        tail = list(s.shape)
        tail[refs.token_dim] = meta.held - refs.grid
        if e is None or e["shape"] != tail or e["dtype"] != _ST_DTYPES.get(s.dtype):
            raise _corrupt(path, f"the KV rows past its blocks ({name!r}) do not match its blocks")
    return refs
