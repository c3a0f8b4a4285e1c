"""Automatic exact prefix reuse (EngineConfig.prefix_cache): the engine's side.

Per session the cache knows its namespace (the prompts it may be served from and its checkpoints go to;
None: it takes part in nothing) and whether its slot holds canonical state: state a cold prefill of its
tokens computes under the current weights. A fresh session does; a session restored from a capsule of
this engine's own numerics does; one restored from another origin (a file made on another device, an
import), or one that lived across a weight update, does not, and then it is neither served nor kept, and
its snapshots stay whole instead of sharing blocks.

- Before an append (`before_append`): the longest cached grid prefix of the session's tokens plus the new
  ones past its own grid point is restored into the slot (capsules.restore_prefix) and only the rest is
  prefilled. The checkpoints to keep on the way are planned then: the branch point (the deepest grid
  point where the store's blocks still follow the new tokens: another prompt shares the prefix up to
  there, so the next one will too) and the new tokens' last grid point. The append is cut at the branch
  point (`pieces`); the piece that crosses the last grid point keeps the state and logits there anyway, so
  it needs no cut; each is kept when reached (`reached`).
- When a session closes: its last grid point is kept (it covers the grid points decode crossed).
The store decides whether a checkpoint is admitted (cost-aware) and evicts anonymous entries first.

Only grid checkpoints are ever kept: by the exactness contract the state at a grid point is bitwise what a
cold prefill of the prefix computes, so a checkpoint found by its tokens is exact. The state between grid
points is not: decode computes a token's KV row and its state update with the one-token decode kernels,
whose arithmetic differs from the chunked prefill's, so decode-made state off the grid is a function of how
the tokens were produced, not of the tokens alone, and a cold prefill would not reproduce it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from capsulert.capsule_store.capsule import CapsuleMeta
from capsulert.capsule_store.prefix_index import PrefixMatch
from capsulert.capsule_store.store import CapsuleStore
from capsulert.engine.runner import ModelRunner
from capsulert.engine.session import Session
from capsulert.engine.session_table import SessionTable
from capsulert.engine.slot_views import grid_state_views, grid_views, kv_pairs, live_state_views, stored_grid_state
from capsulert.engine.state import LAYOUT_VERSION
from capsulert.errors import UnknownCapsuleError
from capsulert.kernels.triton_copy import copy_pairs


@dataclass
class _Tracked:
    namespace: str | None
    epoch: int | None  # the weights version the slot's state is canonical under (None: not canonical)
    planned: int = 0  # length up to which `keep` was planned (pieces of one append plan nothing again)
    keep: list[int] = field(default_factory=list)  # grid points to keep checkpoints at, ascending


class PrefixCache:
    def __init__(self, runner: ModelRunner, table: SessionTable, store: CapsuleStore, enabled: bool):
        self.runner, self.table, self.store = runner, table, store
        self.enabled = enabled and store.prefix_enabled
        self._slots: dict[int, _Tracked] = {}

    # -- sessions ---------------------------------------------------------------------------------
    def opened(self, session: Session, namespace: str | None) -> None:
        self._slots[session.slot] = _Tracked(namespace, self.runner.weights_version)

    def restored(self, session: Session, namespace: str, canonical: bool) -> None:
        self._slots[session.slot] = _Tracked(namespace, self.runner.weights_version if canonical else None)

    def rederiving(self, session: Session) -> None:
        """The session's slot was emptied to be prefilled again under the current weights: canonical again,
        same namespace, nothing planned."""
        t = self._slots.get(session.slot)
        self._slots[session.slot] = _Tracked(t.namespace if t is not None else None, self.runner.weights_version)

    def claim(self, session: Session, namespace: str) -> None:
        """The session serves `namespace` from now on (a Turn names its caller's namespace)."""
        t = self._slots.get(session.slot)
        if t is not None:
            t.namespace = namespace

    def canonical(self, session: Session) -> bool:
        t = self._slots.get(session.slot)
        return t is not None and t.epoch == self.runner.weights_version

    def _serving(self, session: Session) -> _Tracked | None:
        t = self._slots.get(session.slot)
        ok = self.enabled and t is not None and t.namespace is not None and t.epoch == self.runner.weights_version
        return t if ok else None

    def closing(self, session: Session) -> None:
        """Keep the last grid point of a session that is being released."""
        t = self._serving(session)
        if t is not None:
            self.keep_checkpoint(session, t.namespace)  # type: ignore[arg-type]
        self._slots.pop(session.slot, None)

    # -- appends ----------------------------------------------------------------------------------
    def before_append(self, session: Session, new: list[int]) -> list[int]:
        """Restore the longest cached grid prefix of tokens + new into the slot; the tokens left to prefill.
        Plans the checkpoints this append keeps."""
        t = self._serving(session)
        P, grid = len(session.tokens), self.runner.grid
        end = P + len(new)
        if t is None or t.planned >= end:
            return new
        full = session.tokens + new
        match = self.store.match_prefix(t.namespace, self.runner.fingerprint, full,  # type: ignore[arg-type]
                                              grid, after=P // grid * grid)
        if match.grid and self.restore_prefix(session, match, full):
            new = full[match.grid:]
        start = len(session.tokens)
        points = {match.shared, end // grid * grid} - set(match.checkpoints)
        t.keep = sorted(p for p in points if start < p <= end)
        t.planned = end
        return new

    def pieces(self, session: Session, new: list[int]) -> list[list[int]]:
        """`new` cut at the session's planned keep points but its own last grid point, whose state and logits
        the piece that crosses it keeps anyway (kept once the piece is done)."""
        t = self._slots.get(session.slot)
        last = (len(session.tokens) + len(new)) // self.runner.grid * self.runner.grid
        cuts = [p - len(session.tokens) for p in (t.keep if t is not None else ()) if p != last]
        cuts = [c for c in cuts if 0 < c < len(new)]
        return [new[a:b] for a, b in zip([0] + cuts, cuts + [len(new)]) if b > a]

    def reached(self, session: Session, grid_hidden: bool = False) -> None:
        """After a piece: keep the checkpoint when the session's last grid point is a planned keep point;
        `grid_hidden`: the piece crossed that point and left the hidden state before it (its logits)."""
        t = self._serving(session)
        if t is None:
            return
        P = len(session.tokens)
        if t.keep and t.keep[0] <= P:
            if P // self.runner.grid * self.runner.grid in t.keep:
                self.keep_checkpoint(session, t.namespace, grid_hidden)  # type: ignore[arg-type]
            t.keep = [p for p in t.keep if p > P]

    # -- the bytes ---------------------------------------------------------------------------------
    def restore_prefix(self, session: Session, match: PrefixMatch, tokens: list[int]) -> bool:
        """Write the grid checkpoint `match` found for `tokens` into the session's slot: the KV blocks past
        the session's own grid point, the recurrent and conv state at the checkpoint (live and grid), its
        last hidden state when it has one; the session then holds tokens[:match.grid]. False when the
        checkpoint left the store meanwhile (nothing written)."""
        runner, slot = self.runner, session.slot
        start = len(session.tokens) // runner.grid * runner.grid
        try:
            with self.store.reading_prefix(match, start) as (meta, parts):
                st, own = runner.state, parts.own_view()
                on_grid = meta.held == meta.held_grid
                state = stored_grid_state(st, meta, own)  # with an MTP head, its seed (last_hidden) too
                pairs = kv_pairs(st, slot, runner.grid, parts, start // runner.grid, None)
                for views in (live_state_views(st, slot), grid_state_views(st, slot)):
                    pairs += [(views[k], t) for k, t in state.items()]
                if on_grid and "last_hidden" in own and "last_hidden" not in state:
                    pairs.append((st.last_hidden[slot], own["last_hidden"]))
                copy_pairs(pairs)
                st.pos[slot] = match.grid
        except UnknownCapsuleError:
            return False
        self.table.hold(session, tokens[:match.grid], match.grid)
        return True

    def keep_checkpoint(self, session: Session, namespace: str, grid_hidden: bool = False) -> bool:
        """Offer the session's last grid checkpoint to the store as an anonymous prefix entry: KV rows
        [0, G), the recurrent and conv state at G and, when the session stands on G, its last hidden state;
        `grid_hidden`: the piece just run crossed G and left the hidden state before it in state.grid_hidden."""
        runner, slot = self.runner, session.slot
        P = len(session.tokens)
        G = P // runner.grid * runner.grid
        if G == 0:
            return False
        views = grid_views(runner.state, slot, G)  # on the grid the grid checkpoint is the live state
        if P == G:
            views["last_hidden"] = runner.state.last_hidden[slot]
        elif grid_hidden:
            views["last_hidden"] = runner.state.grid_hidden[slot]
        meta = CapsuleMeta.build(name="prefix", namespace=namespace, tokens=session.tokens[:G], grid_pos=G,
                                 fingerprint=runner.fingerprint, layout_version=LAYOUT_VERSION, grid=runner.grid,
                                 nbytes=sum(t.numel() * t.element_size() for t in views.values()),
                                 recompute_cost_s=runner.prefill_s_per_token * G)
        return self.store.keep_prefix(meta, views)
