"""`capsulert serve`, the driver side: logging, Ray, Ray Serve, the app; then wait for Ctrl-C.

Logging: capsulert logs through the `capsulert` logger only. The driver and every Ray worker process (the
replica and the engine workers, through a worker setup hook) send it to stderr at --log-level
(capsulert/logs.py); workers' output reaches this terminal through Ray (log_to_driver), prefixed with the
process it came from. What the server says to its operator (where it serves, that it stops) are INFO
records of `capsulert.serve`.
"""
from __future__ import annotations

import logging
import signal
import socket
import time
from contextlib import contextmanager
from typing import Iterator

from capsulert.progress import progress_bar
from capsulert.errors import ConfigError
from capsulert.logs import LEVEL_ENV, setup_logging
from capsulert.serve.options import ServerOptions, model_dir, vocab_size

APP_NAME = "capsulert"

log = logging.getLogger("capsulert.serve")

__all__ = ["serve_forever", "setup_logging", "start", "stop"]


@contextmanager
def _steps(total: int) -> Iterator:
    """The start-up steps: a progress bar on a terminal, a log line each otherwise."""
    with progress_bar(total, "capsulert serve", progress=None, unit="step") as bar:
        started = 0

        def step(what: str) -> None:
            nonlocal started
            if bar.disable:
                log.info("%s", what)
            bar.update(started - bar.n)  # the steps before this one are done
            bar.set_postfix_str(what)
            started += 1
        yield step
        bar.update(total - bar.n)


def _check_port(host: str, port: int) -> None:
    """Refuse a port in use now, not after Ray has started (the HTTP server would fail deep inside Serve)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _on_this_node() -> dict:
    """Ray actor options that place an actor on this machine's Ray node (its "node:<ip>" resource)."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == here and node.get("NodeManagerAddress"):
            return {"resources": {f"node:{node['NodeManagerAddress']}": 0.001}}
    return {}


def _metrics_url() -> str | None:
    import ray

    here = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == here and node.get("MetricsExportPort"):
            return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    return None


def start(opts: ServerOptions) -> str | None:
    """Start Ray (or join opts.ray_address), Ray Serve and the app; returns the metrics agent's URL."""
    import ray
    from ray import serve

    from capsulert.serve.deployment import CapsuleServer
    from capsulert.serve.tenants import Tenants

    with _steps(4) as step:
        step("reading the keys file")
        tenants = Tenants.load(opts.keys_file)  # refused here, before anything starts
        step(f"preparing model {opts.model_name}")
        model_dir(opts.engine)  # the default model is generated once, here, not by every worker
        vocab_size(opts.engine)  # a checkpoint without a readable config.json is refused here
        _check_port(opts.host, opts.port)
        step("starting Ray")
        init = dict(include_dashboard=False, log_to_driver=True,
                    runtime_env={"worker_process_setup_hook": "capsulert.logs.setup_logging",
                                 "env_vars": {LEVEL_ENV: opts.log_level}})
        if opts.ray_address:
            ray.init(address=opts.ray_address, **init)
        else:
            from capsulert.orchestrator.orchestrator import FAST_FAILURE_RAY_CONFIG  # a lost worker: 503 at once

            ray.init(**init, _system_config=FAST_FAILURE_RAY_CONFIG,
                     **({"_metrics_export_port": opts.metrics_port} if opts.metrics_port else {}))
        metrics_url = _metrics_url()
        step(f"starting {opts.num_workers} worker(s) and the HTTP server")
        logging_config = {"log_level": opts.log_level, "enable_access_log": opts.access_log}
        deployment = CapsuleServer.options(max_ongoing_requests=opts.max_inflight + 64)
        if opts.direct_ingress:
            # the replica listens on host:port itself (deployment.py), so it runs on this machine, and Serve's
            # proxy is not started: the app has no Serve route
            serve.start(proxy_location="Disabled", logging_config=logging_config)
            deployment = deployment.options(ray_actor_options={"num_cpus": 0, **_on_this_node()})
        else:
            serve.start(http_options={"host": opts.host, "port": opts.port}, logging_config=logging_config)
        app = deployment.bind(opts.model_dump(), metrics_url)
        serve.run(app, name=APP_NAME, route_prefix=None if opts.direct_ingress else "/",
                  logging_config=logging_config)
    log.info("serving %r at http://%s:%d/v1 (%s)", opts.model_name, opts.host, opts.port,
             "API keys for " + ", ".join(tenants.namespaces) if not tenants.open else "no API keys: one namespace")
    if metrics_url:
        log.info("Prometheus metrics at http://%s:%d/metrics (all of Ray's at %s)", opts.host, opts.port, metrics_url)
    return metrics_url


def stop() -> None:
    import ray
    from ray import serve

    if not ray.is_initialized():  # refused before Ray started: nothing to stop
        return
    log.info("stopping")
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def serve_forever(opts: ServerOptions) -> int:
    """Serve until Ctrl-C (SIGINT) or SIGTERM; 0 on a clean stop."""
    setup_logging(opts.log_level)
    # plain flags, no threading.Event: the handler runs on the main thread, and Event.set there deadlocks
    # when the signal lands while that thread holds the Event's lock inside Event.wait
    state = {"stopping": False, "serving": False}

    def on_signal(*_) -> None:
        state["stopping"] = True
        if not state["serving"]:  # still starting: abandon the start at once
            raise KeyboardInterrupt

    # explicit handlers: a shell starts background jobs with SIGINT ignored, and Python then never turns
    # it into KeyboardInterrupt; a server must stop on it all the same
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        start(opts)
        for sig in previous:  # again: Ray's core installs its own (crash-report) handler as it starts
            signal.signal(sig, on_signal)
        state["serving"] = True
        log.info("press Ctrl-C to stop")
        while not state["stopping"]:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        try:
            stop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return 0
