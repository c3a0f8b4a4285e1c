"""OrchestratorConfig and the validation of every argument at the API edge (pydantic -> typed errors)."""
from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from capsulert.capsule_store import validate_name
from capsulert.errors import CapsuleRTError, ConfigError, InvalidRequestError, InvalidTokenError
from capsulert.config.engine import EngineConfig
from capsulert.protocol.sampling import SamplingParams
from capsulert.protocol.tokens import check_text


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


_Tier = TypeAdapter(Literal["device", "gpu", "host", "disk"])  # "gpu": the older name of "device"


def _fail(err: type[CapsuleRTError], what: str, value: Any, e: ValidationError) -> CapsuleRTError:
    msg = "; ".join(x["msg"] for x in e.errors(include_url=False))
    return err(f"{what}: {value!r:.80} is invalid ({msg})")


def tokens_arg(value: Any, what: str = "tokens") -> str | list[int]:
    """A non-empty str of valid Unicode, or a non-empty list of ints from a list, a tuple or a 1-D integer
    array / tensor (range checks happen in the engine, which changes nothing on refusal). Bytes, dicts,
    sets and every other type are refused: none is a token sequence with a defined order and meaning."""
    if isinstance(value, str):
        if not value:
            raise InvalidTokenError(f"{what}: empty text")
        try:
            return check_text(value)
        except InvalidTokenError as e:
            raise InvalidTokenError(f"{what}: {e}") from None
    if isinstance(value, (list, tuple)):
        out = list(value)
    elif _is_array(value):
        if getattr(value, "ndim", None) != 1:
            raise InvalidTokenError(f"{what}: a token array must be 1-D, got shape {tuple(value.shape)}")
        out = value.tolist()
    else:
        raise InvalidTokenError(f"{what}: expected text (str), a list or tuple of ints or a 1-D integer array, "
                                f"got {type(value).__name__}")
    if not out:
        raise InvalidTokenError(f"{what}: empty token list")
    for t in out:
        if isinstance(t, bool) or not isinstance(t, int):
            raise InvalidTokenError(f"{what}: {t!r:.40} is not an int token id")
    return out


def _is_array(value: Any) -> bool:
    """A torch tensor or a numpy array (by module, so numpy is never imported here)."""
    return isinstance(value, torch.Tensor) or (type(value).__module__ == "numpy" and hasattr(value, "tolist"))


def int_arg(value: Any, what: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidRequestError(f"{what} must be an int >= {minimum}, got {value!r:.80}")
    return value


def tier_arg(value: Any) -> str:
    try:
        return _Tier.validate_python(value)
    except ValidationError as e:
        raise _fail(ConfigError, "tier", value, e) from None


def name_arg(value: Any) -> str:
    return validate_name(value)


def sampling_arg(value: Any) -> dict | None:
    """SamplingParams | dict | None -> a plain dict for the actor (or None = greedy)."""
    if value is None:
        return None
    try:
        sp = value if isinstance(value, SamplingParams) else SamplingParams.model_validate(value)
    except ValidationError as e:
        raise _fail(InvalidRequestError, "sampling", value, e) from None
    return sp.model_dump()


def sampling_params(value: Any) -> SamplingParams | None:
    """SamplingParams | dict | None -> validated SamplingParams for a request (None = greedy)."""
    d = sampling_arg(value)
    return None if d is None else SamplingParams(**d)


def samplings_arg(value: Any, n: int) -> list[dict | None]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise InvalidRequestError(f"sampling: {len(value)} SamplingParams given for {n} branches")
        return [sampling_arg(v) for v in value]
    return [sampling_arg(value)] * n


def seeded(base: SamplingParams | dict | None, n: int, default_temperature: float = 0.8) -> list[dict]:
    """n sampling dicts from one base: seed base.seed + i (0 + i when unset). None -> temperature 0.8."""
    d = sampling_arg(base) or SamplingParams(temperature=default_temperature).model_dump()
    seed0 = d.get("seed") or 0
    return [{**d, "seed": seed0 + i} for i in range(n)]
