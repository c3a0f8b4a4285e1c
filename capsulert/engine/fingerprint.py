"""The fingerprint of a checkpoint directory: which model a capsule was made by, hashed once per set of files.

A capsule carries the fingerprint of the model that made it, and an engine refuses a capsule of another
model, so the fingerprint must change whenever the weights do. Hashing every weight byte at every engine
start costs about a minute for a 70 GB checkpoint, so the digest is kept in a small cache file, keyed by
the identity of the files it covers: each file's name, size, mtime_ns, ctime_ns, inode and device. A start
that finds the same identities reads the digest back without reading a weight; any change (a file rewritten
in place: a new mtime; replaced: a new inode, or a new ctime where the inode number is reused and the mtime
set back; a shard added or removed) hashes the files again.

The digest is sha256 over config.json, the safetensors index (if any) and every `*.safetensors` file of the
directory, in name order, each preceded by its name and size: the bytes an engine loads, and nothing about
where they are, so byte-identical copies (one per node of a cluster) have the same fingerprint. The cache
lives in `<cache_home>/fingerprints/` (capsulert/cache_home.py), one JSON file per checkpoint directory,
written atomically; a cache that cannot be read or written only costs a hash.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from capsulert.cache_home import cache_home
from capsulert.errors import ModelLoadError
from capsulert.progress import progress_bar

log = logging.getLogger(__name__)

CACHE_VERSION = 1
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
READ_BYTES = 16 << 20

#: how many times this process hashed a checkpoint's files (tests use it to check the cache is used)
hash_count = 0


def default_cache_dir() -> Path:
    return cache_home() / "fingerprints"


def hashed_files(path: Path) -> list[Path]:
    """The files the fingerprint covers, in name order."""
    names = {CONFIG_FILE, INDEX_FILE} | {p.name for p in path.glob("*.safetensors")}
    return [path / n for n in sorted(names) if (path / n).is_file()]


def _identity(files: list[Path]) -> list[list]:
    out = []
    for f in files:
        st = f.stat()  # follows links: a checkpoint of links to blobs (the HF hub cache) is keyed by the blobs
        out.append([f.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev])
    return out


def _digest(files: list[Path], progress: bool | None) -> str:
    global hash_count
    hash_count += 1
    h = hashlib.sha256()
    buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    total = sum(f.stat().st_size for f in files)
    with progress_bar(total, "capsulert: fingerprinting the weights (once)", progress=progress, unit="B") as bar:
        for f in files:
            h.update(f"\0{f.name}\0{f.stat().st_size}\0".encode())
            with open(f, "rb", buffering=0) as fh:
                while n := fh.readinto(buf):
                    h.update(view[:n])
                    bar.update(n)
    return h.hexdigest()


def _cache_file(path: Path, cache_dir: Path) -> Path:
    return cache_dir / (hashlib.sha256(str(path).encode()).hexdigest()[:32] + ".json")


def _read_cache(file: Path, path: Path, identity: list[list]) -> str | None:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    if (isinstance(data, dict) and data.get("version") == CACHE_VERSION and data.get("path") == str(path)
            and data.get("files") == identity and isinstance(data.get("digest"), str)):
        return data["digest"]
    return None


def _write_cache(file: Path, path: Path, identity: list[list], digest: str) -> None:
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".fingerprint-", dir=file.parent)
        with os.fdopen(fd, "w") as fh:
            json.dump({"version": CACHE_VERSION, "path": str(path), "files": identity, "digest": digest}, fh)
        os.replace(tmp, file)
    except OSError as e:  # a read-only cache: the next start hashes again, nothing worse
        log.warning("cannot keep the fingerprint of %s in %s (%s); the next start hashes the weights again",
                    path, file.parent, e)


def checkpoint_fingerprint(path: str | Path, cache_dir: str | Path | None = None,
                           progress: bool | None = None) -> str:
    """The sha256 hex digest of checkpoint directory `path` (see the module docstring), read from the cache
    in `cache_dir` (default: default_cache_dir()) when its files are the ones hashed last time."""
    path = Path(path).resolve()
    files = hashed_files(path)
    if not any(f.name.endswith(".safetensors") for f in files):
        raise ModelLoadError(f"no safetensors weights in {path} to fingerprint")
    file = _cache_file(path, Path(cache_dir) if cache_dir is not None else default_cache_dir())
    identity = _identity(files)
    cached = _read_cache(file, path, identity)
    if cached is not None:
        return cached
    log.info("fingerprinting the weights in %s (once: later starts reuse the digest while the files stay the same)",
             path)
    digest = _digest(files, progress)
    if _identity(files) == identity:  # the files did not change while they were read
        _write_cache(file, path, identity, digest)
    else:
        log.warning("the files in %s changed while they were hashed; their fingerprint is not kept", path)
    return digest
