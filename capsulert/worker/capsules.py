"""Capsule verbs of the engine: snapshot a slot into the store, restore a capsule into a slot.

A capsule of a session of length P holds the slot's complete state: KV rows [0, P), the live recurrent and
conv state at P, the last hidden state at P, and the token ids [0, P); off the grid it also holds the grid
checkpoint (recurrent and conv state at G = floor(P / prefill_chunk) * prefill_chunk; on the grid it equals
the live state). Restore writes those bytes back, so a restored session is the original one: generate
continues exactly as it would have, and the next append re-runs [G, P) with the new tokens from the grid
checkpoint on the chunk grid a cold prefill uses, so restore + append equals a cold prefill bitwise.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch

from capsulert.capsule_store.capsule import CapsuleMeta, CapsuleRef, TensorSpec, model_of, weights_version_of
from capsulert.capsule_store.store import CapsuleStore
from capsulert.errors import CapsuleError, IncompatibleCapsuleError, StaleCapsuleError, UnknownCapsuleError, UnsupportedStateModeError
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

    def _views(self, slot: int, length: int, grid_pos: int) -> dict[str, torch.Tensor]:
        """The slot's bytes that make up a capsule of `length` tokens (views, no copies)."""
        st = self.engine.state
        views = {
            "kv_k": st.kv_k[:, slot, :length],
            "kv_v": st.kv_v[:, slot, :length],
            "ssm": st.ssm[:, slot],
            "conv": st.conv[:, slot],
            "last_hidden": st.last_hidden[slot],
        }
        if length != grid_pos:  # off the grid the live state and the grid checkpoint differ
            views["ssm_grid"] = st.ssm_grid[:, slot]
            views["conv_grid"] = st.conv_grid[:, slot]
        return views

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
        views = self._views(session.slot, P, G)
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

    def _check_compatible(self, meta: CapsuleMeta, specs: Mapping[str, TensorSpec]) -> None:
        """Refuse a capsule this engine cannot restore. Runs on metadata and tensor shapes alone, before
        the store moves the capsule between tiers, so a refused restore changes nothing."""
        eng = self.engine
        if meta.fingerprint != eng.fingerprint and model_of(meta.fingerprint) == model_of(eng.fingerprint):
            raise StaleCapsuleError(
                f"capsule {meta.name!r} was made under weights version {weights_version_of(meta.fingerprint)}; "
                f"the engine runs version {eng.weights_version}: rebuild it (engine.rebuild({meta.name!r}))")
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
        expected = self._views(0, meta.boundary, meta.grid_pos)
        for key, view in expected.items():
            spec = specs.get(key)
            if spec is None or spec.shape != tuple(view.shape) or spec.dtype != view.dtype:
                found = None if spec is None else (spec.shape, spec.dtype)
                raise IncompatibleCapsuleError(
                    f"capsule {meta.name!r} tensor {key!r} is {found}, expected {(tuple(view.shape), view.dtype)}"
                )
        if set(specs) != set(expected):
            raise IncompatibleCapsuleError(f"capsule {meta.name!r} has tensors {sorted(specs)}, expected {sorted(expected)}")

    def restore_into(self, session: "Session", name: str, namespace: str) -> None:
        """Overwrite the session's slot with the capsule; validates everything before the first byte moves."""
        eng = self.engine
        with self.store.reading(name, namespace, check=self._check_compatible) as (meta, tensors):
            slot, P, G = session.slot, meta.boundary, meta.grid_pos
            dst = self._views(slot, P, G)
            st = eng.state
            pairs = [(dst[k], tensors[k]) for k in dst]
            if P == G:  # on the grid the live state is the grid checkpoint
                pairs += [(st.ssm_grid[:, slot], tensors["ssm"]), (st.conv_grid[:, slot], tensors["conv"])]
            torch._foreach_copy_([d for d, _ in pairs], [t for _, t in pairs])
            st.pos[slot] = P
        session.tokens = list(meta.tokens)
        session.stop_reason = None
