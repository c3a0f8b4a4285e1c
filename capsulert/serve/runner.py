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
from capsulert.model_notice import random_weights_notice
from capsulert.config.orchestrator import FAST_FAILURE_RAY_CONFIG, local_gpus
from capsulert.config.server import ServerOptions
from capsulert.serve.model_files import model_dir, vocab_size
from capsulert.serve.tenants import Tenants

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


def _check_gpus(opts: ServerOptions, gpus: float, where: str) -> None:
    """--device cuda takes a GPU per worker: refuse a machine or cluster without enough, in one line."""
    if opts.engine.device == "cuda" and gpus < opts.num_workers:
        raise ConfigError(f"--device cuda: each of the {opts.num_workers} worker(s) takes a GPU of its own, and "
                          f"{where} has {gpus:g}; use --device cpu (or auto), or fewer --num-workers")


def _on_this_node() -> dict:
    """Ray actor options that place an actor on this machine's Ray node (its "node:<ip>" resource)."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == here and node.get("NodeManagerAddress"):
            return {"resources": {f"node:{node['NodeManagerAddress']}": 0.001}}
    return {}


def _ray_metrics_url() -> str | None:
    import ray

    here = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == here and node.get("MetricsExportPort", -1) > 0:
            return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    return None


def _local_ray_init(opts: ServerOptions) -> dict:
    """ray.init arguments for a Ray this server starts: a lost worker seen at once (FAST_FAILURE_RAY_CONFIG:
    503 at once), and Ray's own metrics exported on the port asked for, else not collected at all, so that
    Ray's agent opens no exporter (on this machine's network address) that nobody asked for."""
    system = dict(FAST_FAILURE_RAY_CONFIG)
    if opts.ray_metrics_port is not None:
        return {"_system_config": system, "_metrics_export_port": opts.ray_metrics_port}
    return {"_system_config": {**system, "enable_metrics_collection": False}}


def start(opts: ServerOptions) -> None:
    """Start Ray (or join opts.ray_address), Ray Serve and the app."""
    import ray
    from ray import serve

    from capsulert.serve.deployment import CapsuleServer

    with _steps(4) as step:
        step("reading the keys file")
        # refusals here, in one line each, before anything starts (inside Serve, a replica that cannot start
        # is retried, each time with its traceback)
        tenants = Tenants.load(opts.keys_file)
        _check_port(opts.host, opts.port)
        if not opts.ray_address and opts.engine.device == "cuda":  # a local Ray has this machine's GPUs
            _check_gpus(opts, local_gpus(), "this machine")  # (torch is imported for CUDA only)
        notice = random_weights_notice(opts.engine.model)
        if notice:  # said once the refusals are past, before Ray's own start-up lines (again in the serving line)
            log.warning("note: %s", notice)
        step(f"preparing model {opts.model_name}")
        model_dir(opts.engine)  # the default model is generated once, here, not by every worker
        vocab_size(opts.engine)  # a checkpoint without a readable config.json is refused here
        step("starting Ray")
        init = dict(include_dashboard=False, log_to_driver=True,
                    runtime_env={"worker_process_setup_hook": "capsulert.logs.setup_logging",
                                 "env_vars": {LEVEL_ENV: opts.log_level}})
        if opts.ray_address:
            ray.init(address=opts.ray_address, **init)
            _check_gpus(opts, ray.cluster_resources().get("GPU", 0), "the Ray cluster")
        else:
            ray.init(**init, **_local_ray_init(opts))
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
        app = deployment.bind(opts.model_dump())
        serve.run(app, name=APP_NAME, route_prefix=None if opts.direct_ingress else "/",
                  logging_config=logging_config)
    log.info("%s", serving_line(opts, tenants))
    log.info("Prometheus metrics at http://%s:%d/metrics", opts.host, opts.port)
    if opts.ray_metrics_port is not None:  # asked for: Ray's agent listens on this machine's address
        log.info("Ray's and Ray Serve's own metrics at %s", _ray_metrics_url())


def serving_line(opts: ServerOptions, tenants: Tenants) -> str:
    """What the server says once it serves: where, for whom, and whether its model's text means anything."""
    keys = "API keys for " + ", ".join(tenants.namespaces) if not tenants.open else "no API keys: one namespace"
    notice = random_weights_notice(opts.engine.model)
    return (f"serving {opts.model_name!r} at http://{opts.host}:{opts.port}/v1 ({keys})"
            + (f"; {notice}" if notice else ""))


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
