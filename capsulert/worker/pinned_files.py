"""PinnedFiles: a worker's pinned capsules written to its persist directory, so that the process Ray
restarts in its place loads them back (pinned) and the orchestrator finds them where they were.

The reload takes one file at a time: a file that does not verify (a flipped byte, a truncated write of
another tool, another model's) is moved aside into `quarantine/` with a warning and a typed record
(capsule_store/quarantine.py), and the worker starts with the others. A pinned capsule the store already
indexed from its disk tier (a pinned capsule demoted to disk) is replaced by its pinned file, the copy
written when it was pinned."""
from __future__ import annotations

from pathlib import Path

from capsulert.capsule_store.format.listing import list_capsule_files
from capsulert.capsule_store.format.names import capsule_file
from capsulert.capsule_store.quarantine import QuarantinedFile, quarantine
from capsulert.errors import BudgetExceededError, CapsuleError


class PinnedFiles:
    """Without a directory every method does nothing (pins then last as long as the process)."""

    def __init__(self, directory: str | None):
        self.directory = Path(directory) if directory else None
        self.quarantined: list[QuarantinedFile] = []  # the files the last reload set aside

    def reload(self, store) -> list[str]:
        """Load every persisted capsule into `store`, pinned, one file at a time; the names loaded. A file
        that does not verify is set aside (`quarantined`); one that verifies but finds no room (pinned
        capsules fill the budgets) is recorded and left in place for a worker with larger budgets."""
        if self.directory is None or not self.directory.is_dir():
            return []
        names = []
        for p in list_capsule_files(self.directory):
            try:
                names.append(store.load_file(p, pin=True, replace=True).name)
            except BudgetExceededError as e:
                self.quarantined.append(quarantine(p, e, move=False))
            except CapsuleError as e:
                self.quarantined.append(quarantine(p, e))
        return names

    def write(self, store, name: str, namespace: str) -> None:
        if self.directory is None:
            return
        # with its block origin: the restarted process of the same origin shares its blocks again on reload
        store.export_file(name, self.directory, namespace)

    def write_or_delete(self, store, name: str, namespace: str) -> None:
        """Persist a capsule just pinned; when that fails the capsule is deleted too, so a pin never
        silently lasts only as long as the process."""
        try:
            self.write(store, name, namespace)
        except BaseException:
            store.delete(name, namespace)
            self.remove(name, namespace)
            raise

    def rewrite(self, store, name: str, namespace: str) -> None:
        """Persist a capsule again (it was rebuilt under new weights)."""
        self.remove(name, namespace)
        self.write(store, name, namespace)

    def remove(self, name: str, namespace: str) -> None:
        if self.directory is not None:
            capsule_file(self.directory, namespace, name).unlink(missing_ok=True)

