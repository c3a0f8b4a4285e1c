"""The store's bookkeeping records: one Entry per capsule, and the Plan that simulates moves before any
is made (so a refusal changes nothing)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from capsulert.capsule_store.capsule import CapsuleMeta, TensorSpec
from capsulert.capsule_store.writer import DiskJob

Key = tuple[str, str]  # (namespace, name)


@dataclass(eq=False)  # mutable on purpose: the store updates it in place under its lock as the capsule moves
class Entry:
    meta: CapsuleMeta
    tier: str
    tensors: dict[str, torch.Tensor] | None  # None only when the bytes live in `path` alone
    path: Path | None  # the capsule file, once renamed into disk_dir
    pinned: bool
    last_used: float
    specs: Mapping[str, TensorSpec]  # shapes and dtypes, for checks that must not move the bytes
    readers: int = 0
    event: Any = None  # CUDA event of the last copy into `tensors`
    pending: DiskJob | None = None  # an async write to disk in flight; `tensors` serve reads until it is durable


class Plan:
    """A simulation of moves: where each touched capsule would be, bytes per tier, ordered actions."""

    def __init__(self, used: dict[str, int]):
        self.where: dict[Key, str | None] = {}
        self.used = dict(used)
        self.actions: list[tuple[Key, str | None]] = []

    def snapshot(self) -> tuple:
        return dict(self.where), dict(self.used), len(self.actions)

    def restore(self, snap: tuple) -> None:
        self.where, self.used, n = dict(snap[0]), dict(snap[1]), snap[2]
        del self.actions[n:]
