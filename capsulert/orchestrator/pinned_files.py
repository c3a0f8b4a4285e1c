"""PinnedFiles: a worker's pinned capsules written to its persist directory, so that the process Ray
restarts in its place loads them back (pinned) and the orchestrator finds them where they were."""
from __future__ import annotations

from pathlib import Path

from capsulert.capsule_store import capsule_file_name, read_header
from capsulert.capsule_store.disk import FILE_SUFFIX


class PinnedFiles:
    """Without a directory every method does nothing (pins then last as long as the process)."""

    def __init__(self, directory: str | None):
        self.directory = Path(directory) if directory else None

    def reload(self, store) -> list[str]:
        """Load every persisted capsule into `store`, pinned; their names."""
        if self.directory is None or not self.directory.is_dir():
            return []
        keys = [_key(p) for p in sorted(self.directory.glob("*" + FILE_SUFFIX))]
        if keys:
            store.load(self.directory)
            for namespace, name in keys:
                store.pin(name, namespace)
        return [name for _, name in keys]

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
            (self.directory / capsule_file_name(namespace, name)).unlink(missing_ok=True)


def _key(path: Path) -> tuple[str, str]:
    meta, _ = read_header(path)
    return meta.namespace, meta.name
