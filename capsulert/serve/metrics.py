"""Prometheus metrics of the server, through `ray.util.metrics`.

Ray exports them (prefixed `ray_`, counters suffixed `_total`) from each node's metrics agent, next to
Ray's and Ray Serve's own metrics; `capsulert serve` prints the agent's address, and the server's
`GET /metrics` returns the capsulert lines of it. Labels never name a tenant: the metrics are shared by
every namespace, and a key holder must not learn the others' names from them.

    capsulert_requests_total{route,status}        requests answered, by route and HTTP status
    capsulert_prompt_tokens_total{route}          prompt tokens (those restored from capsules included)
    capsulert_generated_tokens_total{route}       completion tokens; rate() of it is tokens/s
    capsulert_cached_prompt_tokens_total{route}   prompt tokens restored instead of prefilled (capsule or prefix
                                                  cache); over prompt_tokens it is the prefix cache's hit rate
    capsulert_capsule_lookups_total{outcome}      requests that named a capsule: hit or miss
    capsulert_capsule_hits_total{tier}            of the hits, the tier the capsule was read from: gpu, host, disk
    capsulert_restore_seconds                     restoring a request's capsule into a new session
    capsulert_ttft_seconds{route}                 request start to first generated token (streamed requests)
    capsulert_request_seconds{route}              request start to the last byte of the response
    capsulert_inflight_requests                   generation requests in flight in the server
    capsulert_worker_queue_depth                  requests waiting in the workers' step schedulers
    capsulert_worker_sessions                     open sessions on the workers
"""
from __future__ import annotations

import asyncio
from typing import Protocol

LATENCY_BOUNDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
PREFIX = "capsulert_"


class ServerMetrics(Protocol):
    def request(self, route: str, status: int, seconds: float) -> None: ...
    def tokens(self, route: str, prompt: int, completion: int, cached: int = 0) -> None: ...
    def ttft(self, route: str, seconds: float) -> None: ...
    def capsule_lookup(self, hit: bool, restore_s: float | None = None, tier: str | None = None) -> None: ...
    def inflight(self, n: int) -> None: ...
    def workers(self, queued: int, sessions: int) -> None: ...


class NoMetrics(ServerMetrics):
    """Records nothing (an app built outside Ray, in tests of the HTTP layer alone): the protocol's methods,
    whose bodies do nothing."""


class RayMetrics:
    """The metrics of one server replica (made inside the Ray process that serves)."""

    def __init__(self) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        self._requests = Counter(PREFIX + "requests", "requests answered", tag_keys=("route", "status"))
        self._prompt = Counter(PREFIX + "prompt_tokens", "prompt tokens of generation requests", tag_keys=("route",))
        self._generated = Counter(PREFIX + "generated_tokens", "tokens generated", tag_keys=("route",))
        self._cached = Counter(PREFIX + "cached_prompt_tokens", "prompt tokens restored instead of prefilled",
                               tag_keys=("route",))
        self._lookups = Counter(PREFIX + "capsule_lookups", "requests that named a capsule", tag_keys=("outcome",))
        self._hits = Counter(PREFIX + "capsule_hits", "capsule hits by the tier the capsule was read from",
                             tag_keys=("tier",))
        self._restore = Histogram(PREFIX + "restore_seconds", "restore of a request's capsule", LATENCY_BOUNDS)
        self._ttft = Histogram(PREFIX + "ttft_seconds", "time to first token (streamed requests)", LATENCY_BOUNDS,
                               tag_keys=("route",))
        self._latency = Histogram(PREFIX + "request_seconds", "request latency", LATENCY_BOUNDS, tag_keys=("route",))
        self._inflight = Gauge(PREFIX + "inflight_requests", "generation requests in flight")
        self._queued = Gauge(PREFIX + "worker_queue_depth", "requests waiting in the workers' schedulers")
        self._sessions = Gauge(PREFIX + "worker_sessions", "open sessions on the workers")

    def request(self, route: str, status: int, seconds: float) -> None:
        self._requests.inc(1, tags={"route": route, "status": str(status)})
        self._latency.observe(seconds, tags={"route": route})

    def tokens(self, route: str, prompt: int, completion: int, cached: int = 0) -> None:
        if prompt:
            self._prompt.inc(prompt, tags={"route": route})
        if cached:
            self._cached.inc(cached, tags={"route": route})
        if completion:
            self._generated.inc(completion, tags={"route": route})

    def ttft(self, route: str, seconds: float) -> None:
        self._ttft.observe(seconds, tags={"route": route})

    def capsule_lookup(self, hit: bool, restore_s: float | None = None, tier: str | None = None) -> None:
        self._lookups.inc(1, tags={"outcome": "hit" if hit else "miss"})
        if hit and tier is not None:
            self._hits.inc(1, tags={"tier": tier})
        if restore_s is not None:
            self._restore.observe(restore_s)

    def inflight(self, n: int) -> None:
        self._inflight.set(n)

    def workers(self, queued: int, sessions: int) -> None:
        self._queued.set(queued)
        self._sessions.set(sessions)


class Deferred:
    """Records into `metrics` on the event loop's next turn, not in the request's own step: a request's
    answer goes out without waiting for Ray's metric calls (2-5 us each, ~20 us a request), which run when
    the loop next waits (for a worker, or the next request). Calls keep their order."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    @staticmethod
    def _later(record, *args) -> None:
        try:
            asyncio.get_running_loop().call_soon(record, *args)
        except RuntimeError:  # no loop running: record now
            record(*args)

    def request(self, route: str, status: int, seconds: float) -> None:
        self._later(self.metrics.request, route, status, seconds)

    def tokens(self, route: str, prompt: int, completion: int, cached: int = 0) -> None:
        self._later(self.metrics.tokens, route, prompt, completion, cached)

    def ttft(self, route: str, seconds: float) -> None:
        self._later(self.metrics.ttft, route, seconds)

    def capsule_lookup(self, hit: bool, restore_s: float | None = None, tier: str | None = None) -> None:
        self._later(self.metrics.capsule_lookup, hit, restore_s, tier)

    def inflight(self, n: int) -> None:
        self._later(self.metrics.inflight, n)

    def workers(self, queued: int, sessions: int) -> None:
        self._later(self.metrics.workers, queued, sessions)


def capsulert_lines(exposition: str) -> str:
    """The capsulert metrics of a Prometheus text exposition (Ray's agent serves every Ray metric)."""
    keep = []
    for line in exposition.splitlines():
        name = line.split(" ", 3)[2] if line.startswith("# ") else line
        if name.startswith("ray_" + PREFIX):
            keep.append(line)
    return "\n".join(keep) + "\n"
