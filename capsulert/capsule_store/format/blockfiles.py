"""Block files: one safetensors file per prefix block, shared by every capsule file of its directory
that references it.

File `<key>` + names.BLOCK_SUFFIX (the 64-hex block key); header `__metadata__` = {"capsulert.format":
"block-1", "capsulert.block": {"key", "checksum"}}; the tensors are the block's rows of each block tensor
(a KV block), or the recurrent and conv state at the grid point (a grid-state block, same format).
Written like capsule files (temp file, fsync, rename). A capsule file is renamed into place only after
every block file it references is renamed and the directory fsynced, and a block file is unlinked only
after the directory no longer holds (durably) a capsule file that references it; so after a crash every
capsule file finds its blocks. What a crash can leave is the other way round: block files no capsule file
references (orphans), which the owner sweeps when it starts (sweep_orphans).
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open

from capsulert.capsule_store.blocks import BlockRefs
from capsulert.capsule_store.format.checksum import tensors_checksum
from capsulert.capsule_store.format.headers import _ST_DTYPES, _corrupt, parse_file, read_header_refs
from capsulert.capsule_store.format.listing import list_capsule_files
from capsulert.capsule_store.format.names import BLOCK_SUFFIX, block_file_name, block_key_of  # noqa: F401
from capsulert.capsule_store.format.staging import StagedWrite, stage_file, to_cpu_owned
from capsulert.errors import CorruptCapsuleError

log = logging.getLogger("capsulert.capsule_store.format.disk")

BLOCK_FORMAT = "block-1"


def stage_block(directory: Path, key: str, tensors: Mapping[str, torch.Tensor]) -> StagedWrite:
    """A block file written and fsynced under its temp name (commit() renames it into place)."""
    cpu = {k: to_cpu_owned(v) for k, v in tensors.items()}
    info = json.dumps({"key": key, "checksum": tensors_checksum(cpu)}, separators=(",", ":"), sort_keys=True)
    final = Path(directory) / block_file_name(key)
    tmp = stage_file(final, cpu, {"capsulert.format": BLOCK_FORMAT, "capsulert.block": info})
    return StagedWrite(tmp, final, None)  # type: ignore[arg-type]


def read_block(directory: Path, key: str, refs: BlockRefs) -> dict[str, torch.Tensor]:
    """Read and verify block `key` of a capsule whose references are `refs`: CorruptCapsuleError when its
    file is missing, malformed, another block's, not of the shapes the capsule expects, or altered."""
    path = Path(directory) / block_file_name(key)
    if not path.is_file():
        raise CorruptCapsuleError(f"capsule block {path.name} is missing from {directory}")
    header, md, _ = parse_file(path, refs.nbytes_of(key))
    checksum = _checked_info(path, md, key)
    want = {name: (list(s.shape), _ST_DTYPES.get(s.dtype)) for name, s in refs.specs_of(key).items()}
    if {name: (e["shape"], e["dtype"]) for name, e in header.items()} != want:
        raise _corrupt(path, "its tensors are not the shapes and dtypes its capsules expect")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            tensors = {name: f.get_tensor(name).clone() for name in sorted(f.keys())}
    except Exception as e:  # safetensors raises its own error types and OSError/RuntimeError
        raise _corrupt(path, f"cannot load tensors: {type(e).__name__}: {e}") from None
    if tensors_checksum(tensors) != checksum:
        raise _corrupt(path, "checksum mismatch: the block's bytes were altered")
    return tensors


def _checked_info(path: Path, md: dict, key: str) -> str:
    if md.get("capsulert.format") != BLOCK_FORMAT:
        raise _corrupt(path, f"not a capsulert block file (format {md.get('capsulert.format')!r})")
    try:
        info = json.loads(md.get("capsulert.block", ""))
    except (ValueError, TypeError, RecursionError):
        info = None
    if not isinstance(info, dict) or info.get("key") != key or not isinstance(info.get("checksum"), str):
        raise _corrupt(path, "its header does not name the block its file name does")
    return info["checksum"]


def referenced_blocks(directory: Path) -> Counter[str]:
    """How many capsule files of `directory` reference each block key (headers only; a capsule file whose
    header does not verify references nothing here: it is refused when loaded)."""
    refs: Counter[str] = Counter()
    for p in list_capsule_files(directory):
        try:
            _, _, r = read_header_refs(p)
        except CorruptCapsuleError:
            continue
        if r is not None:
            refs.update(r.all_keys)
    return refs


def block_files(directory: Path) -> dict[str, Path]:
    """The complete block files of `directory` by key (temp files excluded)."""
    out = {}
    for p in sorted(Path(directory).iterdir()):
        key = block_key_of(p.name)
        if key is not None and p.is_file():
            out[key] = p
    return out


def sweep_orphans(directory: Path, referenced: Counter[str], why: str = "left by an interrupted write or delete",
                  level: int = logging.WARNING) -> int:
    """Remove the block files no capsule file references (what a crash between writes leaves); the count."""
    n = 0
    for key, p in block_files(directory).items():
        if referenced[key]:
            continue
        try:
            p.unlink()
        except OSError as e:
            log.warning("could not remove orphan block file %s: %s", p, e)
            continue
        n += 1
        log.log(level, "removed block file %s: no capsule file references it (%s)", p, why)
    return n
