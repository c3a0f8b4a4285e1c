"""Capsule verbs of the engine: snapshot a slot into the store, restore a capsule into a slot.

A capsule of a session of length P holds the state at the grid point G = floor(P / prefill_chunk) *
prefill_chunk: KV rows [0, G), the recurrent and conv state at G (the slot's grid checkpoint), the last
hidden state at P (so the next-token logits are exact without recompute), and the token ids [0, P).
Restore copies those bytes back and leaves tokens [G, P) pending; the next append re-runs them together
with the new tokens on the same chunk grid a cold prefill uses, which makes restore + append bitwise
equal to a cold prefill of prefix + suffix, on or off the grid.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from capsulert.capsule_store.capsule import CapsuleMeta, CapsuleRef
from capsulert.capsule_store.store import CapsuleStore
from capsulert.errors import CapsuleError, IncompatibleCapsuleError, UnknownCapsuleError, UnsupportedStateModeError
from capsulert.worker.state import LAYOUT_VERSION

if TYPE_CHECKING:
    from capsulert.worker.engine import Engine
    from capsulert.worker.session import Session

STATE_MODES = ("full",)


class CapsuleVerbs:
    def __init__(self, engine: "Engine"):
        self.engine = engine
        cfg = engine.config
        self.store = CapsuleStore(
            device=engine.device,
            fingerprint=engine.fingerprint,
            layout_version=LAYOUT_VERSION,
            budgets=cfg.capsule_budgets.as_dict(),
            disk_dir=Path(cfg.disk_dir) if cfg.disk_dir else None,
            policy=cfg.policy,
        )

    def _views(self, slot: int, grid_pos: int) -> dict[str, torch.Tensor]:
        """The slot's bytes that make up a capsule at grid point grid_pos (views, no copies)."""
        st = self.engine.state
        return {
            "kv_k": st.kv_k[:, slot, :grid_pos],
            "kv_v": st.kv_v[:, slot, :grid_pos],
            "ssm": st.ssm_grid[:, slot],
            "conv": st.conv_grid[:, slot],
            "last_hidden": st.last_hidden[slot],
        }

    def snapshot(self, session: "Session", name: str, *, tier: str, pin: bool, mode: str, namespace: str) -> CapsuleRef:
        if mode not in STATE_MODES:
            raise UnsupportedStateModeError(
                f"state mode {mode!r} cannot be captured completely; supported: {STATE_MODES}"
            )
        if not session.tokens:
            raise CapsuleError("an empty session has no state to snapshot; append a prompt first")
        eng = self.engine
        P = len(session.tokens)
        G = P // eng.chunk * eng.chunk
        views = self._views(session.slot, G)
        nbytes = sum(t.numel() * t.element_size() for t in views.values())
        meta = CapsuleMeta.build(
            name=name,
            namespace=namespace,
            tokens=session.tokens,
            grid_pos=G,
            fingerprint=eng.fingerprint,
            layout_version=LAYOUT_VERSION,
            prefill_chunk=eng.chunk,
            nbytes=nbytes,
            recompute_cost_s=eng._prefill_s_per_token * P,
        )
        return self.store.put(meta, views, tier=tier, pin=pin)

    def check_exists(self, name: str, namespace: str) -> None:
        if not self.store.contains(name, namespace):
            raise UnknownCapsuleError(f"no capsule {name!r} in namespace {namespace!r}")

    def _check_compatible(self, meta: CapsuleMeta, tensors: dict[str, torch.Tensor]) -> None:
        eng = self.engine
        if meta.fingerprint != eng.fingerprint:
            raise IncompatibleCapsuleError(
                f"capsule {meta.name!r} was made by model {meta.fingerprint[:16]}…, this engine runs {eng.fingerprint[:16]}…"
            )
        if meta.layout_version != LAYOUT_VERSION or meta.prefill_chunk != eng.chunk:
            raise IncompatibleCapsuleError(
                f"capsule {meta.name!r} has layout v{meta.layout_version} / prefill_chunk {meta.prefill_chunk}; "
                f"this engine uses v{LAYOUT_VERSION} / {eng.chunk}"
            )
        if meta.boundary > eng.config.max_seq:
            raise IncompatibleCapsuleError(f"capsule {meta.name!r} holds {meta.boundary} tokens > max_seq {eng.config.max_seq}")
        expected = self._views(0, meta.grid_pos)
        for key, view in expected.items():
            t = tensors.get(key)
            if t is None or t.shape != view.shape or t.dtype != view.dtype:
                found = None if t is None else (tuple(t.shape), t.dtype)
                raise IncompatibleCapsuleError(
                    f"capsule {meta.name!r} tensor {key!r} is {found}, expected {(tuple(view.shape), view.dtype)}"
                )
        if set(tensors) != set(expected):
            raise IncompatibleCapsuleError(f"capsule {meta.name!r} has tensors {sorted(tensors)}, expected {sorted(expected)}")

    def restore_into(self, session: "Session", name: str, namespace: str) -> None:
        """Overwrite the session's slot with the capsule; validates everything before the first byte moves."""
        eng = self.engine
        with self.store.reading(name, namespace) as (meta, tensors):
            self._check_compatible(meta, tensors)
            slot, G = session.slot, meta.grid_pos
            dst = self._views(slot, G)
            st = eng.state
            torch._foreach_copy_(
                [dst["kv_k"], dst["kv_v"], dst["ssm"], dst["conv"], dst["last_hidden"], st.ssm[:, slot], st.conv[:, slot]],
                [tensors["kv_k"], tensors["kv_v"], tensors["ssm"], tensors["conv"], tensors["last_hidden"], tensors["ssm"], tensors["conv"]],
            )
            st.pos[slot] = G
        session.tokens = list(meta.tokens)
        session.live_len = G
        session.stop_reason = None
