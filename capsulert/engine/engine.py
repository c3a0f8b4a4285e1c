"""Engine: owns the model, the state set, the capsule store and the slots; runs every verb.

Canonical grid state on the 64-token grid (GRID, the gated delta rule's chunk): the slot keeps its recurrent
and conv state at its last grid point G = floor(len / 64) * 64, and an append re-runs the < 64 tokens since
G with the new ones. Prefill is split-invariant (every op gives a row the same bits whatever piece it is
computed in, kernels/), and pieces start on the grid, so appends split anywhere, prefill pieces of any size
and a cold prefill give bitwise the same state at every grid point and the same logits. `prefill_chunk` is
only the longest piece (speed): a prefill is cut at its multiples and at the new grid point. Decode steps
several slots at once; when decode reaches a grid point the last 64 tokens are re-derived through the prefill
path, so the state at every grid point is the one a cold prefill computes, whatever produced the tokens.

Long work shows a progress bar on a terminal (EngineConfig.progress, capsulert/progress.py): loading the
weights, capturing the graphs, and a prefill of more than LONG_PREFILL_CHUNKS chunks in one call.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import torch
from pydantic import ValidationError

from capsulert.kernels.gated_delta import GATED_DELTA_CHUNK
from capsulert.config.model import FULL, ModelConfig
from capsulert.progress import progress_bar
from capsulert.errors import (
    ConfigError,
    ExceedsCapacityError,
    ForeignSessionError,
    InvalidRequestError,
    NoFreeSlotError,
    WeightUpdateError,
)
from capsulert.config.engine import RANDOM_PREFIX, EngineConfig
from capsulert.engine.model import HybridModel, pad_rows
from capsulert.engine.numerics import (
    CPU_PIECE_ROWS_CHOICES, check_split_invariant_gemm, configure_cuda, cpu_piece_rows, first_row_variant_gemm)
from capsulert.engine.capsules import Replay
from capsulert.chat.prompt import ChatRenderer
from capsulert.engine.grammar import Grammars
from capsulert.engine.decoding import DecodeStream, advance
from capsulert.protocol.sampling import SamplingParams
from capsulert.engine.session import Session
from capsulert.engine.state import StateLayout, StateSet
from capsulert.engine.stops import eos_ids_from_checkpoint
from capsulert.engine.token_codec import TokenCodec
from capsulert.protocol.requests import Snapshot
from capsulert.protocol.results import GenerateResult

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


def _token_text(tokenizer, ids: Sequence[int]) -> str | None:
    """The text of the first EOS token (chat templates write it), None without a tokenizer or an EOS."""
    return tokenizer.id_to_token(ids[0]) if tokenizer is not None and ids else None


class Restored(NamedTuple):
    """What restore_sessions made: the sessions, and the tier the capsule was read from."""
    sessions: list[Session]
    tier: str


class Engine:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 tokenizer=None, fingerprint: str = "", eos_token_ids: tuple[int, ...] | None = None,
                 model_dir: Path | None = None):
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
            check_split_invariant_gemm(self.probe_weight(weights, model_cfg))
            if model_cfg.is_moe and config.prefill_chunk < MOE_PREFILL_CHUNK:
                log.info("prefill_chunk=%d on an MoE model: every prefill piece reads the weights of each expert its "
                         "tokens chose (nearly all of them for a long piece); prefill_chunk=%d makes a long cold "
                         "prefill up to ~1.5x faster on an H200 (bench/RESULTS.md)", config.prefill_chunk,
                         MOE_PREFILL_CHUNK)
        else:
            self.cpu_piece_rows = cpu_piece_rows(self.probe_weight(weights, model_cfg))
            if self.cpu_piece_rows > CPU_PIECE_ROWS_CHOICES[0]:
                log.info("CPU prefill pieces run on whole %d-row multiples: this machine's BLAS gives a row other "
                         "bits in shorter pieces", self.cpu_piece_rows)
        self.model = HybridModel(model_cfg, weights, self._kernels(config),
                                 decode_rows=MAX_DECODE_BATCH if cuda else None, rowwise=not cuda)
        if cuda:
            self._choose_decode_rows()
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.weights_version = 0  # bumped by update_weights; the fingerprint carries it
        # generate stops at these unless SamplingParams.ignore_eos (config.json + generation_config.json)
        self.eos_token_ids = eos_token_ids if eos_token_ids is not None else (
            () if model_cfg.eos_token_id is None else (model_cfg.eos_token_id,))
        # text, token ids and chat prompts (rendered by the checkpoint's chat template in model_dir)
        self.codec = TokenCodec(tokenizer, model_cfg.vocab_size, config.max_seq,
                                ChatRenderer(model_dir, tokenizer, _token_text(tokenizer, self.eos_token_ids)))
        self.grammars = Grammars(tokenizer, model_cfg.vocab_size, self.eos_token_ids)  # constrained decoding
        # keep and replay the rows of prefilled tails (engine/tail_replay.py): on the CPU unless asked otherwise
        self.tail_replay = config.tail_replay if config.tail_replay is not None else not cuda
        self.chunk = config.prefill_chunk  # the longest prefill piece
        self.grid = GRID  # where canonical state is kept (capsules, prefix blocks, re-runs)
        # one extra scratch slot absorbs the padding rows of captured graphs; KV keeps a chunk of slack
        # rows because a padded prefill chunk writes (ignored) KV past the last real token
        self.scratch_slot = config.slots
        layout = StateLayout.for_model(model_cfg, config.slots + 1, config.max_seq + self.chunk, self.dtype, self.device,
                                       self.tail_replay)
        self.state = StateSet(layout)
        self._free = list(range(config.slots))
        self._sessions: dict[int, Session] = {}
        self._lock = threading.RLock()
        self._slot_freed = threading.Condition(self._lock)
        self.prefill_s_per_token = 0.0  # a running mean of prefill cost: capsules record their recompute cost by it
        from capsulert.engine.capsules import CapsuleVerbs

        self.capsules = CapsuleVerbs(self)
        self.graphs = None
        if self.device.type == "cuda" and config.cuda_graphs:
            from capsulert.engine.graphs import GraphPlans, decode_buckets

            buckets = decode_buckets(config.decode_batches, min(config.slots, MAX_DECODE_BATCH))
            self.graphs = GraphPlans(self.model, self.state, self.scratch_slot, config.max_seq, self.chunk, buckets,
                                     self.grid, self.tail_replay)
            self.graphs.capture(progress=config.progress)

    def _choose_decode_rows(self) -> None:
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

    @staticmethod
    def probe_weight(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
        """The weight check_split_invariant_gemm probes: an output projection (4096x4096 on the 9B shape), the
        shape where split-K showed first on the H200 with default cuBLAS settings."""
        for i, kind in enumerate(cfg.layer_types):
            name = f"model.layers.{i}.self_attn.o_proj.weight" if kind == FULL else f"model.layers.{i}.linear_attn.out_proj.weight"
            if name in weights:
                return weights[name]
        return weights["model.embed_tokens.weight"]

    def _kernels(self, config: EngineConfig):
        from capsulert.kernels import ops

        if self.device.type != "cuda" or config.kernels == "reference":
            return ops.reference_kernels()
        from capsulert.kernels.triton_copy import check_copy_pairs

        check_copy_pairs(self.device)  # restores move every capsule byte through it
        large_moe_tiles = True
        if self.model_cfg.is_moe:
            from capsulert.kernels import triton_moe

            large_moe_tiles = triton_moe.tiles_agree(self.dtype, self.device)
            if not large_moe_tiles:
                log.warning("the MoE expert GEMMs give other bits with 64-row tiles than with 16-row tiles on %s "
                            "(%s): every piece runs 16-row tiles, so long prefills of this MoE model are slower "
                            "(up to ~2.5x in the expert GEMMs), and exact", torch.cuda.get_device_name(self.device),
                            self.dtype)
        return ops.cuda_kernels(use_fla=config.kernels != "triton", large_moe_tiles=large_moe_tiles)

    @classmethod
    def from_config(cls, config: EngineConfig | dict | None = None, **overrides) -> "Engine":
        from capsulert.engine.default_model import ensure_default_model
        from capsulert.engine.fingerprint import checkpoint_fingerprint
        from capsulert.engine.loader import load_checkpoint, load_tokenizer

        try:
            if config is None or isinstance(config, dict):
                config = EngineConfig(**{**(config or {}), **overrides})
            elif isinstance(config, EngineConfig):
                if overrides:
                    config = EngineConfig(**{**config.model_dump(), **overrides})
            else:
                raise ConfigError(f"config must be an EngineConfig, a dict or None, got {type(config).__name__}")
        except ValidationError as e:
            raise ConfigError(f"invalid engine config: {e.error_count()} error(s): "
                              + "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())) from None
        device = config.torch_device()
        dtype = config.torch_dtype(device)
        if config.model.startswith(RANDOM_PREFIX):
            return cls._random(config, device, dtype)
        if config.model == "default":
            path = ensure_default_model(Path(config.cache_dir) if config.cache_dir else None, config.progress)
        else:
            path = Path(config.model)
        model_cfg, weights = load_checkpoint(path, dtype=dtype, device=device, progress=config.progress)
        fingerprint = f"{checkpoint_fingerprint(path, progress=config.progress)}:{dtype}".replace("torch.", "")
        return cls(config, model_cfg, weights, load_tokenizer(path), fingerprint,
                   eos_ids_from_checkpoint(path, model_cfg.eos_token_id), model_dir=path)

    @classmethod
    def _random(cls, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> "Engine":
        """Deterministic random weights for an architecture YAML, generated on the device (benchmarks)."""
        import hashlib

        from capsulert.engine.default_model import SEED, init_weights
        from capsulert.engine.loader import expected_shapes

        model_cfg = ModelConfig.from_file(config.model[len(RANDOM_PREFIX):])
        with progress_bar(len(expected_shapes(model_cfg)), "capsulert: random weights", progress=config.progress,
                          unit="tensor") as bar:
            weights = init_weights(model_cfg, SEED, device=device, dtype=dtype, on_tensor=bar.update)
        digest = hashlib.sha256(json.dumps(model_cfg.to_hf_dict(), sort_keys=True).encode()).hexdigest()
        fingerprint = f"random-{SEED}-{digest}-{device.type}:{dtype}".replace("torch.", "")
        return cls(config, model_cfg, weights, None, fingerprint)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close every session and the capsule store (pending disk writes finish; its disk_dir lock is
        released, so another engine may take the directory). The engine is unusable afterwards."""
        with self._lock:
            self.prefix.enabled = False  # closing sessions keep nothing: the store goes next
            for s in list(self._sessions.values()):
                self.release(s)
            self.store.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ sessions
    def open(self, wait_s: float | None = None, *, prompt=None, namespace: str | None = "default") -> Session:
        """A new session, empty or prefilled with `prompt` (with EngineConfig.prefix_cache, the longest
        cached grid prefix of it in `namespace` is restored and only the rest prefilled; namespace None:
        no prefix reuse). With every slot taken, waits up to wait_s seconds (default 0: a blocking call
        in a thread that holds the slots would wait for itself; the step scheduler's requests queue for up
        to the config's slot_wait_s) for one to be released, then raises NoFreeSlotError."""
        with self._lock:
            session = self._take_slots(1, wait_s)[0]
            self.prefix.opened(session, namespace)
            if prompt is not None:
                try:
                    self.append(session, prompt)
                except BaseException:
                    self.release(session)
                    raise
            return session

    def _take_slots(self, n: int, wait_s: float | None = None, reset: bool = True) -> list[Session]:
        """Claim n slots. reset=False when a restore overwrites every state buffer of the slot next."""
        wait_s = 0.0 if wait_s is None else wait_s
        if n > self.config.slots:  # could never start: refused at once, whatever the wait
            raise ExceedsCapacityError(f"{n} slot(s) needed at once but the engine has {self.config.slots}; "
                                       "ask for fewer or raise `slots`")
        deadline = time.monotonic() + wait_s
        while n > len(self._free):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NoFreeSlotError(
                    f"{n} slot(s) needed, {len(self._free)} free of {self.config.slots}"
                    + (f" after waiting {wait_s:g} s" if wait_s else "") + "; close sessions or raise `slots`"
                )
            self._slot_freed.wait(remaining)  # releases the engine lock while it waits
        sessions = []
        for _ in range(n):
            slot = self._free.pop(0)
            if reset:
                self._reset_slot(slot)
            s = Session(self, slot)
            self._sessions[slot] = s
            sessions.append(s)
        return sessions

    def _reset_slot(self, slot: int) -> None:
        st = self.state
        for name in ("ssm", "conv", "ssm_grid", "conv_grid"):
            st.slot_view(name, slot).zero_()
        st.pos[slot] = 0

    def release(self, session: Session) -> None:
        with self._lock:
            self._own(session)
            self.prefix.closing(session)  # may keep its last grid checkpoint (prefix cache)
            session.closed = True
            del self._sessions[session.slot]
            self._free.append(session.slot)
            self._free.sort()
            self._slot_freed.notify_all()

    @property
    def lock(self) -> threading.RLock:
        """The engine's re-entrant lock. Every verb holds it; hold it yourself to run several steps as one
        (the step scheduler holds it for a whole decode step: sampling reads the logits a CUDA graph left
        in its static output buffer, which another thread's step would overwrite)."""
        return self._lock

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def _own(self, session: Session) -> None:
        if session.engine is not self:
            raise ForeignSessionError(f"session {session.id} belongs to another engine")
        session.check_open()

    def chat(self, messages, max_new_tokens: int = 256, sampling: SamplingParams | None = None, *,
             namespace: str | None = "default", **chat_args):
        """One chat turn on a session of its own (opened, used, closed): Session.chat's arguments and
        ChatReply. With EngineConfig.prefix_cache, the conversation's cached prefix in `namespace` is reused."""
        session = self.open(namespace=namespace)
        try:
            return session.chat(messages, max_new_tokens, sampling, **chat_args)
        finally:
            session.close()

    # ------------------------------------------------------------------ tokens
    def tokenize(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.codec.decode(tokens)

    # ------------------------------------------------------------------ prefill
    def _kv_len(self, end: int) -> int:
        return min(self.config.max_seq, -(-end // self.chunk) * self.chunk)

    def _run_prefill(self, slot: int, tokens: list[int], start: int, replay: int = 0) -> bool:
        """Run tokens at positions [start, start+len) in prefill pieces (prefill_pieces); the slot's live state
        must be at start, or with `replay` at start - replay, whose tokens the linear-attention layers of the
        first piece replay from the slot's tail buffers (engine/tail_replay.py). The state at the last grid
        point reached becomes the slot's grid checkpoint, the tokens past it the slot's tail. True when that grid
        point fell inside the last piece: state.grid_hidden then holds the hidden state before it."""
        if self.graphs is None:
            slots = torch.tensor([slot], device=self.device)
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
            self.model.forward(self.state, slots, ids[None], self._kv_len(a + n), **extra)
        else:
            padded = torch.cat([ids, ids.new_zeros(rows - n)])[None]
            valid = torch.tensor([n], device=self.device)
            self.model.forward(self.state, slots, padded, self._kv_len(a + rows), valid=valid, **extra)

    def append(self, session: Session, tokens_or_text) -> torch.Tensor:
        with self._lock:
            self._own(session)
            session.check_current()
            new = self.codec.validate(tokens_or_text, self.config.max_seq - len(session.tokens))
            # a cached prefix restored: only the rest is new
            self.append_checked(session, self.prefix.before_append(session, new))
            return self.logits(session)

    def append_checked(self, session: Session, ids: list[int]) -> None:
        """Append token ids checked already (TokenCodec.validate, the session's room included), computing no
        logits: the step scheduler's prefill pieces, whose tokens were checked once when the request's
        prefill began (after reuse_prefix, which plans the prefix cache's checkpoints they are cut at)."""
        with self._lock:
            self._own(session)
            session.check_current()
            for piece in self.prefix.pieces(session, ids):  # cut where checkpoints are to be kept
                grid_hidden = self._extend(session, piece)
                self.prefix.reached(session, grid_hidden)

    def reuse_prefix(self, session: Session, tokens: list[int]) -> list[int]:
        """Restore the longest cached grid prefix of the session's tokens + `tokens` (prefix cache); the
        tokens left to append. For callers that append in pieces (the step scheduler)."""
        with self._lock:
            self._own(session)
            session.check_current()
            return self.prefix.before_append(session, tokens)

    def _extend(self, session: Session, new: list[int]) -> bool:
        """Append `new`; True when state.grid_hidden holds the hidden state before the new grid point."""
        P = len(session.tokens)
        G = P // self.grid * self.grid
        E = G
        if P != G:
            # from the grid checkpoint, as a cold prefill does: the tail [G, E) the slot keeps rows for is
            # replayed in the linear-attention layers, [E, P) (decoded, or nothing kept) re-run in full
            E = self.replayable_end(session)
            self.state.load_grid(session.slot)
            self.state.pos[session.slot] = E
        grid_hidden = self._run_prefill(session.slot, session.tokens[E:] + new, E, replay=E - G)
        session.tokens.extend(new)
        session.decoded_from = len(session.tokens)
        session.tail_end = len(session.tokens)
        return grid_hidden

    def replayable_end(self, session: Session) -> int:
        """How far past its grid point G the session's tail buffers hold its prefilled tokens, the tail an
        append replays (G: none)."""
        P = len(session.tokens)
        G = P // self.grid * self.grid
        t = session.tail_end
        prefilled = session.decoded_from if session.decoded_from is not None else G
        if self.tail_replay and t is not None and t // self.grid * self.grid == G and G < t <= min(P, prefilled):
            return t
        return G

    def logits(self, session: Session) -> torch.Tensor:
        self._own(session)
        session.check_current()
        if not session.tokens:
            raise InvalidRequestError("an empty session has no next-token logits; append a prompt first")
        return self.model.logits(self.state, self._slot_ids([session]))[0]

    # ------------------------------------------------------------------ decode
    def generate(self, sessions: Sequence[Session], max_new_tokens: int,
                 sampling: Sequence[SamplingParams | None] | None = None,
                 should_stop: Callable[[Session], bool] | None = None) -> list[GenerateResult]:
        """Sample for several sessions together, one batched decode step per token (groups of at most
        MAX_DECODE_BATCH sessions per step). Each result is the list of generated tokens, with their
        logprobs, the text and the stop reason (EOS, stop ids / strings, length, max_seq, interrupted). A session stops at the next
        token boundary once `session.interrupt()` was called during this generate, or once
        `should_stop(session)`, asked after every token, returns True. Each session's tokens and logits are
        bitwise those it gets alone."""
        sessions, params = self.check_generate(sessions, max_new_tokens, sampling)
        with self._lock:
            if len({id(s) for s in sessions}) != len(sessions):
                raise InvalidRequestError("a session appears twice in one generate call")
            for s in sessions:
                self._own(s)
                if not s.tokens:
                    raise InvalidRequestError(f"session {s.id} is empty; append a prompt before generating")
                s.interrupt_requested = False
                s.stop_reason = None
            streams = [DecodeStream(self, s, max_new_tokens, p) for s, p in zip(sessions, params)]

            def stop(st: DecodeStream) -> bool:
                return st.session.interrupt_requested or (should_stop is not None and should_stop(st.session))
            while any(not st.done for st in streams):
                advance(self, streams, stop, events=False)  # the results carry everything: no events to build
            return [st.result for st in streams]

    @staticmethod
    def check_generate(sessions, max_new_tokens, sampling) -> tuple[list[Session], list[SamplingParams | None]]:
        """Typed refusals of generate's arguments (before any state changes)."""
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
            raise InvalidRequestError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if isinstance(sessions, Session) or not isinstance(sessions, Sequence):
            raise InvalidRequestError("generate takes a list of sessions")
        sessions = list(sessions)
        if not sessions:
            raise InvalidRequestError("generate needs at least one session")
        for s in sessions:
            if not isinstance(s, Session):
                raise InvalidRequestError(f"generate takes Session objects, got {type(s).__name__}")
        sampling = list(sampling) if sampling is not None else [None] * len(sessions)
        if len(sampling) != len(sessions):
            raise InvalidRequestError("one SamplingParams per session (or None)")
        for p in sampling:
            if p is not None and not isinstance(p, SamplingParams):
                raise InvalidRequestError(f"sampling entries must be SamplingParams or None, got {type(p).__name__}")
        return sessions, sampling

    def decode_groups(self, items: list) -> list[list]:
        """Items split into decode steps of at most MAX_DECODE_BATCH."""
        return [items[a:a + MAX_DECODE_BATCH] for a in range(0, len(items), MAX_DECODE_BATCH)]

    def logits_rows(self, sessions: Sequence[Session]) -> list[torch.Tensor]:
        """Each session's next-token logits row (fp32 [vocab]), computed on the batch-invariant path."""
        rows = []
        for group in self.decode_groups(list(sessions)):
            block = self.model.logits(self.state, self._slot_ids(group))
            rows += [block[r] for r in range(len(group))]
        return rows

    def _slot_ids(self, sessions: Sequence[Session]) -> torch.Tensor:
        return torch.tensor([s.slot for s in sessions], device=self.device)

    def pad_logits(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """Stack logits rows into the fixed-shape block the sampler runs on (batch invariance)."""
        block = torch.stack(rows)
        return pad_rows(block, MAX_DECODE_BATCH) if self.device.type == "cuda" else block

    def decode(self, sessions: list[Session], tokens: list[int]) -> torch.Tensor:
        """Feed one token to each session (one batched step); returns their next-token logits, row r for
        sessions[r] (the graph's output buffer on CUDA: read or copy before the next step)."""
        if self.graphs is not None:
            logits = self.graphs.decode([s.slot for s in sessions], tokens)
        else:
            slots = self._slot_ids(sessions)
            ids = torch.tensor(tokens, device=self.device)[:, None]
            # kv_len is a shape: the same for every batch, so attention's launch never depends on the batch
            self.model.forward(self.state, slots, ids, self.config.max_seq, decode=True)
            logits = self.model.logits(self.state, slots)
        crossed = []
        for r, (s, t) in enumerate(zip(sessions, tokens)):
            s.tokens.append(t)
            if len(s.tokens) % self.grid == 0:
                crossed.append(r)
        if crossed:
            self._rederive_grid_points([sessions[r] for r in crossed])
            for r, row in zip(crossed, self.logits_rows([sessions[r] for r in crossed])):
                logits[r] = row
        return logits

    def _rederive_grid_points(self, sessions: list[Session]) -> None:
        """Decode just reached grid point G of each session: re-run [G - GRID, G) through the prefill path from
        the previous grid checkpoint, so the slot's KV rows, recurrent and conv state and last hidden state at
        G are bitwise those of a cold prefill of tokens[:G] (canonical grid state). The sessions that cross in
        one step re-derive together, one batched prefill of GRID tokens each (split-invariant prefill: a row's
        bits do not depend on the other rows)."""
        for group in self.decode_groups(sessions):
            for s in group:
                self.state.load_grid(s.slot)
                self.state.pos[s.slot] = len(s.tokens) - self.grid
            rows = [s.tokens[-self.grid:] for s in group]
            if self.graphs is not None:
                self.graphs.prefill_rows([s.slot for s in group], rows)
            else:
                ids = torch.tensor(rows, device=self.device)
                self.model.forward(self.state, self._slot_ids(group), ids, self._kv_len(max(len(s.tokens) for s in group)))
            for s in group:
                self.state.save_grid(s.slot)
                s.decoded_from = len(s.tokens)

    # ------------------------------------------------------------------ weights
    def update_weights(self, weights, *, rebuild_pinned: bool = False, version: int | None = None,
                       identity: str | None = None) -> int:
        """Replace the model's weights in place (a mapping of HF names to tensors, or a checkpoint
        directory); returns the new weights version. Checked in full before the first byte is copied
        (WeightUpdateError, engine unchanged); the buffers stay the same, so captured graphs stay valid.
        Capsules made under other weights (by this process or any other) are stale (StaleCapsuleError on
        restore) until rebuilt: the fingerprint names the weights by `identity` (engine/weights.py:
        update_identity; default a digest of a checkpoint directory, random for tensors), never by the
        counter alone. rebuild_pinned=True rebuilds the pinned ones now (RL start capsules); it needs a free
        slot, checked before anything changes (NoFreeSlotError). `version` sets the new version instead of the
        next one (a restarted worker catching up with its peers); it must be above the current one."""
        from capsulert.capsule_store.capsule import weights_fingerprint
        from capsulert.engine.weights import check_update, read_update, update_identity

        if version is not None and (isinstance(version, bool) or not isinstance(version, int)
                                    or version <= self.weights_version):
            raise WeightUpdateError(f"version must be an int above the current weights version "
                                    f"{self.weights_version}, got {version!r}")
        new = check_update(self.model_weights, read_update(weights, self.model_cfg, self.dtype, self.config.progress),
                           self.model_cfg.tie_word_embeddings)
        identity = update_identity(weights, identity)
        with self._lock:
            if rebuild_pinned and not self._free and any(i.pinned for i in self.store.list()):
                raise NoFreeSlotError("rebuild_pinned needs a free slot to re-derive the pinned capsules and every "
                                      f"one of the {self.config.slots} is held; the weights are unchanged")
            with torch.inference_mode():
                for name, t in new.items():
                    self.model_weights[name].copy_(t)
                self.model.refresh_derived()
            self.weights_version = self.weights_version + 1 if version is None else version
            self.fingerprint = weights_fingerprint(self.fingerprint, identity, self.weights_version)
            if rebuild_pinned:
                for info in self.store.list():
                    if info.pinned:
                        self.rebuild(info.name, info.namespace)
            return self.weights_version

    @property
    def weights_identity(self) -> str:
        """The identity of the weights the engine runs ("" for those it loaded)."""
        from capsulert.capsule_store.capsule import weights_identity_of

        return weights_identity_of(self.fingerprint)

    def rederive(self, session: Session) -> int:
        """Recompute a session's state from its tokens under the current weights (a stale one, open across
        an update_weights): a cold prefill of its tokens, bitwise what a new session appending them gets;
        the session's length."""
        with self._lock:
            tokens = self.begin_rederive(session)
            if tokens:
                self.append(session, tokens)
            return len(session.tokens)

    def begin_rederive(self, session: Session) -> list[int]:
        """The first half of rederive (the step scheduler prefills the tokens in pieces): the slot reset to an
        empty state under the current weights; the tokens to append again."""
        with self._lock:
            self._own(session)
            tokens = list(session.tokens)
            self._reset_slot(session.slot)
            session.tokens, session.decoded_from, session.tail_end = [], 0, None
            session.weights_version = self.weights_version
            self.prefix.rederiving(session)
            return tokens

    def truncate(self, session: Session, n: int) -> int:
        """Roll a session back to its first n tokens, bitwise the state a cold prefill of them computes (the
        same next-token logits and continuation): the slot emptied and tokens[:n] prefilled through the
        normal append path, which restores the longest cached grid prefix when the prefix cache holds one
        (grid checkpoints only: exact) and prefills the rest. n == len changes nothing; n outside
        [0, len] is InvalidRequestError with the session unchanged. The session's length."""
        with self._lock:
            self._own(session)
            session.check_current()
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(session.tokens):
                raise InvalidRequestError(f"truncate takes an int n with 0 <= n <= {len(session.tokens)} (the "
                                          f"session's length), got {n!r:.80}")
            if n < len(session.tokens):
                keep = self.begin_rederive(session)[:n]
                if keep:
                    self.append(session, keep)
            return len(session.tokens)

    def rebuild(self, name: str, namespace: str = "default"):
        """Re-derive a capsule made under older weights: prefill its own tokens under the current weights
        and replace it (same name, tier and pin). Returns the new CapsuleRef, or None when it is current."""
        with self._lock:
            info = self.store.info(name, namespace)
            if info.meta.fingerprint == self.fingerprint:
                return None
            s = self.open(namespace=None)  # no prefix reuse: the capsule's tokens are its namespace's
            try:
                s.append(list(info.meta.tokens))  # the expensive, fallible part runs before anything changes
                self.store.delete(name, namespace)
                mode = "full" if info.meta.replay_from is None else "replay"
                return self.capsules.snapshot(s, name, tier=info.tier, pin=info.pinned, mode=mode, namespace=namespace)
            finally:
                s.close()

    # ------------------------------------------------------------------ capsules
    @property
    def store(self):
        return self.capsules.store

    @property
    def prefix(self):
        """Automatic prefix reuse (engine/prefix_reuse.py); inert unless EngineConfig.prefix_cache."""
        return self.capsules.prefix

    def snapshot(self, session: Session, name: str, tier: str = Snapshot.tier, pin: bool = Snapshot.pin,
                 mode: str = Snapshot.mode, namespace: str = Snapshot.namespace):
        with self._lock:
            self._own(session)
            session.check_current()  # a stale session's capsule would carry old state under the new version
            return self.capsules.snapshot(session, name, tier=tier, pin=pin, mode=mode, namespace=namespace)

    def restore(self, name: str, namespace: str = "default", wait_s: float | None = None) -> Session:
        return self.restore_sessions(name, 1, namespace, wait_s).sessions[0]

    def restore_into(self, session: Session, name: str, namespace: str = "default") -> str:
        """Restore the capsule into an open session in place; the tier it was read from (gpu, host or disk)."""
        with self._lock:
            self._own(session)
            tier, replay = self.capsules.restore_into(session, name, namespace)
            self._replay([(session, replay)] if replay else [])
            return tier

    def fork(self, name: str, n: int, namespace: str = "default", wait_s: float | None = None) -> list[Session]:
        return self.restore_sessions(name, n, namespace, wait_s).sessions

    def restore_sessions(self, name: str, n: int = 1, namespace: str = "default",
                         wait_s: float | None = None) -> Restored:
        """n new sessions holding the capsule (restore: 1, fork: n), and the tier the first read found it in
        (gpu, host or disk; the later reads find it where the first one promoted it)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidRequestError(f"fork needs n >= 1 branches, got {n!r}")
        with self._lock:
            self.capsules.check_exists(name, namespace)
            sessions = self._take_slots(n, wait_s, reset=False)
            try:
                read = [self.capsules.restore_into(s, name, namespace) for s in sessions]
                self._replay([(s, replay) for s, (_, replay) in zip(sessions, read) if replay])
            except BaseException:
                for s in sessions:
                    self.release(s)
                raise
            for s, (tier, _) in zip(sessions, read):
                s.restored_from = tier
            return Restored(sessions, read[0][0])

    def _replay(self, items: list[tuple[Session, Replay]]) -> None:
        """Rebuild restored replay capsules past their grid point (engine/capsules.py): the prefilled tokens
        through the prefill path, then the decoded ones one step at a time, the sessions batched together
        (bitwise what each gets alone: batch invariance). Each session's decoded_from ends where the
        capsule's was: _extend sets it, decode steps leave it."""
        for s, r in items:
            if r.prefill:
                self._extend(s, list(r.prefill))
        for i in range(max((len(r.decode) for _, r in items), default=0)):
            step = [(s, r.decode[i]) for s, r in items if i < len(r.decode)]
            for group in self.decode_groups(step):
                self.decode([s for s, _ in group], [t for _, t in group])
