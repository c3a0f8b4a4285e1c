"""Engine: the in-process front door. It holds the compute core (runner.py: the model, the state set, the
graphs), the session table (session_table.py: slots and what they hold), the capsule store and the capsule
verbs and prefix reuse over them, and runs every verb under one lock.

Canonical grid state on the 64-token grid (runner.GRID): the slot keeps its recurrent and conv state at its
last grid point G = floor(len / 64) * 64, and an append re-runs the < 64 tokens since G with the new ones, so
appends split anywhere, prefill pieces of any size and a cold prefill give bitwise the same state at every grid
point and the same logits. When decode reaches a grid point the last 64 tokens are re-derived through the
prefill path, so the state at every grid point is the one a cold prefill computes, whatever produced the tokens.

Long work shows a progress bar on a terminal (EngineConfig.progress, capsulert/progress.py): loading the
weights, capturing the graphs, and a prefill of more than LONG_PREFILL_CHUNKS chunks in one call.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
from pathlib import Path
from typing import Callable, Sequence

import torch
from pydantic import ValidationError

from capsulert.capsule_store.capsule import weights_fingerprint, weights_identity_of
from capsulert.chat.prompt import ChatRenderer
from capsulert.config.engine import RANDOM_PREFIX, EngineConfig
from capsulert.config.model import ModelConfig
from capsulert.engine.capsules import CapsuleVerbs, Restored, open_store
from capsulert.engine.decoding import DecodeStream, advance, check_generate, wait_for_masks
from capsulert.engine.drafters import Drafters
from capsulert.engine.default_model import SEED, ensure_default_model, init_weights
from capsulert.engine.fingerprint import checkpoint_fingerprint
from capsulert.engine.grammar import Grammars
from capsulert.engine.loader import expected_shapes, load_checkpoint, load_tokenizer
from capsulert.engine.prefix_reuse import PrefixCache
from capsulert.engine.runner import (  # noqa: F401 (the engine's constants, imported from here by callers)
    GRID, LONG_PREFILL_CHUNKS, MAX_DECODE_BATCH, MOE_PREFILL_CHUNK, ModelRunner, grid_point_inside, prefill_pieces)
from capsulert.engine.session import Session
from capsulert.engine.session_table import SessionTable
from capsulert.engine.stops import eos_ids_from_checkpoint
from capsulert.engine.token_codec import TokenCodec
from capsulert.engine.weights import check_update, read_update, update_identity
from capsulert.errors import ConfigError, InvalidRequestError, NoFreeSlotError, WeightUpdateError
from capsulert.progress import progress_bar
from capsulert.protocol.names import DEFAULT_NAMESPACE
from capsulert.protocol.requests import Fork, Open, Restore, Snapshot
from capsulert.protocol.results import GenerateResult
from capsulert.protocol.sampling import SamplingParams

log = logging.getLogger(__name__)


def _token_text(tokenizer, ids: Sequence[int]) -> str | None:
    """The text of the first EOS token (chat templates write it), None without a tokenizer or an EOS."""
    return tokenizer.id_to_token(ids[0]) if tokenizer is not None and ids else None


class Engine:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 tokenizer=None, fingerprint: str = "", eos_token_ids: tuple[int, ...] | None = None,
                 model_dir: Path | None = None):
        self.config = config
        self.model_cfg = model_cfg
        self.runner = ModelRunner(config, model_cfg, weights, fingerprint)
        self.tokenizer = tokenizer
        # generate stops at these unless SamplingParams.ignore_eos (config.json + generation_config.json)
        self.eos_token_ids = eos_token_ids if eos_token_ids is not None else (
            () if model_cfg.eos_token_id is None else (model_cfg.eos_token_id,))
        # text, token ids and chat prompts (rendered by the checkpoint's chat template in model_dir)
        self.codec = TokenCodec(tokenizer, model_cfg.vocab_size, config.max_seq,
                                ChatRenderer(model_dir, tokenizer, _token_text(tokenizer, self.eos_token_ids)))
        self.grammars = Grammars(tokenizer, model_cfg.vocab_size, self.eos_token_ids)  # constrained decoding
        self.drafters = Drafters()  # speculative decode's drafters, by name (engine/drafters/)
        self.table = SessionTable(self.runner, self, config.slots)
        self.store = open_store(self.runner)
        self.prefix = PrefixCache(self.runner, self.table, self.store, config.prefix_cache)
        self.capsules = CapsuleVerbs(self.runner, self.store, self.table, self.prefix)

    # the compute core's state, read by tools, tests and benchmarks (the runner owns them)
    state = property(lambda self: self.runner.state)
    model = property(lambda self: self.runner.model)
    graphs = property(lambda self: self.runner.graphs)
    device = property(lambda self: self.runner.device)
    dtype = property(lambda self: self.runner.dtype)
    grid = property(lambda self: self.runner.grid)
    chunk = property(lambda self: self.runner.chunk)
    model_weights = property(lambda self: self.runner.model_weights)
    fingerprint = property(lambda self: self.runner.fingerprint, doc="the model and weights the state is made under")
    weights_version = property(lambda self: self.runner.weights_version, doc="bumped by update_weights")
    prefill_forwards = property(lambda self: self.runner.prefill_forwards,
                                doc="prefill forwards run: one a piece alone, one a group of a batched append's round")

    @classmethod
    def from_config(cls, config: EngineConfig | dict | None = None, **overrides) -> "Engine":
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
        if device.type == "cpu" and config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
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
        with self.lock:
            self.prefix.enabled = False  # closing sessions keep nothing: the store goes next
            for s in self.table.sessions():
                self.release(s)
            self.store.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def lock(self) -> threading.RLock:
        """The engine's re-entrant lock. Every verb holds it; hold it yourself to run several steps as one
        (the step scheduler holds it for a whole decode step: sampling reads the logits a CUDA graph left
        in its static output buffer, which another thread's step would overwrite)."""
        return self.table.lock

    @property
    def free_slots(self) -> int:
        return self.table.free_slots

    # ------------------------------------------------------------------ sessions
    def open(self, prompt=None, namespace: str | None = Open.namespace, *, wait_s: float | None = None) -> Session:
        """A new session, empty or prefilled with `prompt` (with EngineConfig.prefix_cache, the longest
        cached grid prefix of it in `namespace` is restored and only the rest prefilled; namespace None:
        no prefix reuse). With every slot taken, waits up to wait_s seconds (default 0: a blocking call
        in a thread that holds the slots would wait for itself; the step scheduler's requests queue for up
        to the config's slot_wait_s) for one to be released, then raises NoFreeSlotError."""
        with self.lock:
            session = self.table.take(1, wait_s)[0]
            self.prefix.opened(session, namespace)
            if prompt is not None:
                try:
                    self.append(session, prompt)
                except BaseException:
                    self.release(session)
                    raise
            return session

    def release(self, session: Session) -> None:
        with self.lock:
            self.table.own(session)
            self.prefix.closing(session)  # may keep its last grid checkpoint (prefix cache)
            self.table.release(session)

    def chat(self, messages, max_tokens: int | None = None, sampling: SamplingParams | dict | None = None, *,
             namespace: str | None = DEFAULT_NAMESPACE, **chat_args):
        """One chat turn on a session of its own (opened, used, closed): Session.chat's arguments and
        ChatReply. With EngineConfig.prefix_cache, the conversation's cached prefix in `namespace` is reused."""
        session = self.open(namespace=namespace)
        try:
            return session.chat(messages, max_tokens, sampling, **chat_args)
        finally:
            session.close()

    # ------------------------------------------------------------------ tokens
    def tokenize(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.codec.decode(tokens)

    # ------------------------------------------------------------------ prefill
    def append(self, session: Session, tokens_or_text) -> torch.Tensor:
        with self.lock:
            self.table.own(session)
            session.check_current()
            new = self.codec.validate(tokens_or_text, self.config.max_seq - len(session.tokens))
            # a cached prefix restored: only the rest is new
            self.append_checked(session, self.prefix.before_append(session, new))
            return self.logits(session)

    def append_checked(self, session: Session, ids: list[int]) -> None:
        """Append token ids checked already (TokenCodec.validate, the session's room included), computing no
        logits: the step scheduler's prefill pieces, whose tokens were checked once when the request's
        prefill began (after reuse_prefix, which plans the prefix cache's checkpoints they are cut at)."""
        with self.lock:
            self.table.own(session)
            session.check_current()
            for piece in self.prefix.pieces(session, ids):  # cut where checkpoints are to be kept
                grid_hidden = self.table.extend(session, piece)
                self.prefix.reached(session, grid_hidden)

    def append_many(self, sessions: Sequence[Session], pieces: Sequence) -> list[torch.Tensor]:
        """`append` for several sessions at once: pieces[i] (text or token ids) to sessions[i], every piece
        checked before any session changes; the prefills run in one forward per round of pieces, and each
        session's state and next-token logits (returned, in order) are bitwise what its own `append` gives."""
        sessions = list(sessions)
        if isinstance(pieces, (str, torch.Tensor)) or len(pieces) != len(sessions):
            raise InvalidRequestError("append_many takes one piece (text or token ids) per session")
        if len({id(s) for s in sessions}) != len(sessions):
            raise InvalidRequestError("a session appears twice in one append_many call")
        with self.lock:
            for s in sessions:
                self.table.own(s)
                s.check_current()
            news = [self.codec.validate(p, self.config.max_seq - len(s.tokens)) for s, p in zip(sessions, pieces)]
            # a cached prefix restored: only the rest is new
            self.append_checked_many(sessions, [self.prefix.before_append(s, new) for s, new in zip(sessions, news)])
            return self.runner.logits_rows([s.slot for s in sessions])

    def append_checked_many(self, sessions: Sequence[Session], ids: Sequence[list[int]]) -> None:
        """`append_checked` for several sessions: each one's ids cut where its prefix-cache checkpoints are to
        be kept, round k of the cuts run for every session in one batched prefill."""
        with self.lock:
            for s in sessions:
                self.table.own(s)
                s.check_current()
            cuts = [self.prefix.pieces(s, list(t)) for s, t in zip(sessions, ids)]
            for k in range(max((len(c) for c in cuts), default=0)):
                now = [(s, c[k]) for s, c in zip(sessions, cuts) if k < len(c)]
                for (s, _), grid_hidden in zip(now, self.table.extend_many(now)):
                    self.prefix.reached(s, grid_hidden)

    def reuse_prefix(self, session: Session, tokens: list[int]) -> list[int]:
        """Restore the longest cached grid prefix of the session's tokens + `tokens` (prefix cache); the
        tokens left to append. For callers that append in pieces (the step scheduler)."""
        with self.lock:
            self.table.own(session)
            session.check_current()
            return self.prefix.before_append(session, tokens)

    def logits(self, session: Session) -> torch.Tensor:
        self.table.own(session)
        session.check_current()
        if not session.tokens:
            raise InvalidRequestError("an empty session has no next-token logits; append a prompt first")
        return self.runner.logits_rows([session.slot])[0]

    # ------------------------------------------------------------------ decode
    def generate(self, sessions: Sequence[Session], max_new_tokens: int,
                 sampling: Sequence[SamplingParams | None] | None = None,
                 should_stop: Callable[[Session], bool] | None = None) -> list[GenerateResult]:
        """Sample for several sessions together, one batched decode step per token (groups of at most
        MAX_DECODE_BATCH sessions per step). Each result is the list of generated tokens, with their
        logprobs, the text and the stop reason (EOS, stop ids / strings, length, max_seq, interrupted). A session stops at the next
        token boundary once `session.interrupt()` was called during this generate, or once
        `should_stop(session)`, asked after every token, returns True. Each session's tokens and logits are
        bitwise those it gets alone. A constrained session waits for its grammar's masks without holding the
        others (engine/mask_worker.py); one whose grammar is refused (InvalidRequestError; GrammarTooCostlyError
        when a mask runs past its budget) is put back as it was, and the call raises once the others are done."""
        sessions, params = check_generate(sessions, max_new_tokens, sampling)
        with self.lock:
            if len({id(s) for s in sessions}) != len(sessions):
                raise InvalidRequestError("a session appears twice in one generate call")
            for s in sessions:
                self.table.own(s)
                if not s.tokens:
                    raise InvalidRequestError(f"session {s.id} is empty; append a prompt before generating")
                self.table.starting(s)
            streams = [DecodeStream(self, s, max_new_tokens, p) for s, p in zip(sessions, params)]

            def stop(st: DecodeStream) -> bool:
                return st.session.interrupt_requested or (should_stop is not None and should_stop(st.session))
            while any(not st.done for st in streams):
                advance(self, streams, stop, events=False)  # the results carry everything: no events to build
                wait_for_masks(streams)  # every stream left waits for its grammar's mask: none spins
            failed = [st for st in streams if st.error is not None]
            for st in failed:  # a refused grammar: its session holds what it held before this call
                self.truncate(st.session, st.start)
            if failed:
                raise failed[0].error
            return [st.result for st in streams]

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
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)
                                    or version <= self.weights_version):
            raise WeightUpdateError(f"version must be an int above the current weights version "
                                    f"{self.weights_version}, got {version!r}")
        new = check_update(self.model_weights, read_update(weights, self.model_cfg, self.dtype, self.config.progress),
                           self.model_cfg.tie_word_embeddings)
        identity = update_identity(weights, identity)
        with self.lock:
            if rebuild_pinned and not self.table.free_slots and any(i.pinned for i in self.store.list()):
                raise NoFreeSlotError("rebuild_pinned needs a free slot to re-derive the pinned capsules and every "
                                      f"one of the {self.config.slots} is held; the weights are unchanged")
            version = self.weights_version + 1 if version is None else version
            self.runner.replace_weights(new, weights_fingerprint(self.fingerprint, identity, version), version)
            if rebuild_pinned:
                for info in self.store.list():
                    if info.pinned:
                        self.rebuild(info.name, info.namespace)
            return self.weights_version

    @property
    def weights_identity(self) -> str:
        """The identity of the weights the engine runs ("" for those it loaded)."""
        return weights_identity_of(self.fingerprint)

    def rederive(self, session: Session) -> int:
        """Recompute a session's state from its tokens under the current weights (a stale one, open across
        an update_weights): a cold prefill of its tokens, bitwise what a new session appending them gets;
        the session's length."""
        with self.lock:
            tokens = self.begin_rederive(session)
            if tokens:
                self.append(session, tokens)
            return len(session.tokens)

    def begin_rederive(self, session: Session) -> list[int]:
        """The first half of rederive (the step scheduler prefills the tokens in pieces): the slot reset to an
        empty state under the current weights; the tokens to append again."""
        with self.lock:
            self.table.own(session)
            tokens = self.table.empty(session)
            self.prefix.rederiving(session)
            return tokens

    def truncate(self, session: Session, n: int) -> int:
        """Roll a session back to its first n tokens, bitwise the state a cold prefill of them computes (the
        same next-token logits and continuation): the slot emptied and tokens[:n] prefilled through the
        normal append path, which restores the longest cached grid prefix when the prefix cache holds one
        (grid checkpoints only: exact) and prefills the rest. n == len changes nothing; n outside
        [0, len] is InvalidRequestError with the session unchanged. The session's length."""
        with self.lock:
            self.table.own(session)
            session.check_current()
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(session.tokens):
                raise InvalidRequestError(f"truncate takes an int n with 0 <= n <= {len(session.tokens)} (the "
                                          f"session's length), got {n!r:.80}")
            if n < len(session.tokens):
                keep = self.begin_rederive(session)[:n]
                if keep:
                    self.append(session, keep)
            return len(session.tokens)

    def rebuild(self, name: str, namespace: str = DEFAULT_NAMESPACE):
        """Re-derive a capsule made under older weights: prefill its own tokens under the current weights
        and replace it (same name, tier and pin). Returns the new CapsuleRef, or None when it is current."""
        with self.lock:
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
    def snapshot(self, session: Session, name: str, tier: str = Snapshot.tier, pin: bool = Snapshot.pin,
                 namespace: str = Snapshot.namespace, mode: str = Snapshot.mode):
        with self.lock:
            self.table.own(session)
            session.check_current()  # a stale session's capsule would carry old state under the new version
            return self.capsules.snapshot(session, name, tier=tier, pin=pin, mode=mode, namespace=namespace)

    def restore(self, name: str, namespace: str = Restore.namespace, *, wait_s: float | None = None) -> Session:
        return self.restore_sessions(name, 1, namespace, wait_s).sessions[0]

    def restore_into(self, session: Session, name: str, namespace: str = DEFAULT_NAMESPACE) -> str:
        """Restore the capsule into an open session in place; the tier it was read from (gpu, host or disk)."""
        with self.lock:
            self.table.own(session)
            return self.capsules.restore_into(session, name, namespace)

    def restore_into_many(self, sessions: Sequence[Session], names: Sequence[str],
                          namespace: str = DEFAULT_NAMESPACE) -> list[str]:
        """`restore_into` for several sessions at once: names[i] into sessions[i] in place (RL resets, many
        rollbacks), every capsule read and checked before any slot changes, the bytes of all of them in two
        grouped copies; the tier each capsule was read from."""
        with self.lock:
            for s in sessions:
                self.table.own(s)
            return self.capsules.restore_into_many(sessions, names, namespace)

    def restore_many(self, names: Sequence[str], namespace: str = DEFAULT_NAMESPACE, *,
                     wait_s: float | None = None) -> list[Session]:
        """A new session per capsule name (names may repeat), restored together: every capsule read and
        checked before any byte moves, all the bytes in two grouped copies; all or nothing."""
        with self.lock:
            return self.capsules.restore_many(names, namespace, wait_s).sessions

    def fork(self, name: str, n: int, namespace: str = Fork.namespace, *, wait_s: float | None = None) -> list[Session]:
        return self.restore_sessions(name, n, namespace, wait_s).sessions

    def restore_sessions(self, name: str, n: int = 1, namespace: str = DEFAULT_NAMESPACE,
                         wait_s: float | None = None) -> Restored:
        """n new sessions holding the capsule (restore: 1, fork: n), and the tier the first read found it in
        (gpu, host or disk; the later reads find it where the first one promoted it)."""
        with self.lock:
            return self.capsules.restore_sessions(name, n, namespace, wait_s)
