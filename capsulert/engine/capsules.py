"""Capsule verbs of the engine: snapshot a slot into the store, restore a capsule into a slot.

A capsule of a session of length P holds the slot's complete state: KV rows [0, P), the live recurrent and
conv state at P, the last hidden state at P, and the token ids [0, P); off the grid it also holds the grid
checkpoint (recurrent and conv state at G = floor(P / 64) * 64, the engine's grid; on the grid it equals
the live state). Restore writes those bytes back, so a restored session is the original one: generate
continues exactly as it would have, and the next append re-runs [G, P) with the new tokens from the grid
checkpoint on the grid a cold prefill keeps, so restore + append equals a cold prefill bitwise.

The store cuts a capsule's KV rows [0, G) into prefix blocks, and its recurrent and conv state at G into a
grid-state block, shared with every capsule (and prefix-cache entry) of the same prefix
(capsule_store/blocks.py); a restore writes each block and the tail into the slot's contiguous buffers in
one grouped copy. Only a session whose state is canonical (prefix_cache.py) snapshots with this engine's
origin, so only canonical bytes are ever shared or indexed.

A *replay* capsule (mode "replay") keeps only the state at a grid point R <= G, its KV blocks and its
grid-state block, shared, and its tokens; restore writes that state and re-runs tokens[R:] the way they
were made: tokens[R:A) through the prefill path (as every append does) and tokens[A:P) as one-token decode
steps (A = decoded_from >= G). Appends and the state at every grid point are a pure function of the tokens
(canonical grid state) and decode steps are bitwise independent of the batch (batch invariance), so the
rebuilt slot is bitwise the snapshotted one, as long as the same numerics run it: a replay capsule restores
only under the origin that made it. R is the deepest grid point whose state the store holds already (a
context the branch was forked from), if at most `replay_max_prefill` tokens before G; else G. It trades
restore time for memory: nothing private is stored, so branches of one context (best-of-N, tree search)
and agents on one prompt hold little more than their tokens.
"""
from __future__ import annotations

import platform
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import torch

from capsulert.capsule_store.blocks import BlockLayout, Parts
from capsulert.capsule_store.capsule import CapsuleMeta, CapsuleRef, TensorSpec, model_of, weights_version_of
from capsulert.capsule_store.prefix_index import PrefixMatch
from capsulert.capsule_store.store import CapsuleStore
from capsulert.errors import CapsuleError, IncompatibleCapsuleError, StaleCapsuleError, UnknownCapsuleError, UnsupportedStateModeError
from capsulert.engine.state import LAYOUT_VERSION

if TYPE_CHECKING:
    from capsulert.engine.engine import Engine
    from capsulert.engine.session import Session

STATE_MODES = ("full", "replay")
BLOCK_TENSORS = ("kv_k", "kv_v")  # [attn_layers, P, kv_heads, head_dim]: token rows along dim 1
# the state at the grid point (on the grid: the live state; off it: the grid checkpoint), shared as one block
GRID_STATE = (("ssm", "ssm_grid"), ("conv", "conv_grid"))


@dataclass(frozen=True)
class Replay:
    """What a restored replay capsule's session still has to re-run: `prefill` from its grid point through
    the prefill path, then `decode` one token per step."""

    prefill: tuple[int, ...]
    decode: tuple[int, ...]


def numerics_origin(engine: "Engine") -> str:
    """What decides the bytes a forward pass computes besides the tokens and the weights: the device kind,
    the torch build and the kernels. Capsules of another origin are restored byte-exact but never shared
    by block or served as prefixes here (their state is not what this engine computes)."""
    dev = engine.device
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.machine()
    return f"{dev.type}:{where}:torch-{torch.__version__}:{engine.config.kernels}"


class CapsuleVerbs:
    def __init__(self, engine: "Engine"):
        from capsulert.engine.prefix_reuse import PrefixCache

        self.engine = engine
        cfg = engine.config
        self.store = CapsuleStore(
            device=engine.device,
            fingerprint=engine.fingerprint,
            layout_version=LAYOUT_VERSION,
            budgets=cfg.capsule_budgets.as_dict(),
            disk_dir=Path(cfg.disk_dir) if cfg.disk_dir else None,
            policy=cfg.policy,
            blocks=BlockLayout(BLOCK_TENSORS, token_dim=1, origin=numerics_origin(engine), complete="last_hidden",
                               grid_state=GRID_STATE),
            prefix_policy=cfg.prefix_policy,
            prefix_bytes=cfg.prefix_cache_bytes if cfg.prefix_cache else 0,
        )
        self.prefix = PrefixCache(self, cfg.prefix_cache)

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
        G = P // eng.grid * eng.grid
        canonical = self.prefix.canonical(session)
        if mode == "replay" and (not canonical or session.decoded_from is None):
            raise UnsupportedStateModeError(
                f"session {session.id} cannot be kept as a replay capsule: its state was not computed here from "
                "its tokens (restored from a capsule of other numerics, or carried across a weight update), so "
                "re-running its tokens would not rebuild it; snapshot it with mode='full'")
        match = self._shared_state(session, namespace, G) if mode == "replay" else PrefixMatch()
        if mode == "full" or (match.grid or G) == P:  # nothing to re-run (on the grid, no shared state below)
            return self._put(session, name, namespace, tier, pin, canonical, self._views(session.slot, P, G), None)
        if match.grid and match.grid < G:
            try:
                with self.store.reading_prefix(match, count=False) as (meta, parts):
                    views = self._grid_views(session.slot, match.grid)
                    views.update(zip(("ssm", "conv"), self._state_of(meta, parts.own_view())))
                    return self._put(session, name, namespace, tier, pin, canonical, views, match.grid)
            except UnknownCapsuleError:  # the shared state left the store since the lookup: keep the own one
                pass
        return self._put(session, name, namespace, tier, pin, canonical, self._grid_views(session.slot, G), G)

    def _shared_state(self, session: "Session", namespace: str, G: int) -> PrefixMatch:
        """The deepest grid checkpoint on the session's path, at most replay_max_prefill tokens before G,
        whose state the store holds (any capsule or prefix entry of this numerics in the namespace)."""
        eng = self.engine
        after = max(G - eng.config.replay_max_prefill, 1) - 1
        return self.store.match_prefix(namespace, eng.fingerprint, session.tokens, eng.grid, after=after, count=False)

    @staticmethod
    def _state_of(meta: CapsuleMeta, own: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A stored checkpoint's recurrent and conv state at its grid point (the live state of one held on
        the grid, the grid checkpoint of one held past it)."""
        return (own["ssm"], own["conv"]) if meta.held == meta.held_grid else (own["ssm_grid"], own["conv_grid"])

    def _put(self, session: "Session", name: str, namespace: str, tier: str, pin: bool, canonical: bool,
             views: dict[str, torch.Tensor], replay_from: int | None) -> CapsuleRef:
        eng, P = self.engine, len(session.tokens)
        meta = CapsuleMeta.build(
            name=name,
            namespace=namespace,
            tokens=session.tokens,
            grid_pos=P // eng.grid * eng.grid,
            fingerprint=eng.fingerprint,
            layout_version=LAYOUT_VERSION,
            grid=eng.grid,
            nbytes=sum(t.numel() * t.element_size() for t in views.values()),
            recompute_cost_s=eng.prefill_s_per_token * P,
            decoded_from=session.decoded_from,
            replay_from=replay_from,
        )
        origin = self.store.block_origin if canonical else None
        return self.store.put(meta, views, tier=tier, pin=pin, origin=origin)

    def _grid_views(self, slot: int, grid_pos: int) -> dict[str, torch.Tensor]:
        """The slot's KV rows [0, grid_pos) and its state at its last grid point (views, no copies)."""
        st = self.engine.state
        return {"kv_k": st.kv_k[:, slot, :grid_pos], "kv_v": st.kv_v[:, slot, :grid_pos],
                "ssm": st.ssm_grid[:, slot], "conv": st.conv_grid[:, slot]}

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
        if meta.layout_version != LAYOUT_VERSION or meta.grid != eng.grid:
            raise IncompatibleCapsuleError(
                f"capsule {meta.name!r} has layout v{meta.layout_version} / grid {meta.grid}; "
                f"this engine uses v{LAYOUT_VERSION} / {eng.grid}"
            )
        if meta.boundary > eng.config.max_seq:
            raise IncompatibleCapsuleError(f"capsule {meta.name!r} holds {meta.boundary} tokens > max_seq {eng.config.max_seq}")
        replay = meta.replay_from is not None
        expected = self._grid_views(0, meta.held) if replay else self._views(0, meta.boundary, meta.grid_pos)
        for key, view in expected.items():
            spec = specs.get(key)
            if spec is None or spec.shape != tuple(view.shape) or spec.dtype != view.dtype:
                found = None if spec is None else (spec.shape, spec.dtype)
                raise IncompatibleCapsuleError(
                    f"capsule {meta.name!r} tensor {key!r} is {found}, expected {(tuple(view.shape), view.dtype)}"
                )
        if set(specs) != set(expected):
            raise IncompatibleCapsuleError(f"capsule {meta.name!r} has tensors {sorted(specs)}, expected {sorted(expected)}")

    def restore_into(self, session: "Session", name: str, namespace: str) -> tuple[str, Replay | None]:
        """Overwrite the session's slot with the capsule; validates everything before the first byte moves.
        Returns the tier the capsule was read from (gpu, host or disk) and, for a replay capsule, what the
        engine still has to re-run (the session then holds the capsule's state at its replay point)."""
        eng = self.engine
        with self.store.reading_parts(name, namespace, check=self._check_compatible) as (meta, parts, tier):
            canonical = parts.refs is not None and parts.refs.origin == self.store.block_origin
            replay = meta.replay_from is not None
            if replay and not canonical:
                raise IncompatibleCapsuleError(
                    f"capsule {name!r} is a replay capsule made under other numerics "
                    f"({parts.refs.origin if parts.refs else 'unknown'}); re-running its tokens here would not "
                    "rebuild its state: restore it where it was made")
            slot, P, G = session.slot, meta.held, meta.held_grid
            st = eng.state
            pairs = self._block_pairs(slot, parts, 0)
            dst = self._grid_views(slot, G) if replay else self._views(slot, P, G)
            own = parts.own_view()
            for k in BLOCK_TENSORS:  # the rows past its blocks
                dst[k] = dst[k][:, len(parts.blocks) * eng.grid:]
            pairs += [(dst[k], own[k]) for k in dst]
            if P == G:  # at the grid point the live state is the grid checkpoint
                live = (st.ssm, st.conv) if replay else (st.ssm_grid, st.conv_grid)
                pairs += [(live[0][:, slot], own["ssm"]), (live[1][:, slot], own["conv"])]
            torch._foreach_copy_([d for d, _ in pairs], [t for _, t in pairs])
            st.pos[slot] = P
        session.tokens = list(meta.tokens[:P])
        session.decoded_from = P if P == G else meta.decoded_from
        session.stop_reason = None
        session.weights_version = eng.weights_version  # a capsule restores only under its own weights
        self.prefix.restored(session, namespace, canonical)
        if not replay:
            return tier, None
        A = meta.decoded_from
        return tier, Replay(meta.tokens[P:A], meta.tokens[A:])  # type: ignore[misc]

    def _block_pairs(self, slot: int, parts: Parts, first: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(slot rows, block rows) of the KV of blocks first.. of a capsule's parts."""
        st, C = self.engine.state, self.engine.grid
        pairs = []
        for i in range(first, len(parts.blocks)):
            rows = slice(i * C, (i + 1) * C)
            pairs += [(st.kv_k[:, slot, rows], parts.blocks[i]["kv_k"]), (st.kv_v[:, slot, rows], parts.blocks[i]["kv_v"])]
        return pairs

    # -- prefix reuse (prefix_cache.py decides when) ----------------------------------------------
    def restore_prefix(self, session: "Session", match: PrefixMatch, tokens: list[int]) -> bool:
        """Write the grid checkpoint `match` found for `tokens` into the session's slot: the KV blocks past
        the session's own grid point, the recurrent and conv state at the checkpoint (live and grid), its
        last hidden state when it has one; the session then holds tokens[:match.grid]. False when the
        checkpoint left the store meanwhile (nothing written)."""
        eng, slot = self.engine, session.slot
        start = len(session.tokens) // eng.grid * eng.grid
        try:
            with self.store.reading_prefix(match, start) as (meta, parts):
                st, own = eng.state, parts.own_view()
                on_grid = meta.held == meta.held_grid
                ssm, conv = self._state_of(meta, own)
                pairs = self._block_pairs(slot, parts, start // eng.grid)
                pairs += [(st.ssm[:, slot], ssm), (st.conv[:, slot], conv),
                          (st.ssm_grid[:, slot], ssm), (st.conv_grid[:, slot], conv)]
                if on_grid and "last_hidden" in own:
                    pairs.append((st.last_hidden[slot], own["last_hidden"]))
                torch._foreach_copy_([d for d, _ in pairs], [t for _, t in pairs])
                st.pos[slot] = match.grid
        except UnknownCapsuleError:
            return False
        session.tokens = list(tokens[:match.grid])
        session.decoded_from = match.grid
        return True

    def keep_checkpoint(self, session: "Session", namespace: str, grid_hidden: bool = False) -> bool:
        """Offer the session's last grid checkpoint to the store as an anonymous prefix entry: KV rows
        [0, G), the recurrent and conv state at G and, when the session stands on G, its last hidden state;
        `grid_hidden`: the piece just run crossed G and left the hidden state before it in state.grid_hidden."""
        eng, slot = self.engine, session.slot
        P = len(session.tokens)
        G = P // eng.grid * eng.grid
        if G == 0:
            return False
        views = self._grid_views(slot, G)  # on the grid the grid checkpoint is the live state
        if P == G:
            views["last_hidden"] = eng.state.last_hidden[slot]
        elif grid_hidden:
            views["last_hidden"] = eng.state.grid_hidden[slot]
        meta = CapsuleMeta.build(name="prefix", namespace=namespace, tokens=session.tokens[:G], grid_pos=G,
                                 fingerprint=eng.fingerprint, layout_version=LAYOUT_VERSION, grid=eng.grid,
                                 nbytes=sum(t.numel() * t.element_size() for t in views.values()),
                                 recompute_cost_s=eng.prefill_s_per_token * G)
        return self.store.keep_prefix(meta, views)
