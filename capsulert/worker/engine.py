"""Engine: owns the model, the state set, the capsule store and the slots; runs every verb.

Prefill runs on a global chunk grid (chunks start at multiples of prefill_chunk); an append re-runs the
tokens since the slot's last grid point from its grid checkpoint, so appends split anywhere and a cold
prefill give bitwise the same logits and state. Decode steps several slots at once.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from capsulert.config import ModelConfig
from capsulert.errors import (
    ForeignSessionError,
    InvalidRequestError,
    NoFreeSlotError,
)
from capsulert.worker.engine_config import EngineConfig
from capsulert.worker.model import HybridModel
from capsulert.worker.sampler import GREEDY, SamplingParams, make_generator, sample
from capsulert.worker.session import Session
from capsulert.worker.state import StateLayout, StateSet
from capsulert.worker.tokens import TokenCodec

RANDOM_PREFIX = "random:"  # model="random:<architecture yaml>": deterministic random weights on the device


class Engine:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 tokenizer=None, fingerprint: str = ""):
        self.config = config
        self.model_cfg = model_cfg
        self.device = next(iter(weights.values())).device
        self.dtype = weights["model.embed_tokens.weight"].dtype
        self.model_weights = weights
        self.model = HybridModel(model_cfg, weights, self._kernels(config))
        self.tokenizer = tokenizer
        self.codec = TokenCodec(tokenizer, model_cfg.vocab_size, config.max_seq)
        self.fingerprint = fingerprint
        self.chunk = config.prefill_chunk
        # one extra scratch slot absorbs the padding rows of captured graphs; KV keeps a chunk of slack
        # rows because a padded prefill chunk writes (ignored) KV past the last real token
        self.scratch_slot = config.slots
        layout = StateLayout.for_model(model_cfg, config.slots + 1, config.max_seq + self.chunk, self.dtype, self.device)
        self.state = StateSet(layout)
        self._free = list(range(config.slots))
        self._sessions: dict[int, Session] = {}
        self._lock = threading.RLock()
        self._slot_freed = threading.Condition(self._lock)
        self._prefill_s_per_token = 0.0
        from capsulert.worker.capsules import CapsuleVerbs

        self.capsules = CapsuleVerbs(self)
        self.graphs = None
        if self.device.type == "cuda" and config.cuda_graphs:
            from capsulert.worker.graphs import GraphPlans

            self.graphs = GraphPlans(self.model, self.state, self.scratch_slot, config.max_seq, self.chunk,
                                     tuple(b for b in config.decode_batches if b <= config.slots) or (1,))
            self.graphs.capture()

    def _kernels(self, config: EngineConfig):
        from capsulert.kernels import ops

        if self.device.type != "cuda" or config.kernels == "reference":
            return ops.reference_kernels()
        return ops.cuda_kernels(use_fla=config.kernels != "triton")

    @classmethod
    def from_config(cls, config: EngineConfig | dict | None = None, **overrides) -> "Engine":
        from capsulert.worker.default_model import ensure_default_model
        from capsulert.worker.loader import load_checkpoint, load_tokenizer, weights_fingerprint

        if config is None or isinstance(config, dict):
            config = EngineConfig(**{**(config or {}), **overrides})
        elif overrides:
            config = config.model_copy(update=overrides)
        device = config.torch_device()
        dtype = config.torch_dtype(device)
        if config.model.startswith(RANDOM_PREFIX):
            return cls._random(config, device, dtype)
        if config.model == "default":
            path = ensure_default_model(Path(config.cache_dir) if config.cache_dir else None)
        else:
            path = Path(config.model)
        model_cfg, weights = load_checkpoint(path, dtype=dtype, device=device)
        fingerprint = f"{weights_fingerprint(model_cfg, weights)}:{dtype}".replace("torch.", "")
        return cls(config, model_cfg, weights, load_tokenizer(path), fingerprint)

    @classmethod
    def _random(cls, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> "Engine":
        """Deterministic random weights for an architecture YAML, generated on the device (benchmarks)."""
        import hashlib

        from capsulert.worker.default_model import SEED, init_weights

        model_cfg = ModelConfig.from_file(config.model[len(RANDOM_PREFIX):])
        weights = init_weights(model_cfg, SEED, device=device, dtype=dtype)
        digest = hashlib.sha256(json.dumps(model_cfg.to_hf_dict(), sort_keys=True).encode()).hexdigest()
        fingerprint = f"random-{SEED}-{digest}-{device.type}:{dtype}".replace("torch.", "")
        return cls(config, model_cfg, weights, None, fingerprint)

    # ------------------------------------------------------------------ sessions
    def open(self, wait_s: float | None = None) -> Session:
        """A new empty session. With every slot taken, waits up to wait_s (default: the config's
        slot_wait_s) for one to be released, then raises NoFreeSlotError."""
        with self._lock:
            return self._take_slots(1, wait_s)[0]

    def _take_slots(self, n: int, wait_s: float | None = None, reset: bool = True) -> list[Session]:
        """Claim n slots. reset=False when a restore overwrites every state buffer of the slot next."""
        wait_s = self.config.slot_wait_s if wait_s is None else wait_s
        if n > self.config.slots:
            raise NoFreeSlotError(f"{n} slot(s) needed but the engine has {self.config.slots}; raise `slots`")
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
            session.closed = True
            del self._sessions[session.slot]
            self._free.append(session.slot)
            self._free.sort()
            self._slot_freed.notify_all()

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def _own(self, session: Session) -> None:
        if session.engine is not self:
            raise ForeignSessionError(f"session {session.id} belongs to another engine")
        session._check_open()

    # ------------------------------------------------------------------ tokens
    def tokenize(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.codec.decode(tokens)

    # ------------------------------------------------------------------ prefill
    def _kv_len(self, end: int) -> int:
        return min(self.config.max_seq, -(-end // self.chunk) * self.chunk)

    def _run_prefill(self, slot: int, tokens: list[int], start: int) -> None:
        """Run tokens at positions [start, start+len) on the chunk grid; the slot's live state must be at start."""
        if self.graphs is None:
            slots = torch.tensor([slot], device=self.device)
            ids = torch.tensor(tokens, device=self.device)
        a, end = start, start + len(tokens)
        t0 = time.perf_counter()
        while a < end:
            b = min((a // self.chunk + 1) * self.chunk, end)
            if self.graphs is not None:
                self.graphs.prefill(slot, tokens[a - start:b - start])
            else:
                self.model.forward(self.state, slots, ids[None, a - start:b - start], self._kv_len(b))
            if b % self.chunk == 0:
                self.state.save_grid(slot)
            a = b
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        per_token = (time.perf_counter() - t0) / len(tokens)
        self._prefill_s_per_token = per_token if not self._prefill_s_per_token else 0.9 * self._prefill_s_per_token + 0.1 * per_token

    def append(self, session: Session, tokens_or_text) -> torch.Tensor:
        with self._lock:
            self._own(session)
            new = self.codec.validate(tokens_or_text, self.config.max_seq - len(session.tokens))
            P = len(session.tokens)
            G = P // self.chunk * self.chunk
            if session.live_len != G:
                self.state.load_grid(session.slot)
                self.state.pos[session.slot] = G
            self._run_prefill(session.slot, session.tokens[G:] + new, G)
            session.tokens.extend(new)
            session.live_len = len(session.tokens)
            return self.logits(session)

    def _catch_up(self, session: Session) -> None:
        """Fold tokens kept pending by a restore off the grid into the live state."""
        if session.live_len < len(session.tokens):
            self._run_prefill(session.slot, session.tokens[session.live_len:], session.live_len)
            session.live_len = len(session.tokens)

    def logits(self, session: Session) -> torch.Tensor:
        self._own(session)
        if not session.tokens:
            raise InvalidRequestError("an empty session has no next-token logits; append a prompt first")
        return self.model.logits(self.state, torch.tensor([session.slot], device=self.device))[0]

    # ------------------------------------------------------------------ decode
    def generate(self, sessions: Sequence[Session], max_new_tokens: int,
                 sampling: Sequence[SamplingParams | None] | None = None,
                 should_stop: Callable[[Session], bool] | None = None) -> list[list[int]]:
        """Sample for several sessions together, one batched decode step per token. A session stops at
        the next token boundary once `session.interrupt()` was called during this generate, or once
        `should_stop(session)`, asked after every token, returns True."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise InvalidRequestError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        sampling = list(sampling) if sampling is not None else [None] * len(sessions)
        if len(sampling) != len(sessions):
            raise InvalidRequestError("one SamplingParams per session (or None)")
        params = [p or GREEDY for p in sampling]
        with self._lock:
            if len({id(s) for s in sessions}) != len(sessions):
                raise InvalidRequestError("a session appears twice in one generate call")
            for s in sessions:
                self._own(s)
                if not s.tokens:
                    raise InvalidRequestError(f"session {s.id} is empty; append a prompt before generating")
                s._interrupt = False
                s.stop_reason = None
            gens = [make_generator(p, self.device) for p in params]
            outs: list[list[int]] = [[] for _ in sessions]
            active = list(range(len(sessions)))
            if max_new_tokens == 0:
                for s in sessions:
                    s.stop_reason = "length"
                return outs
            slots = torch.tensor([s.slot for s in sessions], device=self.device)
            logits = self.model.logits(self.state, slots)
            rows = {i: i for i in active}
            for s in sessions:
                self._catch_up(s)
            while active:
                toks = {}
                for i in active:
                    s = sessions[i]
                    if len(s.tokens) >= self.config.max_seq:
                        s.stop_reason = "max_seq"
                        continue
                    toks[i] = sample(logits[rows[i]], params[i], gens[i])
                active = [i for i in active if i in toks]
                if not active:
                    break
                step_logits = self._decode([sessions[i] for i in active], [toks[i] for i in active])
                still = []
                for i in active:
                    s, t = sessions[i], toks[i]
                    outs[i].append(t)
                    if t in params[i].stop_tokens:
                        s.stop_reason = "stop_token"
                    elif s._interrupt or (should_stop is not None and should_stop(s)):
                        s.stop_reason = "interrupted"
                    elif len(outs[i]) >= max_new_tokens:
                        s.stop_reason = "length"
                    else:
                        still.append(i)
                logits, rows = step_logits, {i: r for r, i in enumerate(active)}
                active = still
            return outs

    def _decode(self, sessions: list[Session], tokens: list[int]) -> torch.Tensor:
        """Feed one token to each session (one batched step); returns their next-token logits."""
        if self.graphs is not None:
            logits = self.graphs.decode([s.slot for s in sessions], tokens)
        else:
            slots = torch.tensor([s.slot for s in sessions], device=self.device)
            ids = torch.tensor(tokens, device=self.device)[:, None]
            self.model.forward(self.state, slots, ids, self._kv_len(max(len(s.tokens) for s in sessions) + 1))
            logits = self.model.logits(self.state, slots)
        for s, t in zip(sessions, tokens):
            s.tokens.append(t)
            s.live_len = len(s.tokens)
            if s.live_len % self.chunk == 0:
                self.state.save_grid(s.slot)
        return logits

    # ------------------------------------------------------------------ capsules
    @property
    def store(self):
        return self.capsules.store

    def snapshot(self, session: Session, name: str, tier: str = "gpu", pin: bool = False,
                 mode: str = "full", namespace: str = "default"):
        with self._lock:
            self._own(session)
            return self.capsules.snapshot(session, name, tier=tier, pin=pin, mode=mode, namespace=namespace)

    def restore(self, name: str, namespace: str = "default", wait_s: float | None = None) -> Session:
        with self._lock:
            self.capsules.check_exists(name, namespace)
            session = self._take_slots(1, wait_s, reset=False)[0]
            try:
                self.capsules.restore_into(session, name, namespace)
            except BaseException:
                self.release(session)
                raise
            return session

    def restore_into(self, session: Session, name: str, namespace: str = "default") -> None:
        with self._lock:
            self._own(session)
            self.capsules.restore_into(session, name, namespace)

    def fork(self, name: str, n: int, namespace: str = "default", wait_s: float | None = None) -> list[Session]:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidRequestError(f"fork needs n >= 1 branches, got {n!r}")
        with self._lock:
            self.capsules.check_exists(name, namespace)
            sessions = self._take_slots(n, wait_s, reset=False)
            try:
                for s in sessions:
                    self.capsules.restore_into(s, name, namespace)
            except BaseException:
                for s in sessions:
                    self.release(s)
                raise
            return sessions
