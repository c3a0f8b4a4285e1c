"""The Ray Serve deployment: one replica owning the Orchestrator, with the FastAPI app as its ingress.

One replica, always: the orchestrator's router (which worker holds which capsule of which namespace)
lives in the process that owns it, so two replicas would be two disjoint capsule stores. Throughput
scales with `num_workers` (engine actors) behind the one replica, whose own work per token is small.

Direct ingress (ServerOptions.direct_ingress, the default): the replica serves HTTP on host:port itself,
with uvicorn on the event loop its app and orchestrator run on, so a request costs no hop through Serve's
proxy (another process, a Ray call and the response streamed back through Ray: a few milliseconds per
request) nor between Serve's event loops. Serve still starts, health-checks, restarts and stops the
replica; its proxy is not started (runner.py). As behind Serve's proxy, a client that goes away cancels its
request (ingress.py). Without direct ingress, Serve's proxy listens on host:port.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ray import serve

from capsulert.serve.ingress import DirectIngress
from capsulert.config.server import ServerOptions

if TYPE_CHECKING:
    from capsulert.orchestrator.orchestrator import Orchestrator
    from capsulert.serve.app import ServerState
    from capsulert.serve.tenants import Tenants

log = logging.getLogger(__name__)


@serve.deployment(name="capsulert", num_replicas=1, ray_actor_options={"num_cpus": 0},
                  health_check_period_s=10, health_check_timeout_s=60, graceful_shutdown_timeout_s=20)
@serve.ingress()
class CapsuleServer:
    """Builds the server's state once (orchestrator, tenants, tokenizer, chat template) and the app on it."""

    async def __init__(self, options: dict):
        from capsulert.orchestrator.orchestrator import Orchestrator
        from capsulert.serve.app import build_app
        from capsulert.serve.tenants import Tenants

        opts = ServerOptions.build(**options)
        logging.getLogger("capsulert").setLevel(opts.log_level)
        tenants = Tenants.load(opts.keys_file)  # refused before the workers start
        self.orchestrator = await Orchestrator.start(opts.orchestrator_config())
        try:
            self.state = server_state(opts, self.orchestrator, tenants)
            self._app = build_app(self.state)
            self._http = (await DirectIngress.start(self._app, opts.host, opts.port, opts.access_log)
                          if opts.direct_ingress else None)
        except BaseException:
            await self.orchestrator.close()
            raise
        self._poller = asyncio.ensure_future(self._poll_workers(opts.stats_interval_s))
        log.info("serving %s (%d worker(s), namespaces: %s)", opts.model_name, opts.num_workers,
                 ", ".join(tenants.namespaces))

    def __serve_build_asgi_app__(self):
        return self._app  # what Serve's proxy calls (direct_ingress=False)

    def check_health(self) -> None:
        """Serve's periodic health check: a direct-ingress server that stopped fails it (Serve restarts us)."""
        if self._http is not None:
            self._http.check()

    async def _poll_workers(self, interval: float) -> None:
        """Queue depth and sessions of the workers, for the gauges (one control call per worker)."""
        while True:
            await asyncio.sleep(interval)
            try:
                stats = await self.orchestrator.stats()
            except Exception as e:
                log.debug("worker stats failed: %s", e)
                continue
            live = [s for s in stats if "lost" not in s]
            self.state.metrics.workers(sum(s.get("queued", 0) for s in live), sum(s.get("sessions", 0) for s in live))

    async def __del__(self):
        # Serve calls this on shutdown, and also after a failed __init__ (attributes may be missing)
        http, poller, orchestrator = (getattr(self, a, None) for a in ("_http", "_poller", "orchestrator"))
        if http is not None:
            await http.stop()  # in-flight requests finish first
        if poller is not None:
            poller.cancel()
        if orchestrator is not None:
            await orchestrator.close()


def server_state(opts: ServerOptions, orchestrator: "Orchestrator", tenants: "Tenants | None" = None) -> "ServerState":
    """What the app serves with (capsulert/serve/app.py): the orchestrator, tenants (default: opts.keys_file's),
    tokenizer, chat template, admission and metrics. The replica's; bench/serving_http.py serves the same app
    in its own process."""
    from capsulert.chat.prompt import ChatRenderer
    from capsulert.serve.app import Admission, ServerState
    from capsulert.serve.edge import EdgeLimits
    from capsulert.serve.metrics import Deferred, PromMetrics
    from capsulert.serve.model_files import model_dir, vocab_size
    from capsulert.serve.plans import Limits
    from capsulert.serve.tenants import Tenants
    from capsulert.serve.token_text import TokenText

    path = model_dir(opts.engine)
    tokens = TokenText.load(path, vocab_size(opts.engine))
    prom = PromMetrics(opts.model_name)
    metrics = Deferred(prom)
    return ServerState(
        orchestrator=orchestrator, tenants=tenants or Tenants.load(opts.keys_file),
        limits=Limits(opts.model_name, opts.engine.max_seq, opts.largest_n, opts.max_tokens), tokens=tokens,
        chat=ChatRenderer(path, tokens.tokenizer, _eos_text(path, tokens)),
        admission=Admission(opts.max_inflight, metrics, orchestrator.retry_after_s),
        metrics=metrics, exposition=prom.exposition,
        edge=EdgeLimits(opts.max_body_bytes, opts.capsule_quota,
                        None if opts.capsule_quota_mb is None else opts.capsule_quota_mb << 20))


def _eos_text(path, tokens) -> str | None:
    """The text of the model's (first) EOS token, for templates that write it."""
    from capsulert.engine.stops import eos_ids_from_checkpoint

    ids = eos_ids_from_checkpoint(path, None) if path is not None else ()
    return tokens.token_id_text(ids[0]) if ids else None
