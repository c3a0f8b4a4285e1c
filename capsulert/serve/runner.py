"""`capsulert serve`, the driver side: logging, Ray, Ray Serve, the app; then wait for Ctrl-C.

Logging: capsulert logs through the `capsulert` logger only. The driver and every Ray worker process (the
replica and the engine workers, through a worker setup hook) send it to stderr at --log-level; workers'
output reaches this terminal through Ray (log_to_driver), prefixed with the process it came from.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

from capsulert.errors import ConfigError
from capsulert.serve.options import ServerOptions, model_dir, vocab_size

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LEVEL_ENV = "CAPSULERT_LOG_LEVEL"
APP_NAME = "capsulert"

log = logging.getLogger("capsulert.serve")


def setup_logging(level: str | None = None) -> None:
    """Send the `capsulert` logger to stderr (once per process); the level from LEVEL_ENV by default."""
    logger = logging.getLogger("capsulert")
    logger.setLevel(level or os.environ.get(LEVEL_ENV, "INFO"))
    if not any(getattr(h, "_capsulert", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        handler._capsulert = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False  # Ray workers configure the root logger too: one line per record


@contextmanager
def _steps(total: int) -> Iterator:
    """A progress bar over the start-up steps (tqdm when installed, log lines otherwise)."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is None or not sys.stderr.isatty():
        def step(what: str) -> None:
            log.info("%s", what)
        yield step
        return
    bar = tqdm(total=total, desc="capsulert serve", unit="step", file=sys.stderr, leave=False,
               bar_format="{desc}: {n_fmt}/{total_fmt} {postfix}")
    first = True

    def step(what: str) -> None:
        nonlocal first
        if not first:
            bar.update(1)
        first = False
        bar.set_postfix_str(what)
    try:
        yield step
        bar.update(1)
    finally:
        bar.close()


def _check_port(host: str, port: int) -> None:
    """Refuse a port in use now, not after Ray has started (Serve's proxy would fail deep inside)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


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
                    runtime_env={"worker_process_setup_hook": "capsulert.serve.runner.setup_logging",
                                 "env_vars": {LEVEL_ENV: opts.log_level}})
        if opts.ray_address:
            ray.init(address=opts.ray_address, **init)
        else:
            ray.init(**init, **({"_metrics_export_port": opts.metrics_port} if opts.metrics_port else {}))
        metrics_url = _metrics_url()
        step(f"starting {opts.num_workers} worker(s) and the HTTP server")
        serve.start(http_options={"host": opts.host, "port": opts.port},
                    logging_config={"log_level": opts.log_level, "enable_access_log": opts.access_log})
        app = CapsuleServer.options(max_ongoing_requests=opts.max_inflight + 64).bind(opts.model_dump(), metrics_url)
        serve.run(app, name=APP_NAME, route_prefix="/",
                  logging_config={"log_level": opts.log_level, "enable_access_log": opts.access_log})
    print(f"capsulert: serving {opts.model_name!r} at http://{opts.host}:{opts.port}/v1 "
          f"({'API keys for ' + ', '.join(tenants.namespaces) if not tenants.open else 'no API keys: one namespace'})",
          file=sys.stderr, flush=True)
    if metrics_url:
        print(f"capsulert: Prometheus metrics at http://{opts.host}:{opts.port}/metrics "
              f"(all of Ray's at {metrics_url})", file=sys.stderr, flush=True)
    return metrics_url


def stop() -> None:
    import ray
    from ray import serve

    if not ray.is_initialized():  # refused before Ray started: nothing to stop
        return
    print("capsulert: stopping", file=sys.stderr, flush=True)
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def serve_forever(opts: ServerOptions) -> int:
    """Serve until Ctrl-C (SIGINT) or SIGTERM; 0 on a clean stop."""
    setup_logging(opts.log_level)
    stopping, serving = threading.Event(), threading.Event()

    def on_signal(*_) -> None:
        stopping.set()
        if not serving.is_set():  # still starting: abandon the start at once
            raise KeyboardInterrupt

    # explicit handlers: a shell starts background jobs with SIGINT ignored, and Python then never turns
    # it into KeyboardInterrupt; a server must stop on it all the same
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        start(opts)
        for sig in previous:  # again: Ray's core installs its own (crash-report) handler as it starts
            signal.signal(sig, on_signal)
        serving.set()
        print("capsulert: press Ctrl-C to stop", file=sys.stderr, flush=True)
        while not stopping.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        try:
            stop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return 0
