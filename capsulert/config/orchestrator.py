"""OrchestratorConfig: how to start an Orchestrator (the checks of the verbs' arguments are protocol/checks.py)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from capsulert.config.engine import EngineConfig

# Ray settings of a local Ray the orchestrator (or `capsulert serve`) starts. A call in flight on a worker
# whose process died fails only once Ray has the death confirmed, or after this many milliseconds (Ray's
# default: 1000); at 100 a killed worker's callers get WorkerLost in about half a second. A Ray started by
# hand takes it as `ray start --system-config='{"timeout_ms_task_wait_for_death_info": 100}'`.
FAST_FAILURE_RAY_CONFIG = {"timeout_ms_task_wait_for_death_info": 100}


def local_gpus() -> int:
    """The GPUs of this machine that a local Ray and its workers' torch can use (CUDA_VISIBLE_DEVICES applies);
    torch is imported only when asked, so the serve CLI's CPU path stays torch-free."""
    import torch

    return torch.cuda.device_count()


class OrchestratorConfig(BaseModel):
    """How to start an Orchestrator. `engine` configures every worker's Engine; with `engine.disk_dir`
    set, worker i keeps its disk tier in `<disk_dir>/worker-i` and its pinned capsules persisted in
    `<disk_dir>/worker-i/pinned` (reloaded when the worker restarts)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    engine: EngineConfig = EngineConfig()
    num_workers: int = Field(1, ge=1, le=64)
    address: str | None = Field(None, description="Ray address to join; None starts a local Ray")
    local_num_cpus: int | None = Field(None, ge=1, description="num_cpus of a local Ray this starts")
    call_timeout_s: float = Field(60.0, gt=0)
    start_timeout_s: float = Field(300.0, gt=0)
    max_restarts: int = Field(3, ge=-1)
    worker_num_cpus: float | None = Field(None, ge=0)
    torch_threads: int | None = Field(None, ge=1, description="torch.set_num_threads in each worker")
    worker_log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] | None = Field(
        None, description="level of the workers' `capsulert` loggers, whose records reach the driver's stderr; "
                          "None: the driver's `capsulert` logger's effective level when the orchestrator starts")
    persist_pinned: bool = True
    max_queued: int = Field(1024, ge=1, description="requests waiting in the admission queue for session slots "
                            "(Namespace.admitted); one more is refused with QueueFullError")
    replicate_hot: int | None = Field(
        None, ge=1, description="copy a capsule to the least loaded worker when its best holder carries this many "
                                "more sessions (open or in flight): a hot capsule spreads on demand. None: never "
                                "(a capsule moves only when a session needs it elsewhere or on migrate())")
