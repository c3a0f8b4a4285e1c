"""SchedulerConfig: the step scheduler (scheduler/step_scheduler.py), part of every engine's config so the
in-process AsyncEngine and the orchestrator's workers read the same values."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SchedulerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_queue: int = Field(1024, ge=1, description="requests waiting for the step loop; one more is refused with "
                           "QueueFullError (the orchestrator's admission queue bounds what reaches a worker first)")
    step_prefill_tokens: int | None = Field(
        None, ge=1, description="prompt tokens one step prefills across all sessions before the next decode step (a "
        "long prompt cannot stall the others' decoding for longer); None: the engine's prefill_chunk while sessions "
        "decode, and while none does (no token waits) one round, a piece of each prefilling session, as wide as the "
        "larger of it and EngineConfig.batched_piece_rows (with batch_prefill), so a crowd's turns that arrive "
        "together run in one forward and start decoding together, while a long prompt still advances a piece a step")
    step_prefill_tokens_decoding: int | None = Field(
        None, ge=1, description="the step's prefill budget while other sessions are decoding: their next token "
        "waits for the step's prefill, so this bounds their inter-token latency (a crowd's arrivals are then "
        "prefilled over more steps); None: step_prefill_tokens (unset: the engine's prefill_chunk)")
    step_rederive_rows: int | None = Field(
        256, ge=64, description="the grid re-derivation rows one decode step runs (64 for each session whose step "
        "reaches a grid point: its last 64 tokens re-run through the prefill path, the canonical grid state); the "
        "sessions past it sit that step out (their tokens unchanged) and go first in the next. A crowd that started "
        "together reaches its grid points together: unbounded, that step runs all of their rows while every "
        "stream's next token waits (a long step, the inter-token p99); bounded, the crowd spreads out over its "
        "first grid point and re-derives a few sessions a step from then on, at the price of the separate "
        "forwards of those few (on CUDA they ride in the decode step's forward: EngineConfig.mixed_rederive_pieces). "
        "None: unbounded (a few % more tokens/s, an inter-token p99 of 7.5x the median on an H100 9B crowd of 64 "
        "against 2.5x at 256). The bound holds in steps that decode a streamed generate; a step whose generates "
        "are all whole-result requests (RL turns, best-of-N branches) re-derives every grid point it reaches: no "
        "caller sees a token before its last, and a crowd that an RL env step re-aligns would otherwise spread "
        "out again at each grid point (an env step of 8 tokens took 23 decode steps instead of 8)")
    batch_prefill: bool = Field(True, description="a step's prefill pieces of many sessions run as one batched "
                                "append (one forward per round), and its requests' capsule restores as one batch "
                                "(two grouped copies); False: one forward per session's piece and one restore per "
                                "request, and a step budget of one chunk with or without decoding sessions, the way "
                                "before batching (benchmarks compare the two; the tokens are the "
                                "same)")
