"""ServerOptions: everything `capsulert serve` is configured with, validated once at the edge (pydantic).

The driver builds it from the command line and hands it, as a plain dict, to the Ray Serve replica,
which validates it again: both sides agree on one schema and the replica never trusts a bare dict.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from capsulert.config.engine import RANDOM_PREFIX, EngineConfig
from capsulert.config.orchestrator import OrchestratorConfig
from capsulert.errors import ConfigError
from capsulert.protocol.sampling import DEFAULT_MAX_TOKENS

# where a server's orchestrator defaults differ from a library caller's (config/orchestrator.py):
# - engine.prefix_cache: clients resend their conversations, so a server reuses the longest cached prefix of every
#   prompt (exact: engine/prefix_reuse.py);
# - call_timeout_s: an HTTP request may hold a long generate, bounded by the client's own timeout;
# - max_queued: the generation requests in flight, running or queued for sessions, before one more is refused
#   with 429 and Retry-After. A request waits in the admission queue for all of its sessions (bounded by this,
#   not by time), so the engine's slot_wait_s is only a backstop for a worker busier than the rest.
# - engine.capsule_budgets: clients make capsules; unbounded tiers let one key grow a worker's memory without limit
#   (150 capsules: 580 -> 1,708 MB), so a server's tiers have budgets (MB; `serve --device-budget-mb` etc.)
SERVER_TIER_BUDGETS_MB = {"device": 4096, "host": 16384, "disk": 65536}
SERVER_ORCHESTRATOR_DEFAULTS: dict[str, Any] = {
    "engine": {"prefix_cache": True, "capsule_budgets": {t: mb << 20 for t, mb in SERVER_TIER_BUDGETS_MB.items()}},
    "call_timeout_s": 600.0, "max_queued": 256}


class ServerOptions(BaseModel):
    """`orchestrator` configures the workers the server runs on (its engine, their number, timeouts, the
    admission bound); every other field is the HTTP server's own."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    orchestrator: OrchestratorConfig = OrchestratorConfig(**SERVER_ORCHESTRATOR_DEFAULTS)
    served_model_name: str | None = Field(None, description="the model id clients send; default: derived from engine.model")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    keys_file: str | None = Field(None, description="YAML mapping API keys to namespaces; None: no auth, one namespace")
    max_n: int | None = Field(None, ge=1, description="largest n (choices per prompt); default: engine.slots")
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1, description=(
        "the tokens a reply may generate: a chat or responses request that gives no max_tokens gets this many, and "
        "one that asks for more is refused (400). A reply also ends where its session reaches engine.max_seq "
        "(finish_reason 'length'), whichever comes first"))
    ray_metrics_port: int | None = Field(None, ge=0, le=65535, description=(
        "export Ray's and Ray Serve's own metrics from Ray's metrics agent on this port (a local Ray only); None: "
        "Ray's metrics agent collects and exports none, and the server's GET /metrics has capsulert's. (Ray's "
        "autoscaler and dashboard processes serve a few metrics of their own on ports 44217 and 44227 whenever "
        "prometheus_client is installed, as it is here; Ray has no setting that turns those off)"))
    max_body_mb: float = Field(8.0, gt=0, description="largest request body (MB); a larger one is refused with 413")
    capsule_quota: int | None = Field(1000, ge=0, description="capsules per tenant (namespace); None: no quota")
    capsule_quota_mb: int | None = Field(None, ge=0, description="MB of capsules per tenant; None: no quota")
    stats_interval_s: float = Field(5.0, gt=0, description="how often the queue-depth gauge polls the workers")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    access_log: bool = False
    direct_ingress: bool = Field(True, description=(
        "the replica serves HTTP on host:port itself (uvicorn on the replica's event loop): a request reaches "
        "the app without the hop through Ray Serve's proxy; False: Serve's proxy listens on host:port and "
        "forwards every request to the replica (one more process and round trip per request)"))

    # read-only views of the orchestrator's fields the server reads most
    @property
    def engine(self) -> EngineConfig:
        return self.orchestrator.engine

    @property
    def num_workers(self) -> int:
        return self.orchestrator.num_workers

    @property
    def max_inflight(self) -> int:
        """Generation requests in flight (running or queued for sessions) before a 429: the admission bound."""
        return self.orchestrator.max_queued

    @property
    def ray_address(self) -> str | None:
        return self.orchestrator.address

    @classmethod
    def build(cls, **values) -> "ServerOptions":
        """Validated options; relative paths made absolute here, since Ray's processes run elsewhere."""
        values = _prepare(values)
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            raise ConfigError("invalid server options: " + "; ".join(
                f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors(include_url=False))) from None

    @property
    def model_name(self) -> str:
        """The id /v1/models lists and requests must name."""
        if self.served_model_name:
            return self.served_model_name
        model = self.engine.model
        if model == "default":
            return "default"
        if model.startswith(RANDOM_PREFIX):
            return "random-" + Path(model[len(RANDOM_PREFIX):]).stem
        return Path(model).resolve().name

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * (1 << 20))

    @property
    def largest_n(self) -> int:
        return self.max_n or self.engine.slots

    def orchestrator_config(self) -> dict:
        return self.orchestrator.model_dump()


def _prepare(values: dict) -> dict:
    def absolute(p):
        return None if p is None else str(Path(p).expanduser().resolve())

    values = dict(values)
    if values.get("keys_file") is not None:
        values["keys_file"] = absolute(values["keys_file"])
    orch = values.get("orchestrator", {})
    if isinstance(orch, dict):
        orch = {**SERVER_ORCHESTRATOR_DEFAULTS, **orch}
        engine = orch["engine"]
        if isinstance(engine, dict):
            engine = {**SERVER_ORCHESTRATOR_DEFAULTS["engine"], **engine}
            model = engine.get("model")
            if isinstance(model, str) and model.startswith(RANDOM_PREFIX):
                engine["model"] = RANDOM_PREFIX + absolute(model[len(RANDOM_PREFIX):])
            elif isinstance(model, str) and model != "default":
                engine["model"] = absolute(model)
            for key in ("disk_dir", "cache_dir"):
                if isinstance(engine.get(key), str):
                    engine[key] = absolute(engine[key])
            orch["engine"] = engine
        values["orchestrator"] = orch
    return values
