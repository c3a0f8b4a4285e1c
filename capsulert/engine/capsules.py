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

import functools
import platform
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import torch

from capsulert.capsule_store.blocks import BlockLayout, Parts
from capsulert.capsule_store.capsule import (
    CapsuleMeta, CapsuleRef, TensorSpec, model_of, weights_identity_of, weights_version_of)
from capsulert.capsule_store.prefix_index import PrefixMatch
from capsulert.capsule_store.store import CapsuleStore
from capsulert.errors import CapsuleError, IncompatibleCapsuleError, StaleCapsuleError, UnknownCapsuleError, UnsupportedStateModeError
from capsulert.engine.state import LAYOUT_VERSION
from capsulert.kernels.ops import CUDA_KERNEL_BITS
from capsulert.kernels.triton_copy import Pair, copy_pairs

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
    the torch build and the kernels (on CUDA with the revision of their bits). Capsules of another origin are
    restored byte-exact but never shared by block or served as prefixes here (their state is not what this
    engine computes)."""
    dev = engine.device
    if dev.type == "cuda":
        return (f"cuda:{torch.cuda.get_device_name(dev)}:torch-{torch.__version__}:{engine.config.kernels}:"
                f"bits-{CUDA_KERNEL_BITS}")
    return f"{dev.type}:{platform.machine()}:torch-{torch.__version__}:{engine.config.kernels}"


def _named(identity: str) -> str:
    """", identity X" for a fingerprint's weights identity, nothing for the loaded weights."""
    return f", identity {identity}" if identity else ""


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
        self._expected = functools.lru_cache(maxsize=256)(self._expected_specs)

    def _views(self, slot: int, length: int, grid_pos: int) -> dict[str, torch.Tensor]:
        """The slot's bytes that make up a capsule of `length` tokens (views, no copies)."""
        st = self.engine.state
        return {"kv_k": st.kv_k[:, slot, :length], "kv_v": st.kv_v[:, slot, :length],
                **self._state_views(slot, length != grid_pos)}

    def _tail_views(self, slot: int, rows: int) -> dict[str, torch.Tensor]:
        """The slot's exact-replay rows of the first `rows` tokens past its grid point (engine/tail_replay.py),
        none for rows = 0."""
        st = self.engine.state
        return {"tail_in": st.tail_in[:, slot, :rows], "tail_gates": st.tail_gates[:, slot, :rows]} if rows else {}

    def _state_views(self, slot: int, off_grid: bool) -> dict[str, torch.Tensor]:
        """`_views` but the KV rows: the live state, the last hidden state and, off the grid (where the
        live state and the grid checkpoint differ), the grid checkpoint."""
        st = self.engine.state
        views = {"ssm": st.ssm[:, slot], "conv": st.conv[:, slot], "last_hidden": st.last_hidden[slot]}
        if off_grid:
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
            views = self._views(session.slot, P, G)
            views.update(self._tail_views(session.slot, eng.replayable_end(session) - G))
            return self._put(session, name, namespace, tier, pin, canonical, views, None)
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
                **self._grid_state_views(slot)}

    def _grid_state_views(self, slot: int) -> dict[str, torch.Tensor]:
        st = self.engine.state
        return {"ssm": st.ssm_grid[:, slot], "conv": st.conv_grid[:, slot]}

    def check_exists(self, name: str, namespace: str) -> None:
        if not self.store.contains(name, namespace):
            raise UnknownCapsuleError(f"no capsule {name!r} in namespace {namespace!r}")

    def _check_compatible(self, meta: CapsuleMeta, specs: Mapping[str, TensorSpec]) -> None:
        """Refuse a capsule this engine cannot restore. Runs on metadata and tensor shapes alone, before
        the store moves the capsule between tiers, so a refused restore changes nothing."""
        eng = self.engine
        if meta.fingerprint != eng.fingerprint and model_of(meta.fingerprint) == model_of(eng.fingerprint):
            raise StaleCapsuleError(
                f"capsule {meta.name!r} was made under other weights (weights version "
                f"{weights_version_of(meta.fingerprint)}{_named(weights_identity_of(meta.fingerprint))}); the "
                f"engine runs version {eng.weights_version}{_named(eng.weights_identity)}: rebuild it "
                f"(engine.rebuild({meta.name!r}))")
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
        tail = specs.get("tail_in")
        tail_rows = tail.shape[1] if tail is not None and len(tail.shape) == 3 else 0
        if tail is not None and (replay or not 0 < tail_rows <= meta.boundary - meta.grid_pos):
            raise IncompatibleCapsuleError(
                f"capsule {meta.name!r} holds tail rows {tail.shape} for {meta.boundary - meta.grid_pos} tokens "
                f"past its grid point{' (a replay capsule keeps none)' if replay else ''}")
        expected = self._expected(meta.held if replay else meta.boundary, meta.grid_pos, replay, tail_rows)
        for key, want in expected.items():
            spec = specs.get(key)
            if spec is None or (spec.shape, spec.dtype) != want:
                found = None if spec is None else (spec.shape, spec.dtype)
                raise IncompatibleCapsuleError(f"capsule {meta.name!r} tensor {key!r} is {found}, expected {want}")
        if set(specs) != set(expected):
            raise IncompatibleCapsuleError(f"capsule {meta.name!r} has tensors {sorted(specs)}, expected {sorted(expected)}")

    def _expected_specs(self, length: int, grid_pos: int, replay: bool,
                        tail_rows: int = 0) -> dict[str, tuple[tuple, torch.dtype]]:
        """(shape, dtype) of each tensor a capsule of `length` tokens holds (a replay capsule: at its
        replay point; `tail_rows`: the exact-replay rows it keeps), as this engine lays out a slot; cached per
        instance (`_expected`): every restore checks them, and making the views to read them from was a tenth
        of its host time."""
        views = self._grid_views(0, length) if replay else self._views(0, length, grid_pos)
        specs = {k: (tuple(v.shape), v.dtype) for k, v in views.items()}
        # the tail rows, also where this engine keeps none (it restores the rest and re-runs the tail)
        layout = self.engine.state.layout
        specs.update({k: ((shape[0],) + shape[2:], dtype) for k, (shape, dtype) in layout.tail_shapes(1, tail_rows).items()})
        return specs

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
            slot, P, G = session.slot, meta.held, meta.held_grid  # a replay capsule: P == G, its replay point
            st, own = eng.state, parts.own_view()
            pairs = self._kv_pairs(slot, parts, 0, P)
            dst = self._grid_state_views(slot) if replay else self._state_views(slot, P != G)
            pairs += [(dst[k], own[k]) for k in dst]
            # an engine that keeps no tails restores the rest and re-runs the tail (the same bits)
            tail = self._tail_views(slot, own["tail_in"].shape[1] if "tail_in" in own and eng.tail_replay else 0)
            pairs += [(tail[k], own[k]) for k in tail]
            if P == G:  # at the grid point the live state is the grid checkpoint
                live = (st.ssm, st.conv) if replay else (st.ssm_grid, st.conv_grid)
                pairs += [(live[0][:, slot], own["ssm"]), (live[1][:, slot], own["conv"])]
            copy_pairs(pairs)
            st.pos[slot] = P
        session.tokens = list(meta.tokens[:P])
        session.decoded_from = P if P == G else meta.decoded_from
        # the tail rows replay only under the numerics that computed them (else the tail is re-run in full)
        session.tail_end = G + tail["tail_in"].shape[1] if tail and canonical else None
        session.stop_reason = None
        session.weights_version = eng.weights_version  # a capsule restores only under its own weights
        self.prefix.restored(session, namespace, canonical)
        if not replay:
            return tier, None
        A = meta.decoded_from
        return tier, Replay(meta.tokens[P:A], meta.tokens[A:])  # type: ignore[misc]

    def _kv_pairs(self, slot: int, parts: Parts, first: int, end: int | None) -> list[Pair]:
        """(slot rows, piece) of the KV tensors for blocks first.. of a capsule's parts and, when `end` is
        given, its own rows past its blocks up to `end`. The slot's rows are cut by one split per tensor, not
        one indexing per block (the views were most of a restore's host time)."""
        st, C, n = self.engine.state, self.engine.grid, len(parts.blocks)
        sizes = [C] * (n - first) + ([end - n * C] if end is not None else [])
        pairs: list[Pair] = []
        for k in BLOCK_TENSORS:
            rows = st.buffers[k][:, slot].narrow(1, first * C, sum(sizes)).split_with_sizes(sizes, 1)
            pieces = [b[k] for b in parts.blocks[first:]] + ([parts.own[k]] if end is not None else [])
            pairs += zip(rows, pieces)
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
                pairs = self._kv_pairs(slot, parts, start // eng.grid, None)
                pairs += [(st.ssm[:, slot], ssm), (st.conv[:, slot], conv),
                          (st.ssm_grid[:, slot], ssm), (st.conv_grid[:, slot], conv)]
                if on_grid and "last_hidden" in own:
                    pairs.append((st.last_hidden[slot], own["last_hidden"]))
                copy_pairs(pairs)
                st.pos[slot] = match.grid
        except UnknownCapsuleError:
            return False
        session.tokens = list(tokens[:match.grid])
        session.decoded_from = match.grid
        session.tail_end = None
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
