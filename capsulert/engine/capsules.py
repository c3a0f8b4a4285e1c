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
one grouped copy. Only a session whose state is canonical (prefix_reuse.py) snapshots with this engine's
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
from contextlib import ExitStack
from pathlib import Path
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

import torch

from capsulert.capsule_store.blocks import BlockLayout, Parts
from capsulert.capsule_store.capsule import (
    CapsuleMeta, CapsuleRef, TensorSpec, model_of, weights_identity_of, weights_version_of)
from capsulert.capsule_store.prefix_index import PrefixMatch
from capsulert.capsule_store.store import CapsuleStore
from capsulert.engine.prefix_reuse import PrefixCache
from capsulert.engine.runner import ModelRunner, decode_groups
from capsulert.engine.session import Session
from capsulert.engine.session_table import SessionTable
from capsulert.engine.slot_views import (
    capsule_views, grid_state_views, grid_views, kv_pairs, live_state_views, rows_not_made, set_positions,
    state_views, stored_grid_state, tail_views)
from capsulert.engine.state import LAYOUT_VERSION
from capsulert.errors import (
    CapsuleError, IncompatibleCapsuleError, InvalidRequestError, StaleCapsuleError, UnknownCapsuleError,
    UnsupportedStateModeError)
from capsulert.kernels.ops import CUDA_KERNEL_BITS
from capsulert.kernels.triton_copy import Pair, Strided, copy_pairs

STATE_MODES = ("full", "replay")


@dataclass(frozen=True)
class Replay:
    """What a restored replay capsule's session still has to re-run: `prefill` from its grid point through
    the prefill path, then `decode` one token per step."""

    prefill: tuple[int, ...]
    decode: tuple[int, ...]


class Restored(NamedTuple):
    """What restore_sessions made: the sessions, and the tier the (first) capsule was read from."""
    sessions: list[Session]
    tier: str


@dataclass(frozen=True)
class _Read:
    """A capsule open for a restore: its metadata, its parts as the store holds them, every tensor but the KV
    blocks by its capsule name (`own`), the tier it was read from, whether this engine's numerics computed
    it, and the exact-replay rows this engine takes from it."""

    meta: CapsuleMeta
    parts: Parts
    own: Mapping[str, torch.Tensor]
    tier: str
    canonical: bool
    tail_rows: int


def numerics_origin(runner: ModelRunner) -> str:
    """What decides the bytes a forward pass computes besides the tokens and the weights: the device kind,
    the torch build and the kernels (on CUDA with the revision of their bits). Capsules of another origin are
    restored byte-exact but never shared by block or served as prefixes here (their state is not what this
    engine computes)."""
    dev, kernels = runner.device, runner.config.kernels
    if dev.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(dev)}:torch-{torch.__version__}:{kernels}:bits-{CUDA_KERNEL_BITS}"
    return f"{dev.type}:{platform.machine()}:torch-{torch.__version__}:{kernels}"


def open_store(runner: ModelRunner) -> CapsuleStore:
    """The capsule store of an engine running `runner`, as its config asks."""
    cfg = runner.config
    return CapsuleStore(
        device=runner.device,
        fingerprint=runner.fingerprint,
        layout_version=LAYOUT_VERSION,
        budgets=cfg.capsule_budgets.as_dict(),
        disk_dir=Path(cfg.disk_dir) if cfg.disk_dir else None,
        policy=cfg.policy,
        blocks=BlockLayout(runner.state.layout.block_tensors, token_dim=1, origin=numerics_origin(runner),
                           complete="last_hidden", grid_state=runner.state.layout.grid_state),
        prefix_policy=cfg.prefix_policy,
        prefix_bytes=cfg.prefix_cache_bytes if cfg.prefix_cache else 0,
    )


def _named(identity: str) -> str:
    """", identity X" for a fingerprint's weights identity, nothing for the loaded weights."""
    return f", identity {identity}" if identity else ""


class CapsuleVerbs:
    """Snapshot a slot into the store; restore a capsule into a slot (in place, or into new sessions)."""

    def __init__(self, runner: ModelRunner, store: CapsuleStore, table: SessionTable, prefix: PrefixCache):
        self.runner, self.store, self.table, self.prefix = runner, store, table, prefix
        self._expected = functools.lru_cache(maxsize=256)(self._expected_specs)

    def snapshot(self, session: Session, name: str, *, tier: str, pin: bool, mode: str, namespace: str) -> CapsuleRef:
        if mode not in STATE_MODES:
            raise UnsupportedStateModeError(
                f"state mode {mode!r} cannot be captured completely; supported: {STATE_MODES}"
            )
        if not session.tokens:
            raise CapsuleError("an empty session has no state to snapshot; append a prompt first")
        runner = self.runner
        P = len(session.tokens)
        G = P // runner.grid * runner.grid
        canonical = self.prefix.canonical(session)
        if mode == "replay" and (not canonical or session.decoded_from is None):
            raise UnsupportedStateModeError(
                f"session {session.id} cannot be kept as a replay capsule: its state was not computed here from "
                "its tokens (restored from a capsule of other numerics, or carried across a weight update), so "
                "re-running its tokens would not rebuild it; snapshot it with mode='full'")
        match = self._shared_state(session, namespace, G) if mode == "replay" else PrefixMatch()
        if mode == "full" or (match.grid or G) == P:  # nothing to re-run (on the grid, no shared state below)
            views = capsule_views(runner.state, session.slot, P, G)
            end = self.table.replayable_end(session)
            views.update(tail_views(runner.state, session.slot, end - G))
            if G < end < P and runner.state.keeps_tail_seed:  # decoded tokens follow the tail: the MTP head's seed at its end
                views["tail_hidden"] = runner.state.tail_hidden[session.slot]
            return self._put(session, name, namespace, tier, pin, canonical, views, None)
        if match.grid and match.grid < G:
            try:
                with self.store.reading_prefix(match, count=False) as (meta, parts):
                    views = grid_views(runner.state, session.slot, match.grid)
                    views.update(stored_grid_state(runner.state, meta, parts.own_view()))
                    return self._put(session, name, namespace, tier, pin, canonical, views, match.grid)
            except UnknownCapsuleError:  # the shared state left the store since the lookup: keep the own one
                pass
        return self._put(session, name, namespace, tier, pin, canonical, grid_views(runner.state, session.slot, G), G)

    def _shared_state(self, session: Session, namespace: str, G: int) -> PrefixMatch:
        """The deepest grid checkpoint on the session's path, at most replay_max_prefill tokens before G,
        whose state the store holds (any capsule or prefix entry of this numerics in the namespace)."""
        runner = self.runner
        after = max(G - runner.config.replay_max_prefill, 1) - 1
        return self.store.match_prefix(namespace, runner.fingerprint, session.tokens, runner.grid, after=after, count=False)

    def _put(self, session: Session, name: str, namespace: str, tier: str, pin: bool, canonical: bool,
             views: dict[str, torch.Tensor], replay_from: int | None) -> CapsuleRef:
        runner, P = self.runner, len(session.tokens)
        meta = CapsuleMeta.build(
            name=name,
            namespace=namespace,
            tokens=session.tokens,
            grid_pos=P // runner.grid * runner.grid,
            fingerprint=runner.fingerprint,
            layout_version=LAYOUT_VERSION,
            grid=runner.grid,
            nbytes=sum(t.numel() * t.element_size() for t in views.values()),
            recompute_cost_s=runner.prefill_s_per_token * P,
            decoded_from=session.decoded_from,
            replay_from=replay_from,
        )
        origin = self.store.block_origin if canonical else None
        return self.store.put(meta, views, tier=tier, pin=pin, origin=origin)

    def check_exists(self, name: str, namespace: str) -> None:
        if not self.store.contains(name, namespace):
            raise UnknownCapsuleError(f"no capsule {name!r} in namespace {namespace!r}")

    def _check_compatible(self, meta: CapsuleMeta, specs: Mapping[str, TensorSpec]) -> None:
        """Refuse a capsule this engine cannot restore. Runs on metadata and tensor shapes alone, before
        the store moves the capsule between tiers, so a refused restore changes nothing."""
        runner = self.runner
        if meta.fingerprint != runner.fingerprint and model_of(meta.fingerprint) == model_of(runner.fingerprint):
            raise StaleCapsuleError(
                f"capsule {meta.name!r} was made under other weights (weights version "
                f"{weights_version_of(meta.fingerprint)}{_named(weights_identity_of(meta.fingerprint))}); the "
                f"engine runs version {runner.weights_version}{_named(weights_identity_of(runner.fingerprint))}: "
                f"rebuild it (engine.rebuild({meta.name!r}))")
        if meta.fingerprint != runner.fingerprint:
            raise IncompatibleCapsuleError(
                f"capsule {meta.name!r} was made by model {meta.fingerprint[:16]}…, this engine runs {runner.fingerprint[:16]}…"
            )
        if meta.layout_version != LAYOUT_VERSION or meta.grid != runner.grid:
            raise IncompatibleCapsuleError(
                f"capsule {meta.name!r} has layout v{meta.layout_version} / grid {meta.grid}; "
                f"this engine uses v{LAYOUT_VERSION} / {runner.grid}"
            )
        if meta.boundary > runner.config.max_seq:
            raise IncompatibleCapsuleError(f"capsule {meta.name!r} holds {meta.boundary} tokens > max_seq {runner.config.max_seq}")
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
        views = grid_views(self.runner.state, 0, length) if replay else capsule_views(self.runner.state, 0, length, grid_pos)
        specs = {k: (tuple(v.shape), v.dtype) for k, v in views.items()}
        # the tail rows, also where this engine keeps none (it restores the rest and re-runs the tail)
        layout = self.runner.state.layout
        specs.update({k: ((shape[0],) + shape[2:], dtype) for k, (shape, dtype) in layout.tail_shapes(1, tail_rows).items()})
        if tail_rows and grid_pos + tail_rows < length and layout.mtp_layers:
            # decoded tokens follow the tail: the MTP head's seed at its end (a re-run from there starts with it)
            specs["tail_hidden"] = ((layout.hidden,), layout.dtype)
        return specs

    def _read(self, stack: ExitStack, name: str, namespace: str) -> _Read:
        """Open a read of the capsule for the rest of `stack` (a read reference held: delete refuses, budget
        moves skip it), after every check a restore makes: nothing has moved when one refuses."""
        meta, parts, tier = stack.enter_context(self.store.reading_parts(name, namespace, check=self._check_compatible))
        canonical = parts.refs is not None and parts.refs.origin == self.store.block_origin
        if meta.replay_from is not None and not canonical:
            raise IncompatibleCapsuleError(
                f"capsule {name!r} is a replay capsule made under other numerics "
                f"({parts.refs.origin if parts.refs else 'unknown'}); re-running its tokens here would not "
                "rebuild its state: restore it where it was made")
        own = parts.own_view()
        # an engine that keeps no tails restores the rest and re-runs the tail (the same bits)
        tail_rows = own["tail_in"].shape[1] if "tail_in" in own and self.runner.tail_replay else 0
        return _Read(meta, parts, own, tier, canonical, tail_rows)

    def _targets(self, slot: int, read: _Read) -> dict[str, tuple[torch.Tensor | Strided, str | None]]:
        """The slot's views a restore of the capsule writes, each with the capsule tensor it takes (None: the
        KV rows [0, P), written block by block from the capsule's blocks)."""
        st, meta = self.runner.state, read.meta
        P, G, replay = meta.held, meta.held_grid, meta.replay_from is not None  # a replay capsule: P == G
        out: dict[str, tuple[torch.Tensor | Strided, str | None]] = {
            k: (v, None) for k, v in rows_not_made(st, slot, P).items()}  # read only by a fork's second copy
        out.update({k: (v, k) for k, v in (grid_state_views(st, slot) if replay else state_views(st, slot, P != G)).items()})
        out.update({k: (v, k) for k, v in tail_views(st, slot, read.tail_rows).items()})
        if read.tail_rows and st.keeps_tail_seed:  # the seed at the tail's end: last_hidden where the capsule ends
            out["tail_hidden"] = (st.slot_view("tail_hidden", slot), "tail_hidden" if "tail_hidden" in read.own else "last_hidden")
        if P == G:  # at the grid point the live state is the grid checkpoint
            twin = live_state_views(st, slot) if replay else grid_state_views(st, slot)
            out.update({f"{k}:twin": (v, k) for k, v in twin.items()})
        return out

    def _write_many(self, items: Sequence[tuple[Session, str]], namespace: str) -> list[tuple[str, Replay | None]]:
        """Overwrite each session's slot with its capsule; every capsule is read and checked before the first
        byte moves, so a refusal writes nothing. The bytes go in two grouped copies whatever the count: each
        capsule's pieces into the first slot that takes it, then that slot's written rows into every other
        slot that takes the same capsule (fork 1 -> N reads the capsule once). Returns, per item, the tier
        the capsule was read from and, for a replay capsule, what the engine still has to re-run."""
        st = self.runner.state
        with ExitStack() as stack:
            reads: dict[str, _Read] = {}
            for _, name in items:
                if name not in reads:
                    reads[name] = self._read(stack, name, namespace)
            first: dict[str, dict[str, tuple[torch.Tensor | Strided, str | None]]] = {}
            direct: list[Pair] = []
            fanout: list[Pair] = []
            for session, name in items:
                read = reads[name]
                targets = self._targets(session.slot, read)
                if name in first:
                    fanout += [(dst, first[name][k][0]) for k, (dst, _) in targets.items()]
                    continue
                first[name] = targets
                direct += kv_pairs(st, session.slot, self.runner.grid, read.parts, 0, read.meta.held)
                direct += [(dst, read.own[src]) for dst, src in targets.values() if src is not None]
            copy_pairs(direct)
            copy_pairs(fanout)  # stream-ordered after the first copy, which wrote its sources
            set_positions(st, [s.slot for s, _ in items], [reads[n].meta.held for _, n in items])
        return [self._land(session, reads[name], namespace) for session, name in items]

    def _land(self, session: Session, read: _Read, namespace: str) -> tuple[str, Replay | None]:
        """The session's books after its slot took the capsule's bytes."""
        meta = read.meta
        P, G = meta.held, meta.held_grid
        # the tail rows replay only under the numerics that computed them (else the tail is re-run in full);
        # a capsule restores only under its own weights, so the session is current
        self.table.hold(session, meta.tokens[:P], P if P == G else meta.decoded_from,
                        G + read.tail_rows if read.tail_rows and read.canonical else None)
        self.table.stopped(session, None)
        self.prefix.restored(session, namespace, read.canonical)
        if meta.replay_from is None:
            return read.tier, None
        A = meta.decoded_from
        return read.tier, Replay(meta.tokens[P:A], meta.tokens[A:])  # type: ignore[misc]

    def restore_into(self, session: Session, name: str, namespace: str) -> str:
        """Restore the capsule into an open session in place; the tier it was read from (gpu, host or disk)."""
        return self.restore_into_many([session], [name], namespace)[0]

    def restore_into_many(self, sessions: Sequence[Session], names: Sequence[str], namespace: str) -> list[str]:
        """Restore names[i] into sessions[i] in place, all in one batch (two grouped copies); the tier each
        was read from. A refusal (an unknown or incompatible capsule) leaves every session as it was."""
        sessions, names = list(sessions), list(names)
        if len(sessions) != len(names):
            raise InvalidRequestError(f"restore_into_many takes one capsule name per session, got "
                                      f"{len(names)} names for {len(sessions)} sessions")
        if len({s.slot for s in sessions}) != len(sessions):
            raise InvalidRequestError("a session appears twice in one restore_into_many call")
        for name in dict.fromkeys(names):
            self.check_exists(name, namespace)
        read = self._write_many(list(zip(sessions, names)), namespace)
        self._replay([(s, replay) for s, (_, replay) in zip(sessions, read) if replay])
        return [tier for tier, _ in read]

    def restore_sessions(self, name: str, n: int, namespace: str, wait_s: float | None) -> Restored:
        """n new sessions holding the capsule (restore: 1, fork: n), and the tier the read found it in
        (gpu, host or disk): one read of the capsule, its bytes in two grouped copies whatever n is."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidRequestError(f"fork needs n >= 1 branches, got {n!r}")
        return self.restore_many([name] * n, namespace, wait_s)

    def restore_many(self, names: Sequence[str], namespace: str, wait_s: float | None) -> Restored:
        """A new session per name, each holding its capsule (names may repeat: a repeated one is read once),
        in one batch; all or nothing: a refusal releases every slot taken."""
        names = list(names)
        if not names or not all(isinstance(n, str) for n in names):
            raise InvalidRequestError(f"restore_many takes a non-empty list of capsule names, got {names!r:.80}")
        for name in dict.fromkeys(names):
            self.check_exists(name, namespace)
        sessions = self.table.take(len(names), wait_s, reset=False)
        try:
            read = self._write_many(list(zip(sessions, names)), namespace)
            self._replay([(s, replay) for s, (_, replay) in zip(sessions, read) if replay])
        except BaseException:
            for s in sessions:
                self.prefix.closing(s)
                self.table.release(s)
            raise
        for s, (tier, _) in zip(sessions, read):
            self.table.restored(s, tier)
        return Restored(sessions, read[0][0])

    def _replay(self, items: list[tuple[Session, Replay]]) -> None:
        """Rebuild restored replay capsules past their grid point: the prefilled tokens through the prefill
        path, then the decoded ones one step at a time, the sessions batched together (bitwise what each gets
        alone: batch invariance). Each session's decoded_from ends where the capsule's was: extend sets it,
        decode steps leave it."""
        for s, r in items:
            if r.prefill:
                self.table.extend(s, list(r.prefill))
        for i in range(max((len(r.decode) for _, r in items), default=0)):
            step = [(s, r.decode[i]) for s, r in items if i < len(r.decode)]
            for group in decode_groups(step):
                self.table.step([s for s, _ in group], [t for _, t in group])
