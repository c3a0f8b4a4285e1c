"""Graph plans: CUDA graphs captured once over the static state set, keyed by ShapeKey.

A plan reads its inputs from static buffers (token ids, slot ids, valid lengths) and positions from
`state.pos`, so one captured graph serves every slot and every position. Prefill of n tokens replays the
graph of the smallest bucket >= n with the tail marked as padding; a decode batch of b sessions replays
the graph of the smallest batch bucket >= b, padding rows pointing at the scratch slot. Capture shows a
progress bar over the shapes warmed up and captured on a terminal (capsulert/progress.py). Sessions whose
decode reaches a grid point in one step re-derive it together: a prefill of `grid` tokens for each of b
slots replays the (prefill, b, grid) graph of the decode batch bucket; when the step's other sessions decode,
their rows and those re-derivations are one forward (HybridModel.step_with_pieces): the (mixed, B, k) graph of
the decode bucket B and the smallest captured count k of re-derivations that holds them. A batched append of
n sessions' prefill pieces (ModelRunner.prefill_from_grid: a crowd's turns) replays the (pieces, B, T) graph of
the smallest decode bucket B >= n and token bucket T >= its longest piece, each row with its own valid length,
grid point, replayed tail rows and kept tail; padding rows run in the scratch slot.

A speculative verify step of b slots fed up to w tokens each (HybridModel.verify) replays the (verify, B, w)
graph of the smallest decode bucket B >= b among those up to VERIFY_BATCH, for w in 2..MAX_SPECULATE + 1: its
rows laid out on the fixed (B, w) grid (verify_rows.fixed_grid), whose row indices, waves and rollback keeps
are part of the graph; tokens, slots and rollback sets are static inputs copied in before each replay.
Larger steps run eagerly (one forward all the same).
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import torch

from capsulert.progress import Bar, progress_bar
from capsulert.engine.model import HybridModel
from capsulert.engine.model import KeptStates
from capsulert.engine.state import StateSet
from capsulert.engine.verify_rows import VerifyRows, fixed_grid, step_inputs
from capsulert.protocol.sampling import MAX_SPECULATE

log = logging.getLogger(__name__)

# the most sessions a captured verify step holds: speculation serves the few-stream regime, and each (batch,
# width) shape is one more graph
VERIFY_BATCH = 8


@dataclass(frozen=True, order=True)
class ShapeKey:
    # "prefill", "prefill_grid" (keeps the state at a grid point inside the piece), either with "_replay" (the
    # linear-attention layers replay the slot's tail first, engine/tail_replay.py), "decode", "verify" (tokens:
    # the width), "mixed" (a decode step with `tokens` grid re-derivations in its forward) or "pieces" (`batch`
    # sessions' prefill pieces of up to `tokens` each; "pieces_replay": some replay a tail)
    phase: str
    batch: int
    tokens: int

    @property
    def replays(self) -> bool:
        return self.phase.endswith("_replay")

    @property
    def keeps_grid(self) -> bool:
        return self.phase.startswith("prefill_grid")


def decode_buckets(wanted: tuple[int, ...], largest: int) -> tuple[int, ...]:
    """The captured decode batch sizes: the wanted ones below `largest`, plus `largest` itself, so every
    batch up to it has a graph."""
    return tuple(sorted({b for b in wanted if 1 <= b < largest} | {largest}))


def prefill_buckets(prefill_chunk: int, smallest: int = 16) -> list[int]:
    out, t = [], smallest
    while t < prefill_chunk:
        out.append(t)
        t *= 2
    return out + [prefill_chunk]


class GraphPlans:
    def __init__(self, model: HybridModel, state: StateSet, scratch_slot: int, max_seq: int,
                 prefill_chunk: int, decode_batches: tuple[int, ...], grid: int, tail_replay: bool = False,
                 rollback: KeptStates | None = None, scratch_set: int = 0, mixed_pieces: tuple[int, ...] = (),
                 piece_rows: int = 0):
        self.model, self.state, self.scratch = model, state, scratch_slot
        self.grid = grid
        self.tail_replay = tail_replay  # prefill pieces keep their tails, and the replaying pieces have graphs
        self.max_seq = max_seq
        self.prefill_sizes = prefill_buckets(prefill_chunk)
        self.decode_batches = tuple(sorted(decode_batches))
        dev = state.layout.device
        bmax = max(self.decode_batches)
        self.tokens = torch.zeros(max(bmax, 1), prefill_chunk, dtype=torch.long, device=dev)
        self.slots = torch.full((bmax,), scratch_slot, dtype=torch.long, device=dev)
        self.valid = torch.ones(bmax, dtype=torch.long, device=dev)
        # a mixed step's re-derivation pieces (HybridModel.step_with_pieces): their counts, tokens and slots
        self.mixed_pieces = tuple(sorted(mixed_pieces))
        kmax = max(self.mixed_pieces, default=0)
        self.piece_tokens = torch.zeros(kmax, grid, dtype=torch.long, device=dev)
        self.piece_slots = torch.full((kmax,), scratch_slot, dtype=torch.long, device=dev)
        # a piece's grid point, replayed tail rows and first kept tail row: one per row of a batched append
        self.grid_at = torch.full((bmax,), grid, dtype=torch.long, device=dev)
        self.replay = torch.zeros(bmax, dtype=torch.long, device=dev)
        self.tail_from = torch.zeros(bmax, dtype=torch.long, device=dev)
        # batched appends: (sessions, tokens) shapes of at most piece_rows rows
        self.piece_shapes = [(b, t) for b in self.decode_batches if b > 1 for t in self.prefill_sizes
                             if b * t <= piece_rows]
        widths = range(2, MAX_SPECULATE + 2)
        verify_rows_max = max(b * w for b in self.decode_batches if b <= VERIFY_BATCH for w in widths)
        # the output holds a decode step's rows and a verify step's: with row-invariant GEMMs (decode_rows None)
        # a verify step of any (b, w) on the grid keeps decode's bits; padded decode steps (decode_rows R) bound
        # a verify step to R rows too, so the shapes past R run eagerly
        rows = model.decode_rows or max(bmax + kmax, verify_rows_max)
        self.logits = torch.zeros(rows, model.cfg.vocab_size, dtype=torch.float32, device=dev)
        # verify steps: the rollback sets they keep to, the shapes captured and each shape's static rows
        self.rollback, self.scratch_set = rollback, scratch_set
        self.verify_shapes = [(b, w) for b in self.decode_batches if b <= VERIFY_BATCH for w in widths if b * w <= rows]
        self.verify_rows: dict[tuple[int, int], VerifyRows] = {
            (b, w): fixed_grid([], [], b, w, scratch_slot, lambda s: None, scratch_set, dev) for b, w in self.verify_shapes}
        self.graphs: dict[ShapeKey, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.capture_s = 0.0
        self.warmup_s = 0.0  # part of capture_s: first runs of every shape (Triton compiles and autotuning)
        self.warmup_by_key: dict[ShapeKey, float] = {}

    def run_shape(self, key: ShapeKey) -> None:
        """Run one shape eagerly on the static inputs: what capturing its graph records."""
        B, T = key.batch, key.tokens
        # the scratch slot absorbs padding rows; keep its position in range whatever ran before
        self.state.pos[self.scratch:self.scratch + 1].zero_()
        if key.phase == "mixed":
            pieces = self.piece_slots[:T]
            self.model.step_with_pieces(self.state, self.slots[:B], self.tokens[:B, 0], pieces, self.piece_tokens[:T],
                                        self.max_seq)
            logits = self.model.logits(self.state, torch.cat([self.slots[:B], pieces]))
            self.logits[:B + T].copy_(logits)
            return
        if key.phase.startswith("pieces"):
            self.model.forward(self.state, self.slots[:B], self.tokens[:B, :T], self.max_seq, self.valid[:B],
                               grid_at=self.grid_at[:B], replay=self.replay[:B] if key.replays else None,
                               tail_from=self.tail_from[:B] if self.tail_replay else None)
            return
        if key.phase == "verify":
            logits = self.model.verify(self.state, self.verify_rows[key.batch, key.tokens], self.max_seq, self.rollback)
            self.logits[:logits.shape[0]].copy_(logits)
            return
        decode = key.phase == "decode"
        # a session's prefill piece keeps its tail (B > 1: decode's grid re-derivation, which leaves none)
        keeps_tail = self.tail_replay and not decode and B == 1
        self.model.forward(self.state, self.slots[:B], self.tokens[:B, :T], self.max_seq,
                           None if decode else self.valid[:B], decode=decode,
                           grid_at=self.grid_at[:1] if key.keeps_grid else None,
                           replay=self.replay[:1] if key.replays else None,
                           tail_from=self.tail_from[:1] if keeps_tail else None)
        if decode:
            logits = self.model.logits(self.state, self.slots[:B])
            self.logits[:logits.shape[0]].copy_(logits)

    def shape_keys(self, prefill: bool = True) -> list[ShapeKey]:
        """Every shape captured: the decode batches and, with `prefill`, the prefill pieces."""
        keys = [ShapeKey("decode", b, 1) for b in self.decode_batches]
        keys += [ShapeKey("prefill", 1, t) for t in self.prefill_sizes] if prefill else []
        keys += [ShapeKey("prefill_grid", 1, t) for t in self.prefill_sizes if t > self.grid] if prefill else []
        # a piece after a replayed tail starts off the grid: it may cross a grid point at any length
        keys += [ShapeKey(p, 1, t) for p in ("prefill_replay", "prefill_grid_replay") for t in self.prefill_sizes
                 ] if prefill and self.tail_replay else []
        keys += [ShapeKey("prefill", b, self.grid) for b in self.decode_batches if b > 1] if prefill else []
        keys += [ShapeKey("mixed", b, k) for b in self.decode_batches for k in self.mixed_pieces]
        keys += [ShapeKey(p, b, t) for p in ("pieces", "pieces_replay")[:1 + self.tail_replay]
                 for b, t in self.piece_shapes] if prefill else []
        return keys + [ShapeKey("verify", b, w) for b, w in self.verify_shapes]

    def warm_inputs(self) -> None:
        """Static inputs every shape can run on: padding rows in the scratch slot, one real token, a grid
        point and a replayed row one token in (a piece of any length holds them)."""
        self.slots.fill_(self.scratch)
        self.piece_slots.fill_(self.scratch)
        self.valid.fill_(1)
        self.grid_at.fill_(1)
        self.replay.fill_(1)
        self.tail_from.zero_()

    def capture(self, prefill: bool = True, progress: bool | None = None) -> None:
        """Warm up every shape, then capture its graph; `progress`: a bar over both passes (None: on a
        terminal)."""
        keys = self.shape_keys(prefill)
        with progress_bar(2 * len(keys), "capsulert: CUDA graphs", progress=progress, unit="shape") as bar:
            self._capture(keys, bar)
        log.info("captured %d CUDA graphs in %.1f s (warm-up of every shape %.1f s)", len(keys), self.capture_s,
                 self.warmup_s)

    def _capture(self, keys: list[ShapeKey], bar: Bar) -> None:
        t0 = time.perf_counter()
        saved = {n: b.clone() for n, b in self.state.buffers.items() if n in ("pos",)}
        self.warm_inputs()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        bar.set_postfix_str("warm-up")
        with torch.cuda.stream(side):
            for key in keys:  # warm up every shape (allocator, Triton compiles and autotuning) before capture
                t = time.perf_counter()
                self.run_shape(key)
                torch.cuda.synchronize()
                self.warmup_by_key[key] = time.perf_counter() - t
                bar.update()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.warmup_s = time.perf_counter() - t0
        # A dead engine still in a reference cycle is freed by the cyclic garbage collector whenever it runs;
        # if that happens mid-capture, destroying its CUDA graphs and freeing its blocks invalidates the
        # capture ("operation failed due to a previous error during capture"). torch no longer collects on
        # entering a capture, so collect now and keep the collector off until every graph is captured.
        gc.collect()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        bar.set_postfix_str("capture")
        try:
            for i, key in enumerate(keys):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    self.run_shape(key)
                self.pool = g.pool()
                self.graphs[key] = g
                log.debug("captured CUDA graph %d/%d (%s b=%d t=%d)", i + 1, len(keys), key.phase, key.batch, key.tokens)
                bar.update()
        finally:
            if gc_was_enabled:
                gc.enable()
        torch.cuda.synchronize()
        for n, b in saved.items():
            self.state.buffers[n].copy_(b)
        self.capture_s = time.perf_counter() - t0

    def prefill(self, slot: int, tokens: list[int], grid_at: int | None = None, replay: int = 0,
                tail_from: int | None = None) -> None:
        """One piece of `tokens` for `slot`; `grid_at`: the piece's last grid point lies that many tokens in
        (its state becomes the slot's grid checkpoint); `replay`: the linear-attention layers replay that many
        rows of the slot's tail first; `tail_from`: the row of their piece from which on its rows become the
        slot's tail (HybridModel.forward)."""
        n = len(tokens)
        T = next((t for t in self.prefill_sizes if t >= n), None)
        if T is None:
            raise ValueError(f"a prefill piece of {n} tokens exceeds the chunk {self.prefill_sizes[-1]}")
        row = torch.zeros(T, dtype=torch.long)
        row[:n] = torch.tensor(tokens)
        self.tokens[0, :T].copy_(row, non_blocking=True)
        self.slots[0] = slot
        self.valid[0] = n
        if replay:  # read only by the replaying graphs
            if not self.tail_replay:
                raise ValueError("these graph plans keep no tails: a replaying piece has no graph")
            self.replay[0] = replay
        if tail_from is not None:  # a piece before the last keeps a tail the last one overwrites
            self.tail_from[0] = tail_from
        if grid_at is not None:
            self.grid_at[0] = grid_at
        phase = ("prefill" if grid_at is None else "prefill_grid") + ("_replay" if replay else "")
        self.graphs[ShapeKey(phase, 1, T)].replay()

    def prefill_rows(self, slots: list[int], rows: list[list[int]]) -> None:
        """`grid` tokens for each slot at once (the grid points decode reached); padding rows run in the
        scratch slot."""
        n, T = len(slots), self.grid
        B = next((b for b in self.decode_batches if b >= n), None)
        if B is None or any(len(r) != T for r in rows):
            raise ValueError(f"a batched prefill takes at most {self.decode_batches[-1]} rows of {T} tokens")
        pad = B - n
        self.tokens[:B, :T].copy_(torch.tensor(rows + [[0] * T] * pad), non_blocking=True)
        self.slots[:B].copy_(torch.tensor(slots + [self.scratch] * pad), non_blocking=True)
        self.valid[:B].fill_(T)
        self.graphs[ShapeKey("prefill", B, T)].replay()

    def pieces_shape(self, n: int, tokens: int) -> tuple[int, int] | None:
        """The (sessions, tokens) graph a batched append of n pieces of up to `tokens` each replays; None when
        none holds it."""
        return next(((b, t) for b, t in self.piece_shapes if b >= n and t >= tokens), None)

    def pieces(self, slots: list[int], rows: list[list[int]], grid_at: list[int], replay: list[int] | None,
               tail_from: list[int] | None) -> None:
        """Several slots' prefill pieces (rows[i] for slots[i]) in one graph (pieces_shape), each with its grid
        point (0: none inside), tail rows replayed (None: no row replays) and first kept tail row, as
        HybridModel.forward takes them; padding rows run in the scratch slot."""
        n = len(slots)
        shape = self.pieces_shape(n, max(len(r) for r in rows))
        if shape is None:
            raise ValueError(f"no batched prefill graph holds {n} pieces of up to {max(len(r) for r in rows)} tokens")
        if replay is not None and not self.tail_replay:
            raise ValueError("these graph plans keep no tails: a replaying piece has no graph")
        B, T = shape
        ids = torch.tensor([r + [0] * (T - len(r)) for r in rows] + [[0] * T] * (B - n))
        pad = [0] * (B - n)
        # one host tensor for the per-row inputs: padding rows are one token in the scratch slot
        per_row = torch.tensor([slots + [self.scratch] * (B - n), [len(r) for r in rows] + [1] * (B - n),
                                grid_at + pad, (replay or [0] * n) + pad, (tail_from or [0] * n) + pad])
        self.tokens[:B, :T].copy_(ids, non_blocking=True)
        for dst, src in zip((self.slots, self.valid, self.grid_at, self.replay, self.tail_from), per_row):
            dst[:B].copy_(src, non_blocking=True)
        self.graphs[ShapeKey("pieces" if replay is None else "pieces_replay", B, T)].replay()

    def mixed_shape(self, n: int, m: int) -> tuple[int, int] | None:
        """The (decode batch, pieces) graph a mixed step of n decode rows and m re-derivations replays; None when
        none holds it."""
        B = next((b for b in self.decode_batches if b >= n), None)
        K = next((k for k in self.mixed_pieces if k >= m), None)
        return None if B is None or K is None else (B, K)

    def mixed(self, slots: list[int], tokens: list[int], piece_slots: list[int], pieces: list[list[int]]) -> torch.Tensor:
        """A decode step of `slots` with the grid re-derivations of `piece_slots` (`grid` tokens each, from
        their live state at the previous grid point) in one graph (HybridModel.step_with_pieces); padding rows
        and pieces run in the scratch slot. The next-token logits [n + m, vocab]: the step's slots first."""
        n, m = len(slots), len(pieces)
        shape = self.mixed_shape(n, m)
        if shape is None or any(len(p) != self.grid for p in pieces):
            raise ValueError(f"no mixed graph holds {n} decode rows and {m} pieces of {self.grid} tokens")
        B, K = shape
        self.tokens[:B, 0].copy_(torch.tensor(tokens + [0] * (B - n)), non_blocking=True)
        self.slots[:B].copy_(torch.tensor(slots + [self.scratch] * (B - n)), non_blocking=True)
        self.piece_tokens[:K].copy_(torch.tensor(pieces + [[0] * self.grid] * (K - m)), non_blocking=True)
        self.piece_slots[:K].copy_(torch.tensor(piece_slots + [self.scratch] * (K - m)), non_blocking=True)
        self.graphs[ShapeKey("mixed", B, K)].replay()
        return torch.cat([self.logits[:n], self.logits[B:B + m]])

    def verify_shape(self, fed: list[list[int]]) -> tuple[int, int] | None:
        """The (batch, width) graph a verify step of these fed tokens replays; None when none holds it."""
        width = max(len(f) for f in fed)
        return next(((b, w) for b, w in self.verify_shapes if b >= len(fed) and w == width), None)

    def verify(self, slots: list[int], fed: list[list[int]], set_of) -> tuple[torch.Tensor, int]:
        """A verify step (HybridModel.verify) of slots[i] fed fed[i] on its graph (verify_shape); `set_of`: a
        slot's rollback set. Returns the logits block (slot i's rows from i * width on; the graph's static
        output buffer) and the width."""
        shape = self.verify_shape(fed)
        if shape is None:
            raise ValueError(f"no verify graph holds {len(fed)} slots of up to {max(len(f) for f in fed)} tokens")
        b, w = shape
        new = fixed_grid(slots, fed, b, w, self.scratch, set_of, self.scratch_set, torch.device("cpu"))
        for dst, src in zip(step_inputs(self.verify_rows[shape]), step_inputs(new)):
            dst.copy_(src, non_blocking=True)
        self.graphs[ShapeKey("verify", b, w)].replay()
        return self.logits, w

    def decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        """One token for each slot; returns the next-token logits block (row r for slots[r]; the graph's
        static output buffer: copy what must outlive the next replay)."""
        n = len(slots)
        B = next((b for b in self.decode_batches if b >= n), None)
        if B is None:
            raise ValueError(f"a decode step of {n} sessions exceeds the largest captured batch "
                             f"{self.decode_batches[-1]}; the engine splits larger batches")
        pad = B - n
        self.tokens[:B, 0].copy_(torch.tensor(tokens + [0] * pad), non_blocking=True)
        self.slots[:B].copy_(torch.tensor(slots + [self.scratch] * pad), non_blocking=True)
        self.valid[:B].fill_(1)
        self.graphs[ShapeKey("decode", B, 1)].replay()
        return self.logits

