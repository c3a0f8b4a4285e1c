"""Who owns a capsule directory: an exclusive owner lock per live store (or orchestrator), and the
writer identity that temp file names carry.

Why a lock and not shared files: capsule file names hash only (namespace, name), so two live stores on
one directory would replace each other's files (a restore then returns another engine's tensors under
this engine's tokens) and unlink each other's capsules. Giving files writer identities would still
leave two indexes of one directory that disagree; refusing the second owner keeps one index per
directory, always equal to its files.

The lock is flock(2) on `<dir>/.capsulert.lock`, taken without blocking. The kernel drops it when the
owning process exits, however it exits (SIGKILL, OOM), so a lock never goes stale: the next owner takes
it at once and logs the dead owner it replaces (read from the JSON the lock file holds). flock locks
belong to an open file, so a second store in the same process is refused as well. The lock file is left
in place on release (unlinking it would race with a process that just opened it).

A forked child inherits the lock's descriptor, and with it the lock: the kernel would keep the directory
locked while the child lives, after its owner died. So a forked child closes its copies at once
(os.register_at_fork); the parent's lock is untouched. A directory still locked although the pid its lock
file records is dead is reported as such (another process holds the descriptor, e.g. a child forked
before this safeguard, or one that passed the descriptor on).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import socket
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

from capsulert.errors import CapsuleIOError, DiskDirInUseError

log = logging.getLogger(__name__)

LOCK_NAME = ".capsulert.lock"


def host_id() -> str:
    """8 hex digits naming this host (a hash: host names may hold characters file names should not)."""
    return hashlib.sha256(socket.gethostname().encode("utf-8", "replace")).hexdigest()[:8]


def writer_tag() -> str:
    """`<pid>@<host id>`: who writes a temp file (read back by the temp file sweep at load)."""
    return f"{os.getpid()}@{host_id()}"


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` runs on this host (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    except (OverflowError, ValueError):  # not a valid pid at all
        return False
    return True


@dataclass(frozen=True)
class Owner:
    """What the lock file records about its holder (for messages only: the flock is the truth)."""

    pid: int
    host: str
    role: str
    since: float

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        here = "this host" if self.host == host_id() else f"host {self.host}"
        return f"a {self.role} (pid {self.pid} on {here}, since {when})"

    @classmethod
    def parse(cls, raw: bytes) -> "Owner | None":
        try:
            d = json.loads(raw.decode("utf-8"))
            return cls(pid=int(d["pid"]), host=str(d["host"]), role=str(d["role"]), since=float(d["since"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None  # empty (released) or garbage: nobody to name


def _read_owner(fd: int) -> Owner | None:
    try:
        return Owner.parse(os.pread(fd, 4096, 0))
    except OSError:
        return None


def _release(fd: int) -> None:
    try:
        os.ftruncate(fd, 0)  # a released lock names nobody
    except OSError:
        pass
    os.close(fd)  # closing the file drops the flock


def _io_error(directory: Path, what: str, e: OSError) -> CapsuleIOError:
    return CapsuleIOError(f"capsule directory {directory}: cannot {what}: {e.strerror or e}")


def ensure_directory(directory: str | Path, *, create: bool) -> Path:
    """`directory` as a Path, created when `create`; CapsuleIOError when it is a file, missing, or cannot be made."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise CapsuleIOError(f"capsule directory {directory} is not a directory (a file is in the way)")
    if not directory.exists():
        if not create:
            raise CapsuleIOError(f"capsule directory {directory} does not exist")
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _io_error(directory, "create it", e) from None
    return directory


_LIVE_LOCKS: "weakref.WeakSet[DirLock]" = weakref.WeakSet()


def _close_inherited_locks() -> None:
    """In a forked child: close the lock descriptors inherited from the parent (the parent keeps its lock;
    the child neither holds nor releases it: the objects it inherited forget their descriptor)."""
    for lock in list(_LIVE_LOCKS):
        lock.forget_descriptor()


os.register_at_fork(after_in_child=_close_inherited_locks)


def _in_use_message(directory: Path, holder: Owner | None) -> str:
    if holder is None:
        who = "another live store"
    elif holder.host == host_id() and not pid_alive(holder.pid):
        who = (f"a process other than its recorded owner: {holder.describe()} is dead, but the lock is still "
               f"held, by a process that inherited its lock descriptor (a child it forked); stop that process "
               f"(`fuser {directory / LOCK_NAME}` names it) and retry")
    else:
        who = holder.describe()
    return (f"capsule directory {directory} is in use by {who}; two owners would overwrite each "
            f"other's capsule files: give each engine or orchestrator its own disk_dir")


class DirLock:
    """The exclusive owner lock of one directory, held until release() or until this object is collected."""

    def __init__(self, directory: str | Path, role: str):
        self.directory = ensure_directory(directory, create=True)
        self.path = self.directory / LOCK_NAME
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise _io_error(self.directory, "open its owner lock", e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_owner(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DiskDirInUseError(_in_use_message(self.directory, holder)) from None
            raise _io_error(self.directory, "lock it (the file system must support flock)", e) from None
        previous = _read_owner(fd)
        if previous is not None:  # the kernel dropped its flock: it exited without releasing
            log.info("capsule directory %s: taking over from %s, which exited without releasing it",
                     self.directory, previous.describe())
        self.owner = Owner(os.getpid(), host_id(), role, time.time())
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(asdict(self.owner)).encode(), 0)
        except OSError as e:
            _release(fd)
            raise _io_error(self.directory, "write its owner lock", e) from None
        self._fd = fd
        self._finalizer = weakref.finalize(self, _release, fd)  # a forgotten lock is dropped with its object
        _LIVE_LOCKS.add(self)

    @property
    def held(self) -> bool:
        return self._finalizer.alive

    def release(self) -> None:
        self._finalizer()  # runs _release once; later calls do nothing

    def forget_descriptor(self) -> None:
        """Close this process's copy of the descriptor without touching the lock (a forked child's)."""
        if self._finalizer.detach() is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass


def check_unowned(directory: str | Path) -> None:
    """DiskDirInUseError when a live owner holds `directory` or a directory above it (an orchestrator owns
    its workers' directories, a store its disk_dir); changes nothing. For tools that change a directory's
    files without taking it over (`capsulert capsules rm`)."""
    directory = Path(directory).resolve()
    for d in (directory, *directory.parents):
        path = d / LOCK_NAME
        if not path.is_file():
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise DiskDirInUseError(_in_use_message(d, _read_owner(fd))) from None
                continue  # a file system without flock: nobody can hold it either
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
