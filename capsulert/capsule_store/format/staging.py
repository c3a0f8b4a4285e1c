"""Crash-safe writes of safetensors files (capsule files and block files alike): written and fsynced
under a temp name (tempfiles.py says who writes it), then renamed onto the final name (commit) and the
directory fsynced (fsync_dir). A crash leaves the complete file or only its temp file, never part of one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from capsulert.capsule_store.capsule import CapsuleMeta
from capsulert.capsule_store.format.tempfiles import temp_path
from capsulert.errors import CapsuleIOError


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


def to_cpu_owned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with its own storage (safetensors refuses shared storage)."""
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone(memory_format=torch.contiguous_format)
    return t.to("cpu").contiguous()


def write_failed(path: Path, e: BaseException) -> CapsuleIOError:
    why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return CapsuleIOError(f"cannot write capsule file {path}: {why}")


@dataclass(frozen=True)
class StagedWrite:
    """A capsule file written and fsynced under its temp name, not yet renamed onto its final name.
    Until commit() the capsule does not exist on disk: a crash leaves only the temp file."""

    tmp: Path
    final: Path
    meta: CapsuleMeta | None  # with `checksum` filled (None for a block file)

    def commit(self) -> None:
        """Rename onto the final name (atomic). The directory fsync that makes it durable is separate
        (fsync_dir) so a caller can run it outside its lock."""
        try:
            os.replace(self.tmp, self.final)
        except OSError as e:
            self.discard()
            raise write_failed(self.final, e) from None

    def discard(self) -> None:
        try:
            self.tmp.unlink(missing_ok=True)
        except OSError:  # pragma: no cover - the sweep at the next load removes it
            pass


def stage_file(final: Path, cpu: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """Write a safetensors file under a temp name next to `final` and fsync it; its temp path.
    CapsuleIOError, with nothing left behind, on failure."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise write_failed(final.parent, e) from None
    tmp = temp_path(final)
    try:
        save_file(dict(cpu), str(tmp), metadata=metadata)
        with open(tmp, "rb+") as f:
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # pragma: no cover - the sweep at the next load removes it
            pass
        if isinstance(e, (OSError, SafetensorError)):
            raise write_failed(final, e) from None
        raise
    return tmp
