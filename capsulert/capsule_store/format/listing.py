"""Which files of a directory are complete capsule files, and the sweep of the temp files that interrupted
writes leave (tempfiles.py)."""
from __future__ import annotations

from pathlib import Path

from capsulert.capsule_store.format import tempfiles
from capsulert.capsule_store.format.names import BLOCK_SUFFIX, FILE_SUFFIX, is_capsule_file_name
from capsulert.errors import CapsuleIOError


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
        if p.name.endswith(BLOCK_SUFFIX) or not p.is_file():
            continue  # complete block files: the store's sweep of orphans (blockfiles.py) looks after them
        if FILE_SUFFIX not in p.name and BLOCK_SUFFIX not in p.name:
            continue
        (out if is_capsule_file_name(p.name) else other).append(p)
    tempfiles.sweep(other, clean=clean, stale_after_s=stale_after_s)
    return out


def list_capsule_files(directory: str | Path, *, warn_partial: bool = False) -> list[Path]:
    """Every complete capsule file in `directory`, sorted; changes nothing. With `warn_partial` the
    temp and misnamed capsule files (never listed) are logged, naming each."""
    if warn_partial:
        return scan_capsule_files(directory, clean=False)
    directory = Path(directory)
    return [p for p in _entries(directory) if is_capsule_file_name(p.name) and p.is_file()]
