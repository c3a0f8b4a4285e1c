"""The on-disk format: one safetensors file per capsule, metadata in the header, never pickle.

File `<sha256(namespace NUL name)[:40]>.capsule.safetensors`; header `__metadata__` =
{"capsulert.format": "1", "capsulert.meta": CapsuleMeta JSON with `checksum` filled}. The checksum is
sha256 over (name, dtype, shape, raw bytes) of the tensors in sorted-name order
(capsule.tensors_checksum). Writes are crash-safe (temp file, fsync, rename, fsync dir). Reads check
everything before trusting anything, and every refusal is a typed error, never a raw exception.
"""
from __future__ import annotations

import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from capsulert.capsule_store import tempfiles
from capsulert.capsule_store.capsule import (
    FILE_SUFFIX,
    CapsuleMeta,
    capsule_file_name,
    model_of,
    tensor_nbytes,
    tensors_checksum,
)
from capsulert.capsule_store.tempfiles import temp_path
from capsulert.errors import CapsuleIOError, CorruptCapsuleError, IncompatibleCapsuleError

log = logging.getLogger(__name__)

FORMAT_VERSION = "1"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit; token lists make headers large
_DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}


def fsync_dir(directory: Path) -> None:
    """Make renames and unlinks in `directory` durable."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _to_cpu_owned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with its own storage (safetensors refuses shared storage)."""
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone(memory_format=torch.contiguous_format)
    return t.to("cpu").contiguous()


def _write_failed(path: Path, e: BaseException) -> CapsuleIOError:
    why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return CapsuleIOError(f"cannot write capsule file {path}: {why}")


@dataclass(frozen=True)
class StagedWrite:
    """A capsule file written and fsynced under its temp name, not yet renamed onto its final name.
    Until commit() the capsule does not exist on disk: a crash leaves only the temp file."""

    tmp: Path
    final: Path
    meta: CapsuleMeta  # with `checksum` filled

    def commit(self) -> None:
        """Rename onto the final name (atomic). The directory fsync that makes it durable is separate
        (fsync_dir) so a caller can run it outside its lock."""
        try:
            os.replace(self.tmp, self.final)
        except OSError as e:
            self.discard()
            raise _write_failed(self.final, e) from None

    def discard(self) -> None:
        try:
            self.tmp.unlink(missing_ok=True)
        except OSError:  # pragma: no cover - the sweep at the next load removes it
            pass


def stage_capsule(directory: str | Path, meta: CapsuleMeta, tensors: Mapping[str, torch.Tensor]) -> StagedWrite:
    """Write one capsule file under a temp name and fsync it; CapsuleIOError (nothing left) on failure."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _write_failed(directory, e) from None
    cpu = {k: _to_cpu_owned(v) for k, v in tensors.items()}
    nbytes = tensor_nbytes(cpu)
    if nbytes != meta.nbytes:
        raise ValueError(f"capsule {meta.name!r}: meta.nbytes={meta.nbytes} but tensors hold {nbytes} bytes")
    meta = meta.replace(checksum=tensors_checksum(cpu))
    final = directory / capsule_file_name(meta.namespace, meta.name)
    staged = StagedWrite(temp_path(final), final, meta)
    try:
        save_file(cpu, str(staged.tmp), metadata={"capsulert.format": FORMAT_VERSION, "capsulert.meta": meta.to_json()})
        with open(staged.tmp, "rb+") as f:
            f.flush()
            os.fsync(f.fileno())
    except (OSError, SafetensorError) as e:
        staged.discard()
        raise _write_failed(final, e) from None
    except BaseException:
        staged.discard()
        raise
    return staged


def write_capsule_with_meta(directory: str | Path, meta: CapsuleMeta,
                            tensors: Mapping[str, torch.Tensor]) -> tuple[Path, CapsuleMeta]:
    """Write one capsule file crash-safely (temp file, fsync, rename, fsync dir); return its path and
    the meta with `checksum` filled."""
    staged = stage_capsule(directory, meta, tensors)
    staged.commit()
    fsync_dir(staged.final.parent)
    return staged.final, staged.meta


def write_capsule(directory: str | Path, meta: CapsuleMeta, tensors: Mapping[str, torch.Tensor]) -> Path:
    """Write one capsule file crash-safely into `directory`; return its path."""
    return write_capsule_with_meta(directory, meta, tensors)[0]


def _corrupt(path: Path, why: str) -> CorruptCapsuleError:
    return CorruptCapsuleError(f"capsule file {path.name}: {why}")


def read_header(path: str | Path, max_bytes: int | None = None) -> tuple[CapsuleMeta, dict]:
    """Parse and check a capsule file's header without loading tensors.

    Returns (meta, tensor entries). Checks: header length within the file, JSON well formed, format
    version, metadata valid, file name matches (namespace, name), every tensor entry well formed, the
    declared data size equal to the bytes the file holds and within `max_bytes`.
    """
    path = Path(path)
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
    if not isinstance(md, dict) or md.get("capsulert.format") is None:
        raise _corrupt(path, "not a capsulert capsule (no capsulert.format in the header metadata)")
    if md.get("capsulert.format") != FORMAT_VERSION:
        raise _corrupt(path, f"unknown capsule format {md.get('capsulert.format')!r}; this build reads {FORMAT_VERSION!r}")
    meta_json = md.get("capsulert.meta")
    if not isinstance(meta_json, str):
        raise _corrupt(path, "header metadata has no capsulert.meta string")
    meta = CapsuleMeta.from_json(meta_json)
    if path.name != capsule_file_name(meta.namespace, meta.name):
        raise _corrupt(path, f"file name does not match the capsule it holds "
                             f"({meta.namespace!r}/{meta.name!r}); files must not be renamed")
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
    if declared != meta.nbytes:
        raise _corrupt(path, f"metadata says {meta.nbytes} bytes but the tensors hold {declared}")
    return meta, header


def read_capsule(path: str | Path, expected_fingerprint: str, expected_layout: int,
                 max_bytes: int | None = None) -> tuple[CapsuleMeta, dict[str, torch.Tensor]]:
    """Read and fully verify one capsule file; tensors come back on CPU.

    Refusals: CorruptCapsuleError (truncated, malformed, renamed, too large, checksum mismatch),
    IncompatibleCapsuleError (another model fingerprint or state layout version).
    """
    path = Path(path)
    meta, header = read_header(path, max_bytes)
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
    return meta, tensors


def _entries(directory: Path) -> list[Path]:
    try:
        return sorted(directory.iterdir())
    except FileNotFoundError:
        raise CapsuleIOError(f"capsule directory {directory} does not exist") from None
    except NotADirectoryError:
        raise CapsuleIOError(f"capsule directory {directory} is not a directory") from None
    except OSError as e:
        raise CapsuleIOError(f"capsule directory {directory}: cannot list it: {e.strerror or e}") from None


def scan_capsule_files(directory: str | Path, *, clean: bool,
                       stale_after_s: float = tempfiles.STALE_TEMP_S) -> list[Path]:
    """Every complete capsule file in `directory` (not recursive), sorted. Temp files and hidden or
    misnamed capsule files are never listed: each is logged, and with `clean` the temp files of
    interrupted writes are removed (see tempfiles.py for how they are told from writes in progress)."""
    directory = Path(directory)
    out, other = [], []
    for p in _entries(directory):
        if FILE_SUFFIX not in p.name or not p.is_file():
            continue
        (out if p.name.endswith(FILE_SUFFIX) and not p.name.startswith(".") else other).append(p)
    tempfiles.sweep(other, clean=clean, stale_after_s=stale_after_s)
    return out


def list_capsule_files(directory: str | Path, *, warn_partial: bool = False) -> list[Path]:
    """Every complete capsule file in `directory`, sorted; changes nothing. With `warn_partial` the
    temp and misnamed capsule files (never listed) are logged, naming each."""
    if warn_partial:
        return scan_capsule_files(directory, clean=False)
    directory = Path(directory)
    return [p for p in _entries(directory)
            if p.name.endswith(FILE_SUFFIX) and not p.name.startswith(".") and p.is_file()]
