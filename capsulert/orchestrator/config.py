"""OrchestratorConfig and the validation of every argument at the API edge (pydantic -> typed errors)."""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, TypeAdapter, ValidationError, conlist

from capsulert.capsule_store import validate_name
from capsulert.errors import CapsuleRTError, ConfigError, InvalidRequestError, InvalidTokenError
from capsulert.worker.engine_config import EngineConfig
from capsulert.worker.sampler import SamplingParams


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
    persist_pinned: bool = True


_Tokens = TypeAdapter(Union[StrictStr, conlist(StrictInt, min_length=1)])
_Tier = TypeAdapter(Literal["gpu", "host", "disk"])


def _fail(err: type[CapsuleRTError], what: str, value: Any, e: ValidationError) -> CapsuleRTError:
    msg = "; ".join(x["msg"] for x in e.errors(include_url=False))
    return err(f"{what}: {value!r:.80} is invalid ({msg})")


def tokens_arg(value: Any, what: str = "tokens") -> str | list[int]:
    """A str or a non-empty list of ints (range checks happen in the engine, which changes nothing on refusal)."""
    if isinstance(value, tuple):
        value = list(value)
    elif hasattr(value, "tolist") and not isinstance(value, (str, list)):
        value = value.tolist()
    try:
        out = _Tokens.validate_python(value)
    except ValidationError as e:
        raise _fail(InvalidTokenError, what, value, e) from None
    if isinstance(out, str) and not out:
        raise InvalidTokenError(f"{what}: empty text")
    return out


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
