"""Look at a directory of disk capsules without a store or an engine: list them from their file headers
(no tensor is read) and delete one by name.

This is what `capsulert capsules ls|rm` runs on. It relies only on the public disk format
(headers.read_header, listing.list_capsule_files, names.capsule_file_name), so it sees exactly the files a
store's `load` would load, and refuses the same corrupt or foreign files with the same typed errors.

`rm` honours the owner lock (capsule_store/owner.py): a directory a live store or orchestrator owns (its disk_dir, or
a worker's directory or pinned/ below an orchestrator's) is refused with DiskDirInUseError, since its
owner indexes the files there; delete through the owner (`store.delete`, the orchestrator's `delete`).
`rm` holds the directory's lock while it deletes (when it has one), so no owner starts there meanwhile.

A capsule cut into prefix blocks (format 2) lists the bytes of its own file as `nbytes` and the blocks it
references beside it as `shared_nbytes` (`blocks` of them; block files are shared by the capsule files of
the directory). `rm` removes the block files no remaining capsule file references.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from capsulert.protocol.names import validate_name
from capsulert.capsule_store.format.blockfiles import referenced_blocks, sweep_orphans
from capsulert.capsule_store.format.headers import read_header_refs
from capsulert.capsule_store.format.listing import list_capsule_files
from capsulert.capsule_store.format.names import FILE_SUFFIX, capsule_file_name
from capsulert.capsule_store.format.staging import fsync_dir
from capsulert.capsule_store.owner import LOCK_NAME, DirLock, check_unowned
from capsulert.errors import CorruptCapsuleError, InvalidRequestError, UnknownCapsuleError
from capsulert.protocol.names import DEFAULT_NAMESPACE

#: every capsule in a directory of capsule files is in the disk tier
TIER = "disk"


@dataclass(frozen=True)
class DiskCapsule:
    """One capsule file, described from its verified header."""

    path: Path
    name: str
    namespace: str
    tokens: int  # the boundary P: tokens the capsule covers
    tier: str
    nbytes: int  # bytes of state in its file (all of it, unless it references prefix blocks)
    file_bytes: int  # bytes of its file (tensors + header, which holds the token ids)
    fingerprint: str  # the model that made it; only that model can restore it
    layout_version: int
    created_at: float
    blocks: int = 0  # blocks it references (block files beside it: KV blocks and its grid-state block)
    shared_nbytes: int = 0  # their bytes

    def to_dict(self) -> dict:
        return {"name": self.name, "namespace": self.namespace, "tokens": self.tokens, "tier": self.tier,
                "nbytes": self.nbytes, "file_bytes": self.file_bytes, "fingerprint": self.fingerprint,
                "layout_version": self.layout_version, "created_at": self.created_at, "file": self.path.name,
                "blocks": self.blocks, "shared_nbytes": self.shared_nbytes}


@dataclass(frozen=True)
class SkippedFile:
    """A capsule-looking file that is not listed, and why."""

    path: Path
    reason: str
    partial: bool  # the temp file of a write in progress or interrupted: never loaded


def _directory(directory: str | Path) -> Path:
    directory = Path(directory)
    if not directory.is_dir():
        raise InvalidRequestError(f"{directory} is not a directory of capsule files")
    return directory


def describe(path: str | Path) -> DiskCapsule:
    """A capsule file's description from its header alone; CorruptCapsuleError if it does not verify."""
    path = Path(path)
    meta, _, refs = read_header_refs(path)
    shared = refs.nbytes if refs is not None else 0
    try:
        file_bytes = path.stat().st_size
    except OSError as e:
        raise CorruptCapsuleError(f"capsule file {path}: cannot read: {e}") from None
    return DiskCapsule(path=path, name=meta.name, namespace=meta.namespace, tokens=meta.boundary, tier=TIER,
                       nbytes=meta.nbytes - shared, file_bytes=file_bytes, fingerprint=meta.fingerprint,
                       layout_version=meta.layout_version, created_at=meta.created_at,
                       blocks=len(refs.all_keys) if refs is not None else 0, shared_nbytes=shared)


def scan(directory: str | Path, namespace: str | None = None) -> tuple[list[DiskCapsule], list[SkippedFile]]:
    """Every capsule in `directory` (of `namespace`, or all), sorted by (namespace, name), and the
    capsule files that were skipped: partial temp files and files whose header does not verify."""
    directory = _directory(directory)
    if namespace is not None:
        validate_name(namespace, "namespace")
    complete = list_capsule_files(directory)
    listed = set(complete)
    skipped = [SkippedFile(p, "partial write: the temp file of a save in progress or interrupted (never "
                              "loaded; the store's load sweeps up interrupted ones)", partial=True)
               for p in sorted(directory.iterdir())
               if FILE_SUFFIX in p.name and p.is_file() and p not in listed]
    found = []
    for p in complete:
        try:
            c = describe(p)
        except CorruptCapsuleError as e:
            skipped.append(SkippedFile(p, str(e), partial=False))
            continue
        if namespace is None or c.namespace == namespace:
            found.append(c)
    found.sort(key=lambda c: (c.namespace, c.name))
    return found, skipped


def delete(directory: str | Path, name: str, namespace: str = DEFAULT_NAMESPACE, *, force: bool = False) -> Path:
    """Delete the file of capsule (namespace, name) from `directory`; return its path.

    The name is validated (never a path) and the file is found by the hash of (namespace, name), so
    nothing but that capsule's file can be deleted. Its header is verified first: a file that does not
    verify raises CorruptCapsuleError unless `force` (it still sits at that capsule's file name, so it
    can only be a damaged copy of that capsule). Unknown names raise UnknownCapsuleError. A directory a
    live owner holds (itself or a directory above it) raises DiskDirInUseError: delete through the owner.
    """
    directory = _directory(directory)
    validate_name(name)
    validate_name(namespace, "namespace")
    check_unowned(directory)  # this directory, and those above it (an orchestrator owns its workers')
    if not (directory / LOCK_NAME).is_file():  # never owned: nothing to hold (and no lock file left behind)
        return _delete(directory, name, namespace, force)
    lock = DirLock(directory, "capsulert capsules rm")  # held while deleting: no owner starts here meanwhile
    try:
        return _delete(directory, name, namespace, force)
    finally:
        lock.release()


def _delete(directory: Path, name: str, namespace: str, force: bool) -> Path:
    path = directory / capsule_file_name(namespace, name)
    if not path.is_file():
        raise UnknownCapsuleError(_unknown_message(directory, name, namespace))
    if not force:
        describe(path)
    try:
        path.unlink()
    except FileNotFoundError:  # deleted by someone else since we looked
        raise UnknownCapsuleError(_unknown_message(directory, name, namespace)) from None
    fsync_dir(directory)  # the deletion is durable, as the store's writes are
    sweep_orphans(directory, referenced_blocks(directory), "its last capsule was removed", logging.INFO)
    return path


def _unknown_message(directory: Path, name: str, namespace: str) -> str:
    msg = f"no capsule {name!r} in namespace {namespace!r} in {directory}"
    # the commonest slip is the namespace: name the ones that do hold this name
    others = sorted({c.namespace for c in scan(directory)[0] if c.name == name})
    if others:
        msg += f"; it exists in namespace{'s' if len(others) > 1 else ''} {', '.join(map(repr, others))}"
    return msg
