"""SessionTable: which session holds which slot, and what each slot's state was made from.

The one writer of Session fields and of slot ownership. A session's tokens change only here: an append
(`extend`, through the runner's prefill path from the slot's grid checkpoint), a decode step (`step`, which
re-derives a grid point through the prefill path when decode reaches one), and the slot being filled from
elsewhere (`hold`: a capsule or cached prefix written into it, or the slot emptied). Claiming and releasing
slots waits on the table's condition under the engine's lock, so a verb that holds the lock sees one state.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Sequence

import torch

from capsulert.engine.runner import ModelRunner, decode_groups
from capsulert.engine.session import Session
from capsulert.errors import ExceedsCapacityError, ForeignSessionError, NoFreeSlotError, StaleSessionError


class SessionTable:
    def __init__(self, runner: ModelRunner, owner: Any, slots: int):
        """`owner`: the front door the sessions' verbs call (Engine)."""
        self.runner = runner
        self.owner = owner
        self.slots = slots
        self._free = list(range(slots))
        self._sessions: dict[int, Session] = {}
        self.lock = threading.RLock()
        self._slot_freed = threading.Condition(self.lock)

    # ------------------------------------------------------------------ slots
    @property
    def free_slots(self) -> int:
        return len(self._free)

    def sessions(self) -> list[Session]:
        """The open sessions."""
        return list(self._sessions.values())

    def take(self, n: int, wait_s: float | None = None, reset: bool = True) -> list[Session]:
        """Claim n slots as new sessions. reset=False when a restore overwrites every state buffer of the slot
        next. With too few free, waits up to wait_s seconds (default 0) for releases, then NoFreeSlotError."""
        wait_s = 0.0 if wait_s is None else wait_s
        if n > self.slots:  # could never start: refused at once, whatever the wait
            raise ExceedsCapacityError(f"{n} slot(s) needed at once but the engine has {self.slots}; "
                                       "ask for fewer or raise `slots`")
        deadline = time.monotonic() + wait_s
        with self.lock:
            while n > len(self._free):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise NoFreeSlotError(
                        f"{n} slot(s) needed, {len(self._free)} free of {self.slots}"
                        + (f" after waiting {wait_s:g} s" if wait_s else "") + "; close sessions or raise `slots`"
                    )
                self._slot_freed.wait(remaining)  # releases the engine lock while it waits
            sessions = []
            for _ in range(n):
                slot = self._free.pop(0)
                if reset:
                    self.runner.reset_slot(slot)
                s = Session(self.owner, slot, self.runner.weights_version)
                self._sessions[slot] = s
                sessions.append(s)
            return sessions

    def release(self, session: Session) -> None:
        with self.lock:
            session.closed = True
            del self._sessions[session.slot]
            self._free.append(session.slot)
            self._free.sort()
            self._slot_freed.notify_all()

    def own(self, session: Session) -> None:
        """ForeignSessionError for another engine's session, SessionClosedError for a closed one."""
        if session.engine is not self.owner:
            raise ForeignSessionError(f"session {session.id} belongs to another engine")
        session.check_open()

    # ------------------------------------------------------------------ what a slot holds
    def hold(self, session: Session, tokens: Sequence[int], decoded_from: int | None,
             tail_end: int | None = None) -> None:
        """The slot now holds the state of `tokens` under the current weights (a capsule or a cached prefix
        was written into it, or it was emptied): tokens[:decoded_from] came through the prefill path, and its
        tail buffers hold the prefilled rows up to tail_end (None: none)."""
        session.tokens = list(tokens)
        session.decoded_from, session.tail_end = decoded_from, tail_end
        session.weights_version = self.runner.weights_version

    def restored(self, session: Session, tier: str) -> None:
        """A new session a restore or fork made: the tier it read the capsule from."""
        session.restored_from = tier

    def forget_state(self, session: Session, tokens: list[int]) -> None:
        """A stale session's token list set to `tokens` (a prefill an update landed in, undone): its state is
        not read again before rederive, restore or close replaces all of it."""
        if not session.stale:
            raise StaleSessionError(f"session {session.id} is current; only a stale session's tokens are reset")
        session.tokens, session.decoded_from, session.tail_end = list(tokens), None, None

    def empty(self, session: Session) -> list[int]:
        """Empty the session's slot under the current weights (rederive, truncate); the tokens it held."""
        tokens = list(session.tokens)
        self.runner.reset_slot(session.slot)
        self.hold(session, [], 0)
        return tokens

    def starting(self, session: Session) -> None:
        """A generate starts on the session: no stop reason, no pending interrupt."""
        session.interrupt_requested = False
        session.stop_reason = None

    def stopped(self, session: Session, reason: str) -> None:
        session.stop_reason = reason

    def replayable_end(self, session: Session) -> int:
        """How far past its grid point G the session's tail buffers hold its prefilled tokens, the tail an
        append replays (G: none). An MTP head's rows of a re-run from the tail's end t start with the hidden
        state before t, which a slot that keeps tails also keeps (state.tail_hidden), and so does a capsule of
        the session whose tail decoded tokens follow."""
        P, grid = len(session.tokens), self.runner.grid
        G = P // grid * grid
        t = session.tail_end
        prefilled = session.decoded_from if session.decoded_from is not None else G
        if self.runner.tail_replay and t is not None and t // grid * grid == G and G < t <= min(P, prefilled):
            return t
        return G

    def _from_tail(self, session: Session) -> tuple[int, int]:
        """Where an append to the session starts its model rows (E) and its linear layers' rows (G, its grid
        point), the slot's live state set back to G with its seed at E: the tail [G, E) is replayed, the
        tokens since E (decoded ones, or none) re-run in full with the new ones."""
        runner, P = self.runner, len(session.tokens)
        G = P // runner.grid * runner.grid
        E = G
        if P != G:
            E = self.replayable_end(session)
            runner.state.load_grid(session.slot, seed=E == G)
            if G < E < P:  # tokens were decoded past the tail: the head's rows re-run from its end
                runner.state.load_tail_seed(session.slot)
            runner.state.pos[session.slot] = E
        return E, G

    # ------------------------------------------------------------------ compute on sessions
    def extend(self, session: Session, new: list[int]) -> bool:
        """Append `new` (checked ids) from the slot's grid checkpoint, as a cold prefill does: the tail the
        slot keeps rows for is replayed in the linear-attention layers, the rest since the grid point (decoded,
        or nothing kept) re-run in full. True when state.grid_hidden holds the hidden state before the new
        grid point."""
        E, G = self._from_tail(session)
        grid_hidden = self.runner.prefill(session.slot, session.tokens[E:] + new, E, replay=E - G)
        session.tokens.extend(new)
        session.decoded_from = len(session.tokens)
        session.tail_end = len(session.tokens)
        return grid_hidden

    def extend_many(self, items: list[tuple[Session, list[int]]]) -> list[bool]:
        """`extend` for several sessions in one forward per round of pieces (ModelRunner.prefill_from_grid),
        bitwise what each session's own `extend` gives: each replays the tail its slot keeps rows for in the
        linear-attention layers and re-runs the rest since its grid point in full, as `extend` does."""
        runs = []
        for s, new in items:
            E, G = self._from_tail(s)
            runs.append((s.slot, s.tokens[E:] + new, E, E - G))
        crossed = self.runner.prefill_from_grid(runs)
        for s, new in items:
            s.tokens.extend(new)
            s.decoded_from = s.tail_end = len(s.tokens)
        return crossed

    def step(self, sessions: list[Session], tokens: list[int]):
        """Feed one token to each session (one batched decode step); their next-token logits, row r for
        sessions[r] (on CUDA the graph's output buffer: read or copy before the next step). A session whose
        token ends a grid chunk is not decoded: its grid point is re-derived (rederive_grid_points) in the
        step, the others' decode rows riding in that forward where the runner mixes them."""
        grid = self.runner.grid
        reach = [r for r, s in enumerate(sessions) if (len(s.tokens) + 1) % grid == 0]
        if not reach:
            logits = self.runner.decode([s.slot for s in sessions], tokens)
            for s, t in zip(sessions, tokens):
                s.tokens.append(t)
            return logits
        plain = [r for r in range(len(sessions)) if (len(sessions[r].tokens) + 1) % grid]
        for r in reach:
            sessions[r].tokens.append(tokens[r])
        rows = self.rederive_grid_points([sessions[r] for r in reach],
                                         ([sessions[r] for r in plain], [tokens[r] for r in plain]))
        for r in plain:
            sessions[r].tokens.append(tokens[r])
        if not plain:
            return rows
        order = torch.tensor(plain + reach, device=rows.device)
        return torch.empty_like(rows).index_copy_(0, order, rows)  # row r for sessions[r]

    def verify(self, sessions: list[Session], fed: list[list[int]]) -> list[torch.Tensor]:
        """One speculative step (ModelRunner.verify): sessions[r] is fed fed[r], a sampled token and its drafts
        or the sampled token alone; each gets its logits rows [len(fed[r]), vocab]. A session fed one token is
        done with as `step` does it (its token appended, a grid point reached re-derived, its row replaced);
        one fed more keeps its tokens and state open until `settle` says how many it keeps (its speculating
        slots must fit the runner's rollback sets: at most EngineConfig.speculate_slots)."""
        runner = self.runner
        runner.rollback.assign([s.slot for s, f in zip(sessions, fed) if len(f) > 1])
        rows = runner.verify([s.slot for s in sessions], fed)
        plain = [r for r, f in enumerate(fed) if len(f) == 1]
        crossed = []
        for r in plain:
            sessions[r].tokens.append(fed[r][0])
            if len(sessions[r].tokens) % runner.grid == 0:
                crossed.append(r)
        if crossed:
            for r, row in zip(crossed, self.rederive_grid_points([sessions[r] for r in crossed])):
                rows[r][0] = row
        return rows

    def accept(self, session: Session, token: int) -> None:
        """A speculating session commits the next of the tokens its step fed (in order, before `settle`)."""
        session.tokens.append(token)

    def settle(self, session: Session, fed: int, kept: int, rows: torch.Tensor) -> torch.Tensor:
        """A speculating session fed `fed` tokens in its step (`verify`) and accepted the first `kept` of them:
        its state goes back to the position of the last one kept (when fewer than all), and a grid point that
        one reached is re-derived as decode re-derives it. Its next-token logits row."""
        if kept < fed:
            self.runner.roll_back(session.slot, kept - 1)
        if len(session.tokens) % self.runner.grid == 0:
            return self.rederive_grid_points([session])[0]
        return rows[kept - 1]

    def rederive_grid_points(self, sessions: list[Session],
                             decoding: tuple[list[Session], list[int]] = ([], [])) -> torch.Tensor:
        """Decode just reached grid point G of each session (its last token, fed or not, ends a grid chunk):
        re-run [G - GRID, G) through the prefill path from the previous grid checkpoint, so the slot's KV rows,
        recurrent and conv state and last hidden state at G are bitwise those of a cold prefill of tokens[:G]
        (canonical grid state). The sessions that cross in one step re-derive together, one batched prefill of
        GRID tokens each (split-invariant prefill: a row's bits do not depend on the other rows), and a decode
        step's other sessions (`decoding`: sessions and the tokens they are fed, at most MAX_DECODE_BATCH with
        `sessions`) ride in the same forward (ModelRunner.decode_rederiving). The next-token logits
        [len(decoding[0]) + len(sessions), vocab]: the decoding sessions' rows first."""
        runner, grid = self.runner, self.runner.grid
        fed, fed_tokens = decoding
        out = []
        for i, group in enumerate(decode_groups(sessions)):
            for s in group:
                runner.state.load_grid(s.slot)
                runner.state.pos[s.slot] = len(s.tokens) - grid
            out.append(runner.decode_rederiving([s.slot for s in fed] if i == 0 else [], fed_tokens if i == 0 else [],
                                                [s.slot for s in group], [s.tokens[-grid:] for s in group],
                                                max(len(s.tokens) for s in group)))
            for s in group:
                runner.state.save_grid(s.slot)
                s.decoded_from = len(s.tokens)
        return torch.cat(out) if len(out) > 1 else out[0]
