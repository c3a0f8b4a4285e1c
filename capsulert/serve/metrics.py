"""Prometheus metrics of the server, kept with prometheus_client in the replica and served by its own
`GET /metrics`, on the server's listen address: nothing else listens for them.

Every series is `capsulert_*` with labels of ours only: `model` (the served model's name) and, where they
apply, `namespace` (the caller's, from its API key; empty for a request refused before its key was read),
`route` (completions, chat, responses, models, capsules, metrics, other), `status` (the HTTP status; a capsule lookup's
hit or miss) and `tier`. A namespace is a tenant's label chosen by the operator in the keys file, never the
key.

    capsulert_requests_total{model,namespace,route,status}  every request answered, refusals included (a body
                                                           that does not validate, a bad key, an unknown route);
                                                           499: the client went away first; a stream that
                                                           failed after its status line counts the error's status
    capsulert_request_seconds{model,namespace,route}        request start to the last byte of the response
    capsulert_ttft_seconds{model,namespace,route}           request start to first generated token (streams)
    capsulert_prompt_tokens_total{model,namespace,route}    prompt tokens (those restored from capsules included)
    capsulert_generated_tokens_total{model,namespace,route} completion tokens; rate() of it is tokens/s
    capsulert_cached_prompt_tokens_total{model,namespace,route}  prompt tokens restored instead of prefilled
                                                           (capsule or prefix cache); over prompt_tokens, the hit rate
    capsulert_capsule_lookups_total{model,namespace,status} requests that named a capsule: hit or miss
    capsulert_capsule_hits_total{model,namespace,tier}      of the hits, the tier the capsule was read from
    capsulert_restore_seconds{model,tier}                   restoring a request's capsule into a new session
    capsulert_inflight_requests{model}                      generation requests in flight in the server
    capsulert_worker_queue_depth{model}                     requests waiting in the workers' step schedulers
    capsulert_worker_sessions{model}                        open sessions on the workers

A request's labels (route, namespace) travel with it in a context variable: `CountRequests`, the app's
outermost middleware, opens a `RequestLabels` per request and counts the request when its response ends;
the tenant lookup fills in the namespace; whatever records on the request's behalf reads them from there.
"""
from __future__ import annotations

import asyncio
import contextvars
import time
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BOUNDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
PREFIX = "capsulert_"
CONTENT_TYPE = CONTENT_TYPE_LATEST
CLIENT_GONE = 499  # nginx's "client closed request": the client went away before its status line
_ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/responses": "responses",
           "/v1/models": "models", "/v1/capsules": "capsules", "/metrics": "metrics"}


def route_of(path: str) -> str:
    """The `route` label of a request path: one of a few fixed names, whatever the path (no label per path)."""
    if path in _ROUTES:
        return _ROUTES[path]
    return "capsules" if path.startswith("/v1/capsules/") else "models" if path.startswith("/v1/models/") else "other"


class RequestLabels:
    """The labels of the request being served: its route, and its namespace once its API key was read."""

    __slots__ = ("route", "namespace", "failed_status")

    def __init__(self, route: str):
        self.route, self.namespace = route, ""
        self.failed_status: int | None = None  # a stream that failed after its status line went out


current_request: contextvars.ContextVar[RequestLabels | None] = contextvars.ContextVar("capsulert_request",
                                                                                       default=None)


def request_namespace(namespace: str) -> None:
    """Label the current request (if counted) with the namespace its key maps to."""
    labels = current_request.get()
    if labels is not None:
        labels.namespace = namespace


def stream_failed(status: int) -> None:
    """The current request's stream failed with `status` after its 200 status line: count it as that."""
    labels = current_request.get()
    if labels is not None:
        labels.failed_status = status


def _namespace() -> str:
    labels = current_request.get()
    return labels.namespace if labels is not None else ""


class ServerMetrics(Protocol):
    def request(self, route: str, status: int, seconds: float) -> None: ...
    def tokens(self, route: str, prompt: int, completion: int, cached: int = 0) -> None: ...
    def ttft(self, route: str, seconds: float) -> None: ...
    def capsule_lookup(self, hit: bool, restore_s: float | None = None, tier: str | None = None) -> None: ...
    def inflight(self, n: int) -> None: ...
    def workers(self, queued: int, sessions: int) -> None: ...


class NoMetrics(ServerMetrics):
    """Records nothing (an app built without metrics, in tests of the HTTP layer alone): the protocol's
    methods, whose bodies do nothing."""


class PromMetrics:
    """The server's metrics in a registry of their own (only these are exposed, none of the process's)."""

    def __init__(self, model: str):
        self.registry = CollectorRegistry(auto_describe=True)
        r, m = self.registry, model
        by_route = ("model", "namespace", "route")
        self._requests = Counter(PREFIX + "requests", "requests answered, refusals included",
                                 ("model", "namespace", "route", "status"), registry=r)
        self._latency = Histogram(PREFIX + "request_seconds", "request latency", by_route, buckets=LATENCY_BOUNDS,
                                  registry=r)
        self._ttft = Histogram(PREFIX + "ttft_seconds", "time to first token (streamed requests)", by_route,
                               buckets=LATENCY_BOUNDS, registry=r)
        self._prompt = Counter(PREFIX + "prompt_tokens", "prompt tokens of generation requests", by_route, registry=r)
        self._generated = Counter(PREFIX + "generated_tokens", "tokens generated", by_route, registry=r)
        self._cached = Counter(PREFIX + "cached_prompt_tokens", "prompt tokens restored instead of prefilled",
                               by_route, registry=r)
        self._lookups = Counter(PREFIX + "capsule_lookups", "requests that named a capsule: hit or miss",
                                ("model", "namespace", "status"), registry=r)
        self._hits = Counter(PREFIX + "capsule_hits", "capsule hits by the tier the capsule was read from",
                             ("model", "namespace", "tier"), registry=r)
        self._restore = Histogram(PREFIX + "restore_seconds", "restore of a request's capsule", ("model", "tier"),
                                  buckets=LATENCY_BOUNDS, registry=r)
        self._inflight = Gauge(PREFIX + "inflight_requests", "generation requests in flight", ("model",),
                               registry=r).labels(m)
        self._queued = Gauge(PREFIX + "worker_queue_depth", "requests waiting in the workers' schedulers", ("model",),
                             registry=r).labels(m)
        self._sessions = Gauge(PREFIX + "worker_sessions", "open sessions on the workers", ("model",),
                               registry=r).labels(m)
        self.model = m
        # the labelled series, by their labels: prometheus_client's labels() checks and locks on every call
        self._series: dict[tuple, object] = {}

    def _of(self, metric, *labels: str):
        key = (id(metric), *labels)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = metric.labels(self.model, *labels)
        return series

    def exposition(self) -> bytes:
        """The Prometheus text exposition of these metrics (GET /metrics)."""
        return generate_latest(self.registry)

    def request(self, namespace: str, route: str, status: int, seconds: float) -> None:
        self._of(self._requests, namespace, route, str(status)).inc()
        self._of(self._latency, namespace, route).observe(seconds)

    def tokens(self, namespace: str, route: str, prompt: int, completion: int, cached: int = 0) -> None:
        for counter, n in ((self._prompt, prompt), (self._cached, cached), (self._generated, completion)):
            if n:
                self._of(counter, namespace, route).inc(n)

    def ttft(self, namespace: str, route: str, seconds: float) -> None:
        self._of(self._ttft, namespace, route).observe(seconds)

    def capsule_lookup(self, namespace: str, hit: bool, restore_s: float | None = None,
                       tier: str | None = None) -> None:
        self._of(self._lookups, namespace, "hit" if hit else "miss").inc()
        if hit and tier is not None:
            self._of(self._hits, namespace, tier).inc()
        if restore_s is not None:
            self._of(self._restore, tier or "").observe(restore_s)

    def inflight(self, n: int) -> None:
        self._inflight.set(n)

    def workers(self, queued: int, sessions: int) -> None:
        self._queued.set(queued)
        self._sessions.set(sessions)


class Deferred:
    """The app's ServerMetrics: records into `metrics` (PromMetrics) on the event loop's next turn, not in the
    request's own step, so a request's answer goes out first; labelled with the namespace of the request
    being served (current_request), read at the call. Calls keep their order; those made in one turn are
    recorded by one callback."""

    def __init__(self, metrics):
        self.metrics = metrics
        self._due: list[tuple] = []  # (record, args) waiting for the loop's next turn

    def _later(self, record, *args) -> None:
        if not self._due:
            try:
                asyncio.get_running_loop().call_soon(self._record)
            except RuntimeError:  # no loop running: record now
                record(*args)
                return
        self._due.append((record, args))

    def _record(self) -> None:
        due, self._due = self._due, []
        for record, args in due:
            record(*args)

    def request(self, route: str, status: int, seconds: float) -> None:
        self._later(self.metrics.request, _namespace(), route, status, seconds)

    def tokens(self, route: str, prompt: int, completion: int, cached: int = 0) -> None:
        self._later(self.metrics.tokens, _namespace(), route, prompt, completion, cached)

    def ttft(self, route: str, seconds: float) -> None:
        self._later(self.metrics.ttft, _namespace(), route, seconds)

    def capsule_lookup(self, hit: bool, restore_s: float | None = None, tier: str | None = None) -> None:
        self._later(self.metrics.capsule_lookup, _namespace(), hit, restore_s, tier)

    def inflight(self, n: int) -> None:
        self._later(self.metrics.inflight, n)

    def workers(self, queued: int, sessions: int) -> None:
        self._later(self.metrics.workers, queued, sessions)


class CountRequests:
    """ASGI middleware counting every HTTP request once its response ends (or its client went away), with
    its route, namespace and status: refusals anywhere (FastAPI's validation, the key check, an unknown
    route) count like answers."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        labels = RequestLabels(route_of(scope["path"]))
        token = current_request.set(labels)
        status: int | None = None

        async def counted_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, counted_send)
        except Exception:  # answered with a 500 by the outermost handler (Starlette's ServerErrorMiddleware)
            status = status or 500
            raise
        finally:  # cancelled before a status line: the client went away
            status = labels.failed_status or status or CLIENT_GONE
            self.metrics.request(labels.route, status, time.perf_counter() - t0)
            current_request.reset(token)
