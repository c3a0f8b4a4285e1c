"""Temp files of capsule writes: their names (which say who writes them) and the sweep at load.

A write (of a capsule file or a block file) goes to `.<final name>.tmp-<pid>@<host id>-<random>` and is renamed onto the final name once
fsynced. A writer killed before the rename leaves its temp file behind; nothing ever completes it. The
sweep tells the cases apart by owner and age, and logs each accurately:

- its writer runs on this host and is gone: an interrupted write, removed (warning);
- older than `stale_after_s`: an interrupted write whatever its writer (a pid may be reused, a host may
  be gone), removed (warning);
- its writer runs on this host and the file is younger: a write in progress, left alone (info);
- otherwise (another host, or a name from an older capsulert without a writer): it may be either, left
  alone until it is older than `stale_after_s` (warning).

Hidden or otherwise misnamed capsule files are never loaded and never removed (warning).
"""
from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from capsulert.capsule_store.format.names import BLOCK_SUFFIX, FILE_SUFFIX  # block files are written the same way
from capsulert.capsule_store.owner import host_id, pid_alive, writer_tag

log = logging.getLogger("capsulert.capsule_store.format.disk")  # one logger for everything the loader says

STALE_TEMP_S = 3600.0  # no capsule write takes an hour; an older temp file is an interrupted write
_TEMP_RE = re.compile(r"\.(?P<final>.+)\.tmp-(?:(?P<pid>\d{1,10})@(?P<host>[0-9a-f]{8})-)?[0-9a-f]+")


def temp_path(final: Path) -> Path:
    return final.parent / f".{final.name}.tmp-{writer_tag()}-{uuid.uuid4().hex[:16]}"


@dataclass(frozen=True)
class Verdict:
    remove: bool
    level: int  # of the log line
    why: str


@dataclass(frozen=True)
class TempFile:
    """A temp file of a capsule write and who wrote it (pid and host are None for a legacy name)."""

    path: Path
    pid: int | None
    host: str | None
    age_s: float

    def verdict(self, stale_after_s: float) -> Verdict:
        local = self.host == host_id() and self.pid is not None
        if local and not pid_alive(self.pid):  # type: ignore[arg-type]
            return Verdict(True, logging.WARNING, f"left by an interrupted write (its writer, pid {self.pid}, is gone)")
        if self.age_s > stale_after_s:
            return Verdict(True, logging.WARNING, f"left by an interrupted write ({self.age_s:.0f} s old, "
                                                  f"older than {stale_after_s:.0f} s)")
        if local:
            return Verdict(False, logging.INFO, f"a write in progress by pid {self.pid}")
        writer = f"pid {self.pid} on host {self.host}" if self.host else "an unknown writer"
        return Verdict(False, logging.WARNING, f"a write in progress or interrupted, by {writer} (removed once "
                                               f"older than {stale_after_s:.0f} s)")


def classify(path: Path, now: float) -> TempFile | None:
    """The TempFile for a temp file name, else None (a complete name, or not a capsule file)."""
    m = _TEMP_RE.fullmatch(path.name)
    if m is None or not m.group("final").endswith((FILE_SUFFIX, BLOCK_SUFFIX)):
        return None
    try:
        age = max(0.0, now - path.stat().st_mtime)
    except OSError:
        return None  # gone since we listed it (its write finished)
    pid = m.group("pid")
    return TempFile(path, int(pid) if pid else None, m.group("host"), age)


def sweep(names: list[Path], *, clean: bool, stale_after_s: float = STALE_TEMP_S) -> None:
    """Log each of `names` (temp or misnamed capsule files; never loaded) and, with `clean`, remove
    the temp files of interrupted writes."""
    now = time.time()
    for p in names:
        t = classify(p, now)
        if t is None:
            if p.exists():
                log.warning("ignoring %s: a hidden or misnamed capsule file (never loaded: capsule files are "
                            "named by the hash of their namespace and name)", p)
            continue
        v = t.verdict(stale_after_s)
        if not (clean and v.remove):
            log.log(v.level, "ignoring temp file %s: %s; never loaded", p, v.why)
            continue
        try:
            p.unlink(missing_ok=True)
        except OSError as e:
            log.warning("ignoring temp file %s: %s; it could not be removed: %s", p, v.why, e)
            continue
        log.warning("removed temp file %s: %s", p, v.why)
