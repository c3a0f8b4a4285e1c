"""Files set aside: a capsule file that does not verify (damaged, truncated, another model's) is moved into
`<its directory>/quarantine/` with a warning, and a typed record of it is kept, instead of stopping the
store or worker that found it. What set it aside goes on with every other file.

Why move it and not delete it: the bytes may be all there is of a capsule someone wanted (a flipped bit
in a pinned capsule), so they are kept for inspection (`capsulert capsules ls DIR/quarantine` names what
is wrong with each); why not leave it: the next start would refuse it again, and a file that stays in the
directory under its capsule's name would block that name's next write from being told apart from it.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

QUARANTINE_DIR = "quarantine"


@dataclass(frozen=True)
class QuarantinedFile:
    """A capsule file that was not loaded: where it was, where it went (None: left in place, when it could
    not be moved or is sound but had no room), the typed error that refused it and its message."""

    path: str
    moved_to: str | None
    error: str
    message: str
    at: float

    def to_dict(self) -> dict:
        return {"path": self.path, "moved_to": self.moved_to, "error": self.error, "message": self.message,
                "at": self.at}


def quarantine(path: Path, error: BaseException, *, move: bool = True) -> QuarantinedFile:
    """Move `path` into the quarantine directory beside it (never overwriting an earlier one), log a
    warning, and return the record. move=False records and logs only (the file stays)."""
    path = Path(path)
    moved = None
    if move:
        target_dir = path.parent / QUARANTINE_DIR
        try:
            target_dir.mkdir(exist_ok=True)
            target = target_dir / path.name
            n = 1
            while target.exists():
                target = target_dir / f"{path.name}.{n}"
                n += 1
            os.replace(path, target)
            moved = str(target)
        except OSError as e:
            log.error("could not move %s aside (%s); it stays and is skipped", path, e.strerror or e)
    log.warning("capsule file %s not loaded: %s: %s%s", path, type(error).__name__, error,
                f"; moved to {moved}" if moved else "")
    return QuarantinedFile(str(path), moved, type(error).__name__, str(error), time.time())
