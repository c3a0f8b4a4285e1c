"""The names of capsule files and block files: the only place a file name on disk is made or recognised.

A capsule file is named by a hash of (namespace, name), never by the name itself (names are not paths); a
block file by its 64-hex block key (capsule_store/blocks.py chains the keys from the tokens).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

FILE_SUFFIX = ".capsule.safetensors"
BLOCK_SUFFIX = ".block.safetensors"


def capsule_key_hash(namespace: str, name: str) -> str:
    """sha256 hex of namespace + NUL + name: the only thing on disk derived from a name."""
    return hashlib.sha256(f"{namespace}\x00{name}".encode("utf-8")).hexdigest()


def capsule_file_name(namespace: str, name: str) -> str:
    return f"{capsule_key_hash(namespace, name)[:40]}{FILE_SUFFIX}"


def capsule_file(directory: str | Path, namespace: str, name: str) -> Path:
    """Where the capsule file of (namespace, name) is in `directory` (whether or not it exists)."""
    return Path(directory) / capsule_file_name(namespace, name)


def is_capsule_file_name(file_name: str) -> bool:
    """A complete capsule file's name (not a temp file, not hidden)."""
    return file_name.endswith(FILE_SUFFIX) and not file_name.startswith(".")


def block_file_name(key: str) -> str:
    return f"{key}{BLOCK_SUFFIX}"


def block_key_of(file_name: str) -> str | None:
    """The block key a complete block file's name carries; None for any other name."""
    if file_name.endswith(BLOCK_SUFFIX) and not file_name.startswith("."):
        return file_name[:-len(BLOCK_SUFFIX)]
    return None
