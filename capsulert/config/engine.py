"""EngineConfig: the validated edge where users configure an Engine (pydantic)."""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from capsulert.config.scheduler import SchedulerConfig
from capsulert.kernels.chunk import GATED_DELTA_CHUNK

if TYPE_CHECKING:
    import torch

RANDOM_PREFIX = "random:"  # model="random:<architecture yaml>": deterministic random weights on the device


class TierBudgets(BaseModel):
    """Byte budget per capsule tier; None = unlimited, 0 = tier disabled. `gpu` is the older name of `device`
    (taken, with a DeprecationWarning)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    device: int | None = Field(None, ge=0)
    host: int | None = Field(None, ge=0)
    disk: int | None = Field(None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _older_name(cls, values):
        if isinstance(values, dict) and "gpu" in values:
            if "device" in values:
                raise ValueError("give the device tier's budget once: `device` (`gpu` is its older name)")
            warnings.warn("tier budget `gpu` is the older name of `device`; say `device`", DeprecationWarning,
                          stacklevel=2)
            values = {("device" if k == "gpu" else k): v for k, v in values.items()}
        return values

    def as_dict(self) -> dict[str, int | None]:
        return {"device": self.device, "host": self.host, "disk": self.disk}


class EngineConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field("default", description='"default" (embedded, generated on first use) or an HF checkpoint dir')
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    slots: int = Field(8, ge=1, le=4096)
    max_seq: int = Field(4096, ge=64)
    prefill_chunk: int = Field(256, ge=GATED_DELTA_CHUNK)
    cache_dir: str | None = None
    cpu_threads: int | None = Field(1, ge=1, description=(
        "torch's intra-op threads (torch.set_num_threads, process-wide) an engine on the CPU sets when it starts; "
        "None: leave torch's setting (a thread per core). 1 by default: the default model's small GEMMs gain "
        "little from more, and a thread per core waits on any core another process holds (8 sessions x 12 "
        "tokens on the 2-core box under load: 40 s with 2 threads, 1.0 s with 1). An orchestrator worker's "
        "torch_threads (capsulert serve --torch-threads) overrides it"))
    capsule_budgets: TierBudgets = TierBudgets()
    disk_dir: str | None = None
    policy: str = "pinned_lru"
    prefix_cache: bool = Field(False, description="automatic exact prefix reuse: keep grid checkpoints of sessions "
                               "as anonymous entries and restore the longest cached prefix of every new prompt "
                               "(on in `capsulert serve`)")
    prefix_cache_bytes: int | None = Field(2 << 30, ge=0, description="the most bytes prefix entries hold alone "
                                           "(blocks shared with capsules not counted); None: tier budgets only")
    prefix_policy: str = Field("cost_aware", description="the policy that admits and evicts prefix entries")
    replay_max_prefill: int = Field(4096, ge=0, description="a replay capsule re-runs from the deepest grid point "
                                    "whose state the store holds already, if that is at most this many tokens "
                                    "before its own grid point (else from its own): memory against restore time")
    tail_replay: bool = Field(True, description="an append to a session (or capsule) whose prefilled tokens end "
                              "past a grid point re-runs those tokens through the linear-attention layers' conv and "
                              "chunk math only, from the rows kept for them (the exact-replay buffer), not through "
                              "the whole model, alone or in a batched append (a crowd's turns); the same bits either "
                              "way. A crowd's batched turns save the most (an H200 9B crowd of 64 at 3,500 tokens: "
                              "first token 208 ms against 332); a lone append on CUDA pays ~1-2 ms for the rows' "
                              "gathers (bench/RESULTS.md). False: no tail buffers, every such tail re-run")
    kernels: Literal["auto", "reference", "triton"] = Field(
        "auto", description="CUDA kernels: auto = Triton + fla chunked prefill when installed")
    slot_wait_s: float = Field(60.0, ge=0.0, le=3600.0,
                               description="how long a request that needs session slots (open, restore, fork, a turn "
                               "restoring into a new session) waits for them in the step scheduler's queue "
                               "(AsyncEngine, orchestrator workers, the server) before NoFreeSlotError; such "
                               "requests start in arrival order. The blocking Engine verbs wait only when given "
                               "wait_s")
    cuda_graphs: bool = Field(True, description="capture CUDA graphs at start (CUDA only)")
    decode_batches: tuple[int, ...] = Field((1, 2, 4, 8, 16, 32, 64), description="batch sizes of the decode graphs (capped at slots; the largest is always captured)")
    batched_piece_rows: int = Field(
        2048, ge=0, description="a batched append (several sessions' prefill pieces in one forward: a crowd's turns) "
        "replays a CUDA graph where one is captured for its shape: a decode batch size (> 1) of sessions times a "
        "prefill token bucket, captured for every such shape of at most this many rows (sessions x tokens), with "
        "and without replayed tails; larger ones run eagerly. The same bits either way; an eager crowd forward of "
        "the 9B is host-bound (~1,300 launches). 0: none captured (a faster start)")
    mixed_rederive_pieces: tuple[int, ...] = Field(
        (1, 2, 4), description="a decode step whose sessions include some that reach a grid point runs their "
        "re-derivations (64 rows each) in the same forward as the other sessions' decode rows, one pass of the "
        "weights (CUDA, where every GEMM keeps a row's bits at any row count; checked at start): the numbers of "
        "re-deriving sessions such a step's graphs are captured for (with each decode batch). More than the "
        "largest run as two forwards, as all do with () (and the CPU): the same bits either way. Measured on an "
        "H100: a bounded 9B crowd's steps 19 ms against 25. SchedulerConfig.step_rederive_rows (default 256, four "
        "sessions) keeps a crowd's steps within them")
    speculate_slots: int = Field(8, ge=0, le=64, description="sessions that may speculate (SamplingParams."
                                 "speculate) in one decode step; each has 3 rollback copies of its slot's recurrent "
                                 "and conv state, allocated at start (~150 MB each on the 9B shape). A step's further "
                                 "speculating sessions decode plainly that step (the same output); 0: none speculate")
    scheduler: SchedulerConfig = SchedulerConfig()
    progress: bool | None = Field(None, description="progress bars on stderr for default-model generation, weight "
                                  "loading, graph capture and long prefills: None = when stderr is a terminal "
                                  "(never in Ray workers unless True)")

    @field_validator("prefill_chunk")
    @classmethod
    def _on_gated_delta_grid(cls, v: int) -> int:
        if v % GATED_DELTA_CHUNK:
            raise ValueError(f"prefill_chunk must be a multiple of {GATED_DELTA_CHUNK}, got {v}")
        return v

    @field_validator("mixed_rederive_pieces")
    @classmethod
    def _pieces_of_a_step(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(k < 1 or k > 64 for k in v):
            raise ValueError(f"mixed_rederive_pieces are numbers of sessions in a decode step: 1..64, got {v}")
        return tuple(sorted(set(v)))

    @model_validator(mode="after")
    def _max_seq_on_grid(self) -> "EngineConfig":
        if self.max_seq % self.prefill_chunk:
            raise ValueError(f"max_seq ({self.max_seq}) must be a multiple of prefill_chunk ({self.prefill_chunk})")
        return self

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            from capsulert.errors import ConfigError

            raise ConfigError("device='cuda' was asked for but torch sees no CUDA device")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)
