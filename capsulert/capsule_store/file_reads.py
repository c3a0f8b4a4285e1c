"""Capsule files read for the store: every file verified in full, each block file read once (capsules of a
prefix share the tensors of its blocks), and whole capsules of the store's own origin cut into blocks."""
from __future__ import annotations

from pathlib import Path

from capsulert.capsule_store.blocks import BlockLayout, Parts, split
from capsulert.capsule_store.capsule import CapsuleMeta
from capsulert.capsule_store.format.disk import read_capsule_parts


def read_verified(files: list[Path], fingerprint: str, layout_version: int, layout: BlockLayout | None,
                  cut: bool = False) -> list[tuple[CapsuleMeta, Parts]]:
    """Every capsule file read and verified in full, each block file once. With `cut`, a whole capsule
    whose file records the block origin of `layout` (one exported or persisted by a store of the same
    numerics) is cut into blocks like a put of it."""
    seen: dict[str, dict] = {}
    out = []
    for p in files:
        meta, parts = read_capsule_parts(p, fingerprint, layout_version, have=frozenset(seen))
        if cut and parts.refs is None and layout is not None and parts.origin == layout.origin:
            parts = split(meta, parts.own, layout, parts.origin)
        if parts.refs is not None:
            for k, b in parts.by_key().items():
                seen.setdefault(k, b)  # type: ignore[arg-type]
            parts = Parts.of(parts.own, parts.refs, seen)
        out.append((meta, parts))
    return out
