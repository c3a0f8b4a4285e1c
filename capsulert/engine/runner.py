"""ModelRunner: the compute core. Slots and token ids in; state in the state set and logits out.

It is the one owner of the model, the state set's compute use and the captured graphs, and of the weights'
identity (the fingerprint capsules carry, and its version). It knows no sessions, capsules or policies: the
session table (session_table.py) says which slot holds which tokens, the capsule verbs (capsules.py) copy a
slot's bytes in and out. "The graph decides how to compute; the capsule decides which state to compute from."

Canonical grid state on the 64-token grid (GRID, the gated delta rule's chunk): prefill is split-invariant
(every op gives a row the same bits whatever piece it is computed in, kernels/), and pieces start on the grid,
so appends split anywhere, prefill pieces of any size and a cold prefill give bitwise the same state at every
grid point and the same logits. `prefill_chunk` is only the longest piece (speed): a prefill is cut at its
multiples and at the new grid point. Decode steps several slots at once, each row bitwise what it gets alone
(batch invariance, model.py).
"""
from __future__ import annotations

import logging
import time
from typing import Sequence

import torch

from capsulert.config.engine import EngineConfig
from capsulert.config.model import FULL, ModelConfig
from capsulert.engine.graphs import GraphPlans, decode_buckets
from capsulert.engine.model import HybridModel, pad_rows
from capsulert.engine.rollback import RollbackStates
from capsulert.engine.mtp import MtpHead, check_draft
from capsulert.engine.prefill_groups import split_by_length
from capsulert.engine.numerics import (
    CPU_PIECE_ROWS_CHOICES, check_split_invariant_gemm, configure_cuda, cpu_piece_rows, first_mixed_variant_gemm,
    first_row_linear_variant, first_row_variant_gemm)
from capsulert.engine.state import StateLayout, StateSet
from capsulert.engine.verify_rows import verify_rows
from capsulert.errors import InvalidRequestError, NoMtpHeadError
from capsulert.kernels import ops
from capsulert.kernels.gated_delta import GATED_DELTA_CHUNK
from capsulert.kernels.triton_copy import check_copy_pairs
from capsulert.progress import progress_bar

log = logging.getLogger(__name__)

# sessions per decode step; larger generate calls run several steps per token. On CUDA every dense op of a
# step runs on exactly this many rows (batch invariance, engine/model.py).
MAX_DECODE_BATCH = 64
# a prefill of more chunks than this in one call shows a progress bar (when bars are on)
LONG_PREFILL_CHUNKS = 4
# canonical state is kept at every multiple of the gated delta rule's chunk: the finest grid at which the
# chunked prefill can stop and resume bitwise
GRID = GATED_DELTA_CHUNK
# the prefill piece that keeps an MoE model's cold prefill near its compute: shorter pieces re-read the experts
MOE_PREFILL_CHUNK = 4096
# a rest padded to its graph's rows may waste this many rows before it is cut in two: below it the extra piece's
# weight pass (a whole expert set on an MoE model) costs more than the padding rows' compute
PAD_WASTE_ROWS = 512


def prefill_pieces(start: int, end: int, chunk: int, sizes: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """[start, end) in pieces of `chunk` tokens from start (the last one shorter): every piece starts on the grid
    when start does. The last piece may cross end's last grid point: the model keeps the state and the hidden
    state there as it runs (HybridModel.forward's grid_at), so an append of up to a chunk is one pass of the
    weights wherever it starts. That is exact because a row gets the same bits whatever piece it is computed
    in (split-invariant prefill): the tokens past the grid point get those a piece starting there gives them,
    which is how a restore there re-runs them.

    `sizes`: the rows a piece is padded to (the captured graphs' token buckets, ascending). A rest that its
    smallest holding size would pad by more than a quarter of it and PAD_WASTE_ROWS is cut at the largest
    grid-aligned size that fits it first (2080 tokens under 4096-token pieces: 2048 + 32, not one 4096-row
    piece)."""
    bounds = [start, *range(start + chunk, end, chunk)]
    while sizes:
        rest = end - bounds[-1]
        padded = next((t for t in sizes if t >= rest), rest)
        fit = max((t for t in sizes if t <= rest and t % GRID == 0), default=None)
        if fit is None or padded - rest <= max(rest // 4, PAD_WASTE_ROWS):
            break
        bounds.append(bounds[-1] + fit)
    bounds.append(end)
    return list(zip(bounds, bounds[1:]))


def grid_point_inside(a: int, b: int, grid: int = GRID) -> int | None:
    """How far into the piece [a, b) its last grid point lies, when strictly inside it."""
    g = b // grid * grid
    return g - a if a < g < b else None


def verify_groups(fed: list[list[int]]) -> list[list[int]]:
    """The indices of `fed` in consecutive groups of at most MAX_DECODE_BATCH fed tokens (one verify forward
    each)."""
    groups: list[list[int]] = [[]]
    rows = 0
    for i, f in enumerate(fed):
        if rows + len(f) > MAX_DECODE_BATCH:
            groups.append([])
            rows = 0
        groups[-1].append(i)
        rows += len(f)
    return groups


def decode_groups(items: list) -> list[list]:
    """Items split into decode steps of at most MAX_DECODE_BATCH."""
    return [items[a:a + MAX_DECODE_BATCH] for a in range(0, len(items), MAX_DECODE_BATCH)]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 fingerprint: str = ""):
        self.config = config
        self.model_cfg = model_cfg
        self.device = next(iter(weights.values())).device
        self.dtype = weights["model.embed_tokens.weight"].dtype
        self.model_weights = weights
        cuda = self.device.type == "cuda"
        # the whole rows a CPU prefill piece is padded to (numerics.py); CUDA's GEMMs give a row the same bits
        # at any row count
        self.cpu_piece_rows: int | None = None
        if cuda:
            configure_cuda()  # before the first CUDA GEMM (weights are loaded and generated without one)
            check_split_invariant_gemm(probe_weight(weights, model_cfg))
            if model_cfg.is_moe and config.prefill_chunk < MOE_PREFILL_CHUNK:
                log.info("prefill_chunk=%d on an MoE model: every prefill piece reads the weights of each expert its "
                         "tokens chose (nearly all of them for a long piece); prefill_chunk=%d makes a long cold "
                         "prefill up to ~1.5x faster on an H200 (bench/RESULTS.md)", config.prefill_chunk,
                         MOE_PREFILL_CHUNK)
        else:
            self.cpu_piece_rows = cpu_piece_rows(probe_weight(weights, model_cfg))
            if self.cpu_piece_rows > CPU_PIECE_ROWS_CHOICES[0]:
                log.info("CPU prefill pieces run on whole %d-row multiples: this machine's BLAS gives a row other "
                         "bits in shorter pieces", self.cpu_piece_rows)
        self.model = HybridModel(model_cfg, weights, self._kernels(config),
                                 decode_rows=MAX_DECODE_BATCH if cuda else None, rowwise=not cuda)
        # the MTP head (engine/mtp.py) when the checkpoint has one: its rows run in every forward
        self.mtp = MtpHead(self.model, weights) if model_cfg.has_mtp else None
        if self.mtp is not None:
            self.model.attach_mtp(self.mtp)
        if cuda:
            self.choose_decode_rows()
        # a decode step's grid re-derivations ride in its forward (HybridModel.step_with_pieces) where every
        # GEMM keeps a row's bits at any row count; else they run as a forward of their own
        self.mixed_steps = bool(cuda and config.mixed_rederive_pieces and self.model.decode_rows is None
                                and self._mixed_rows_exact(max(config.mixed_rederive_pieces)))
        self.fingerprint = fingerprint
        self.weights_version = 0  # bumped by replace_weights; the fingerprint carries it
        # keep and replay the rows of prefilled tails (engine/tail_replay.py)
        self.tail_replay = config.tail_replay
        self.chunk = config.prefill_chunk  # the longest prefill piece
        self.grid = GRID  # where canonical state is kept (capsules, prefix blocks, re-runs)
        # one extra scratch slot absorbs the padding rows of captured graphs; KV keeps a chunk of slack
        # rows because a padded prefill chunk writes (ignored) KV past the last real token
        self.scratch_slot = config.slots
        layout = StateLayout.for_model(model_cfg, config.slots + 1, config.max_seq + self.chunk, self.dtype,
                                       self.device, self.tail_replay)
        self.state = StateSet(layout)
        # the rollback copies of speculating slots (engine/rollback.py), allocated once
        self.rollback = RollbackStates(self.state, min(config.speculate_slots, config.slots))
        self.prefill_s_per_token = 0.0  # a running mean of prefill cost: capsules record their recompute cost by it
        self.prefill_forwards = 0  # prefill forwards run: one a piece alone, one a group of a batched round
        # several slots' prefill pieces run as the rows of one forward, each row bitwise its solo piece
        # (tests/worker/test_append_many.py, CPU and CUDA); False runs them one slot after another (the
        # benchmarks' and tests' comparison path)
        self.batch_rows = True
        # a speculative step's positions run as the rows of one forward (HybridModel.verify), each bitwise its
        # decode step (tests/worker/test_verify_forward.py); False runs a decode step per position (the
        # reference). On the CPU only where row_linear gives every row a one-row GEMM's bits for this model
        self.verify_in_one_forward = cuda or self._row_linear_exact()
        self.graphs = None
        if cuda and config.cuda_graphs:
            buckets = decode_buckets(config.decode_batches, min(config.slots, MAX_DECODE_BATCH))
            keep = self.rollback if self.rollback.capacity else None
            self.graphs = GraphPlans(self.model, self.state, self.scratch_slot, config.max_seq, self.chunk, buckets,
                                     self.grid, self.tail_replay, keep, self.rollback.scratch,
                                     config.mixed_rederive_pieces if self.mixed_steps else (),
                                     config.batched_piece_rows)
            self.graphs.capture(progress=config.progress)

    # ------------------------------------------------------------------ set-up
    def choose_decode_rows(self) -> None:
        """Run decode steps on the batch's own rows where every GEMM of this model keeps a row's bits at every
        row count up to MAX_DECODE_BATCH (model.py: batch invariance); else keep them padded to it, and say so."""
        variant = first_row_variant_gemm(self.model.gemm_weights(), MAX_DECODE_BATCH)
        if variant is None:
            self.model.decode_rows = None
            return
        shape, rows = variant
        log.warning("decode steps run padded to %d rows on %s (%s): a %s GEMM gives a row other bits at %d rows "
                    "than in a %d-row GEMM, so a step of few sessions pays for %d rows to stay batch-invariant",
                    MAX_DECODE_BATCH, self.device, self.dtype, "x".join(map(str, shape)), rows, MAX_DECODE_BATCH,
                    MAX_DECODE_BATCH)

    def _mixed_rows_exact(self, pieces: int) -> bool:
        """Whether every GEMM of this model gives a decode step's rows (up to MAX_DECODE_BATCH) and `pieces`
        re-derivation pieces' rows, computed in one GEMM, the bits of their own forwards' GEMMs."""
        variant = first_mixed_variant_gemm(self.model.gemm_weights(), MAX_DECODE_BATCH, GRID * pieces)
        if variant is not None:
            log.warning("decode steps re-derive their grid points in a forward of their own on %s (%s): a %s GEMM "
                        "gives a row other bits in a %s-row GEMM than in its own forward's", self.device, self.dtype,
                        "x".join(map(str, variant[0])), variant[1])
        return variant is None

    def _row_linear_exact(self) -> bool:
        variant = first_row_linear_variant(self.model.gemm_weights(), MAX_DECODE_BATCH)
        if variant is not None:
            log.warning("speculative steps verify one decode step per position on this CPU: a batched one-row GEMM "
                        "(numerics.row_linear) gives other bits than a one-row GEMM for a %s weight",
                        "x".join(map(str, variant)))
        return variant is None

    def _kernels(self, config: EngineConfig):
        if self.device.type != "cuda" or config.kernels == "reference":
            return ops.reference_kernels()
        check_copy_pairs(self.device)  # restores move every capsule byte through it
        large_moe_tiles = True
        if self.model_cfg.is_moe:
            from capsulert.kernels import triton_moe  # triton: a CUDA install's only

            large_moe_tiles = triton_moe.tiles_agree(self.dtype, self.device)
            if not large_moe_tiles:
                log.warning("the MoE expert GEMMs give other bits with 64-row tiles than with 16-row tiles on %s "
                            "(%s): every piece runs 16-row tiles, so long prefills of this MoE model are slower "
                            "(up to ~2.5x in the expert GEMMs), and exact", torch.cuda.get_device_name(self.device),
                            self.dtype)
        return ops.cuda_kernels(use_fla=config.kernels != "triton", large_moe_tiles=large_moe_tiles)

    # ------------------------------------------------------------------ weights
    def replace_weights(self, new: dict[str, torch.Tensor], fingerprint: str, version: int) -> None:
        """Copy checked weights into the model's tensors in place (the buffers stay: captured graphs stay
        valid) and take their identity."""
        with torch.inference_mode():
            for name, t in new.items():
                self.model_weights[name].copy_(t)
            self.model.refresh_derived()
        self.weights_version, self.fingerprint = version, fingerprint

    # ------------------------------------------------------------------ slots
    def slot_ids(self, slots: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(slots), device=self.device)

    def reset_slot(self, slot: int) -> None:
        """An empty slot: zero recurrent and conv state (live and grid), the hidden states (last and at its grid
        point: nothing of the slot's previous session is read as this one's), position 0."""
        st = self.state
        for name in ("ssm", "conv", "ssm_grid", "conv_grid", "grid_hidden", "last_hidden"):
            st.slot_view(name, slot).zero_()
        st.pos[slot] = 0

    def kv_len(self, end: int) -> int:
        return min(self.config.max_seq, -(-end // self.chunk) * self.chunk)

    # ------------------------------------------------------------------ prefill
    def prefill(self, slot: int, tokens: list[int], start: int, replay: int = 0) -> bool:
        """Run tokens at positions [start, start+len) in prefill pieces (prefill_pieces); the slot's live state
        must be at start, or with `replay` at start - replay, whose tokens the linear-attention layers of the
        first piece replay from the slot's tail buffers (engine/tail_replay.py). The state at the last grid
        point reached becomes the slot's grid checkpoint, the tokens past it the slot's tail. True when that grid
        point fell inside the last piece: state.grid_hidden then holds the hidden state before it."""
        if self.graphs is None:
            slots = self.slot_ids([slot])
            ids = torch.tensor(tokens, device=self.device)
        end = start + len(tokens)
        pieces = prefill_pieces(start - replay, end, self.chunk,
                                None if self.graphs is None else self.graphs.prefill_sizes)
        pieces[0] = (start, pieces[0][1])
        # a bar only for long prefills: a short one ends before any bar would show
        bar = progress_bar(len(pieces), "capsulert: prefill", unit="chunk",
                           progress=self.config.progress if len(pieces) > LONG_PREFILL_CHUNKS else False)
        # on CUDA the chunks are queued at once: a drawn bar waits for each, or it would fill before the work
        pace = not bar.disable and self.device.type == "cuda"
        t0 = time.perf_counter()
        with bar:
            for i, (a, b) in enumerate(pieces):
                # the state at end's last grid point is the slot's checkpoint, kept inside the last piece
                at = grid_point_inside(a, b, self.grid) if b == end else None
                r = replay if i == 0 else 0
                # the last piece's rows past its last grid point (in the linear layers' piece, which starts r
                # earlier) are the slot's tail
                tail_from = b // self.grid * self.grid - (a - r) if self.tail_replay and b == end else None
                self.prefill_forwards += 1
                if self.graphs is not None:
                    self.graphs.prefill(slot, tokens[a - start:b - start], grid_at=at, replay=r, tail_from=tail_from)
                else:
                    self._forward_piece(slots, ids[a - start:b - start], a, at, r, tail_from)
                if b % self.grid == 0:
                    self.state.save_grid(slot)
                if pace:
                    torch.cuda.synchronize(self.device)
                bar.update()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        per_token = (time.perf_counter() - t0) / len(tokens)
        self.prefill_s_per_token = per_token if not self.prefill_s_per_token else 0.9 * self.prefill_s_per_token + 0.1 * per_token
        return at is not None

    def _forward_piece(self, slots: torch.Tensor, ids: torch.Tensor, a: int, at: int | None, replay: int,
                       tail_from: int | None) -> None:
        """One prefill piece through the model (no graphs); on CPU padded to whole cpu_piece_rows."""
        n = ids.shape[0]
        step = self.cpu_piece_rows
        rows = -(-n // step) * step if step is not None else n
        extra = dict(grid_at=at, replay=replay or None, tail_from=tail_from)
        if rows == n:
            self.model.forward(self.state, slots, ids[None], self.kv_len(a + n), **extra)
        else:
            padded = torch.cat([ids, ids.new_zeros(rows - n)])[None]
            valid = torch.tensor([n], device=self.device)
            self.model.forward(self.state, slots, padded, self.kv_len(a + rows), valid=valid, **extra)

    def prefill_from_grid(self, runs: list[tuple[int, list[int], int, int]]) -> list[bool]:
        """Several slots' prefills in one forward per round of pieces: run (slot, tokens, start, replay) puts
        tokens at [start, start+len), the slot's live state at start - replay, a grid point, whose `replay`
        tokens the linear-attention layers of its first piece replay from the slot's tail buffers, as `prefill`
        does (0: start is the grid point). Each run is cut into pieces as `prefill` cuts it (prefill_pieces);
        round k runs every run's k-th piece together, one row a run, padded to the round's longest (CPU: to
        whole cpu_piece_rows) with per-row valid lengths, start positions, replayed rows and grid points. Every
        op gives a row the same bits whatever else the forward holds (GEMM rows are split-invariant; attention,
        the conv and the gated delta rule run per row), so each slot ends bitwise where `prefill` alone leaves
        it. Per run: True when its last piece crossed a grid point strictly inside (state.grid_hidden then
        holds the hidden state before it)."""
        if not self.batch_rows:
            return [self.prefill(slot, tokens, start, replay) for slot, tokens, start, replay in runs]
        pieces = []
        for _, tokens, start, replay in runs:
            cut = prefill_pieces(start - replay, start + len(tokens), self.chunk)
            cut[0] = (start, cut[0][1])
            pieces.append(cut)
        crossed = [False] * len(runs)
        t0 = time.perf_counter()
        for k in range(max(len(p) for p in pieces)):
            rows = [(j, *pieces[j][k]) for j in range(len(runs)) if k < len(pieces[j])]
            ats = []
            for j, a, b in rows:
                slot, tokens, start, _ = runs[j]
                end = start + len(tokens)
                at = grid_point_inside(a, b, self.grid) if b == end else None
                ats.append(at)
                if b == end:
                    crossed[j] = at is not None
            # a forward pads its pieces to the longest: pieces of very different lengths go in more than one
            for group in split_by_length([b - a for _, a, b in rows]):
                self._forward_rows([(runs[j][0], runs[j][1][a - runs[j][2]:b - runs[j][2]], a,
                                     runs[j][3] if k == 0 else 0) for j, a, b in (rows[i] for i in group)],
                                   [ats[i] for i in group])
            for j, a, b in rows:
                if b % self.grid == 0:
                    self.state.save_grid(runs[j][0])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        per_token = (time.perf_counter() - t0) / sum(len(tokens) for _, tokens, _, _ in runs)
        self.prefill_s_per_token = per_token if not self.prefill_s_per_token else 0.9 * self.prefill_s_per_token + 0.1 * per_token
        return crossed

    def _forward_rows(self, rows: list[tuple[int, list[int], int, int]], ats: list[int | None]) -> None:
        """One forward of prefill pieces (slot, tokens, start, replay: the linear layers' piece starts `replay`
        rows early, on the grid) of several slots, each padded to the longest; `ats`: each piece's inner grid
        point (None: none, as 0: the state where the layers' pieces start, which is the slot's grid checkpoint
        already). A captured graph of the batch's shape runs it where one holds it (GraphPlans.pieces), else an
        eager forward of the same inputs."""
        self.prefill_forwards += 1
        slots = [slot for slot, _, _, _ in rows]
        pieces = [tokens for _, tokens, _, _ in rows]
        grid_at = [at or 0 for at in ats]
        replay = [r for _, _, _, r in rows] if any(r for _, _, _, r in rows) else None
        # the rows past a piece's last grid point become its slot's tail (engine/tail_replay.py), counted in the
        # linear layers' piece
        tail_from = [(a + len(tokens)) // self.grid * self.grid - (a - r) for _, tokens, a, r in rows
                     ] if self.tail_replay else None
        n = max(len(tokens) for tokens in pieces)
        if self.graphs is not None and self.graphs.pieces_shape(len(rows), n) is not None:
            self.graphs.pieces(slots, pieces, grid_at, replay, tail_from)
            return
        step = self.cpu_piece_rows
        if step is not None:
            T = -(-n // step) * step
        elif self.graphs is not None:
            # the graphs' token buckets: the kernels compiled at capture, not a compile per new piece length
            # (seconds, paid by every session of the forward); padding rows change no bit of a real one
            T = next((t for t in self.graphs.prefill_sizes if t >= n), n)
        else:
            T = n
        ids = torch.tensor([tokens + [0] * (T - len(tokens)) for tokens in pieces])
        dev = self.device
        # the same inputs a graph takes (a grid point for every row, 0 where none is inside), so this path
        # checks the graphs' numerics on any device
        self.model.forward(self.state, self.slot_ids(slots), ids.to(dev), self.kv_len(max(a for _, _, a, _ in rows) + T),
                           valid=torch.tensor([len(t) for t in pieces], device=dev),
                           grid_at=torch.tensor(grid_at, device=dev),
                           replay=None if replay is None else torch.tensor(replay, device=dev),
                           tail_from=None if tail_from is None else torch.tensor(tail_from, device=dev))

    def prefill_grid_rows(self, slots: list[int], rows: list[list[int]], end: int) -> None:
        """One batched prefill of GRID tokens for each slot, every slot's live state at its previous grid
        point (a row's bits do not depend on the other rows: split-invariant prefill); `end`: the furthest
        position any row reaches."""
        if self.graphs is not None:
            self.graphs.prefill_rows(slots, rows)
        else:
            ids = torch.tensor(rows, device=self.device)
            self.model.forward(self.state, self.slot_ids(slots), ids, self.kv_len(end))

    # ------------------------------------------------------------------ decode
    def decode_rederiving(self, slots: list[int], tokens: list[int], grid_slots: list[int],
                          grid_rows: list[list[int]], end: int) -> torch.Tensor:
        """A decode step of `slots` fed `tokens` and the grid re-derivation of `grid_slots`, each slot's live
        state at its previous grid point and grid_rows[i] the GRID tokens from there (`end`: the furthest
        position one reaches), at most MAX_DECODE_BATCH of each. One forward where `mixed_steps` holds, for up
        to the largest of EngineConfig.mixed_rederive_pieces re-derivations (with graphs: the smallest captured
        count that holds them); else a decode step and a batched re-derivation. The same bits either
        way. Their next-token logits [len(slots) + len(grid_slots), vocab]: the step's slots first."""
        n, m = len(slots), len(grid_slots)
        # the start-up check covered the rows of up to the largest count of pieces
        if n and m and self.mixed_steps and m <= max(self.config.mixed_rederive_pieces):
            if self.graphs is None:
                self.model.step_with_pieces(self.state, self.slot_ids(slots), torch.tensor(tokens, device=self.device),
                                            self.slot_ids(grid_slots), torch.tensor(grid_rows, device=self.device),
                                            self.config.max_seq)
                return self.model.logits(self.state, self.slot_ids(list(slots) + list(grid_slots)))
            if self.graphs.mixed_shape(n, m) is not None:
                return self.graphs.mixed(slots, tokens, grid_slots, grid_rows)
        parts = [self.decode(slots, tokens)[:n]] if n else []
        if m:
            self.prefill_grid_rows(grid_slots, grid_rows, end)
            parts += [torch.stack(self.logits_rows(grid_slots))]
        return torch.cat(parts)

    def decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        """Feed one token to each slot (one batched step); their next-token logits, row r for slots[r] (the
        graph's output buffer on CUDA: read or copy before the next step)."""
        if self.graphs is not None:
            return self.graphs.decode(slots, tokens)
        ids = self.slot_ids(slots)
        # kv_len is a shape: the same for every batch, so attention's launch never depends on the batch
        self.model.forward(self.state, ids, torch.tensor(tokens, device=self.device)[:, None], self.config.max_seq,
                           decode=True)
        return self.model.logits(self.state, ids)

    def verify(self, slots: list[int], fed: list[list[int]]) -> list[torch.Tensor]:
        """Feed fed[i] (one token, or a sampled token and its drafts) to slots[i] at its next positions, with
        decode's own numerics: each position's logits and state are bitwise what plain decode computes there,
        alone or batched (batch invariance). A slot fed several tokens keeps its state after each of them but
        the last (RollbackStates, which those slots must have been `assign`ed to), so `roll_back` can take it
        back to any of them. Returns each slot's logits rows [len(fed[i]), vocab] (fp32 copies). No position may
        reach past the slot's next grid point (a decode step that reaches one is re-derived through the prefill
        path: the caller does that once it knows what it keeps).

        Every fed position of a group of slots is a row of one forward (HybridModel.verify: one pass of the
        weights for all of them), groups holding at most MAX_DECODE_BATCH rows; with `verify_in_one_forward`
        off, or where that forward cannot keep this layout's rollback state, one decode step per position
        (verify_stepwise, the reference)."""
        if not (self.verify_in_one_forward and self.rollback.keeps_in_forward):
            return self.verify_stepwise(slots, fed)
        out: list[torch.Tensor] = []
        for group in verify_groups(fed):
            gs, gf = [slots[i] for i in group], [fed[i] for i in group]
            if max(len(f) for f in gf) == 1:  # nothing drafted: a decode step
                logits, at = self.decode(gs, [f[0] for f in gf]), list(range(len(gs)))
            elif self.graphs is not None and self.graphs.verify_shape(gf) is not None:
                logits, width = self.graphs.verify(gs, gf, self.rollback.set_of)
                at = [i * width for i in range(len(gs))]
            else:
                rows = verify_rows(gs, gf, self.rollback.set_of, self.device)
                logits = self.model.verify(self.state, rows, self.config.max_seq, self.rollback)
                at = [sum(len(f) for f in gf[:i]) for i in range(len(gs))]
            out += [logits[a:a + len(f)].clone() for a, f in zip(at, gf)]
        return out

    def verify_stepwise(self, slots: list[int], fed: list[list[int]]) -> list[torch.Tensor]:
        """`verify` one batched decode step per position (`decode`): position t of every slot that has one is
        one step; the state kept after each with RollbackStates.keep."""
        rows: list[list[torch.Tensor]] = [[] for _ in slots]
        for t in range(max(len(f) for f in fed)):
            wave = [i for i, f in enumerate(fed) if len(f) > t]
            logits = self.decode([slots[i] for i in wave], [fed[i][t] for i in wave])
            for r, i in enumerate(wave):
                rows[i].append(logits[r].clone())  # the graph's output buffer is overwritten by the next step
                if len(fed[i]) > t + 1:
                    self.rollback.keep(slots[i], t)
        return [torch.stack(r) for r in rows]

    def roll_back(self, slot: int, position: int) -> None:
        """The slot's state goes back to where `verify` left it after its `position`-th token (0-based)."""
        self.rollback.restore(slot, position)
    def mtp_draft(self, slots: Sequence[int], tokens: Sequence[int], k: int) -> torch.Tensor:
        """k draft tokens per slot from the MTP head: [len(slots), k] (int64, on the device), row r for
        slots[r]. tokens[r] is slots[r]'s next token, not fed yet (what decode would feed next); the head runs
        k times chained, each step on its previous output and greedy token (engine/mtp.py).

        Leaves no trace in committed state: it writes only the head's cache rows from the slot's length on
        (scratch: the next prefill or decode step writes its own rows there before anything reads them), and
        no position, hidden state or recurrent state. Each row is what the slot gets drafting alone (batch
        invariance, as decode). NoMtpHeadError on a model without a head; InvalidRequestError for k outside
        [1, MAX_DRAFT_TOKENS], a slot without tokens, or a token outside the vocabulary."""
        if self.mtp is None:
            raise NoMtpHeadError("this model has no MTP head (no mtp.* weights, or a config without "
                                 "mtp_num_hidden_layers): it cannot draft")
        slots, tokens = list(slots), list(tokens)
        if len(tokens) != len(slots) or not slots:
            raise InvalidRequestError(f"mtp_draft takes one next token per slot, got {len(tokens)} for {len(slots)}")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.model_cfg.vocab_size for t in tokens):
            raise InvalidRequestError(f"mtp_draft tokens must be ids in [0, {self.model_cfg.vocab_size})")
        check_draft(k, [int(n) for n in self.state.pos[self.slot_ids(slots)].tolist()])
        rows = []
        for group in decode_groups(list(zip(slots, tokens))):
            rows.append(self.mtp.draft(self.state, self.slot_ids([s for s, _ in group]),
                                       torch.tensor([t for _, t in group], device=self.device), k, self.config.max_seq))
        return torch.cat(rows)

    @property
    def has_mtp(self) -> bool:
        return self.mtp is not None

    def logits_rows(self, slots: Sequence[int]) -> list[torch.Tensor]:
        """Each slot's next-token logits row (fp32 [vocab]) from its last hidden state, computed on the
        batch-invariant path."""
        rows = []
        for group in decode_groups(list(slots)):
            block = self.model.logits(self.state, self.slot_ids(group))
            rows += [block[r] for r in range(len(group))]
        return rows

    def pad_logits(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """Stack logits rows into the fixed-shape block the sampler runs on (batch invariance)."""
        block = torch.stack(rows)
        return pad_rows(block, MAX_DECODE_BATCH) if self.device.type == "cuda" else block


def probe_weight(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """The weight check_split_invariant_gemm probes: an output projection (4096x4096 on the 9B shape), the
    shape where split-K showed first on the H200 with default cuBLAS settings."""
    for i, kind in enumerate(cfg.layer_types):
        name = f"model.layers.{i}.self_attn.o_proj.weight" if kind == FULL else f"model.layers.{i}.linear_attn.out_proj.weight"
        if name in weights:
            return weights[name]
    return weights["model.embed_tokens.weight"]
