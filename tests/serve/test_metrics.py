"""CountRequests counts every HTTP request once, when its response ends, with the status the client got (or
what stands for it): a handler that fails unexpectedly is a 500, a client gone before the status line a 499,
a stream that fails after its 200 its error's status; and PromMetrics exposes capsulert_* series only."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from capsulert.serve.metrics import (CountRequests, PromMetrics, current_request, request_namespace, route_of,
                                     stream_failed)


class Requests:
    """A ServerMetrics keeping what request() was told."""

    def __init__(self):
        self.seen = []

    def request(self, route, status, seconds):
        self.seen.append((route, current_request.get().namespace, status))


async def ok(scope, receive, send):
    request_namespace("acme")
    await send({"type": "http.response.start", "status": 201, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def fails(scope, receive, send):
    raise RuntimeError("a bug")


async def hangs(scope, receive, send):
    await asyncio.sleep(3600)


async def stream_then_fail(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    stream_failed(503)
    await send({"type": "http.response.body", "body": b"data: {}\n\n"})


def call(app, path: str) -> list:
    metrics = Requests()

    async def send(message):
        pass

    async def main():
        task = asyncio.ensure_future(CountRequests(app, metrics)({"type": "http", "path": path}, None, send))
        await asyncio.sleep(0.01)
        if not task.done():
            task.cancel()  # the client went away
        await asyncio.gather(task, return_exceptions=True)
    asyncio.run(main())
    return metrics.seen


@pytest.mark.parametrize("app, path, seen", [
    (ok, "/v1/completions", ("completions", "acme", 201)),
    (fails, "/v1/chat/completions", ("chat", "", 500)),
    (hangs, "/v1/capsules/x", ("capsules", "", 499)),
    (stream_then_fail, "/v1/completions", ("completions", "", 503)),
    (ok, "/anything/else", ("other", "acme", 201)),
])
def test_each_request_is_counted_once_with_its_status(app, path, seen):
    assert call(app, path) == [seen]


def test_routes_are_a_few_fixed_names():
    assert {route_of(p) for p in ("/v1/models", "/metrics", "/v1/capsules", "/v1/capsules/a/b", "/x", "/v1/x")} \
        == {"models", "metrics", "capsules", "other"}


def test_exposition_has_our_series_and_labels_only():
    m = PromMetrics("m1")
    m.request("acme", "chat", 200, 0.01)
    m.tokens("acme", "chat", prompt=5, completion=3, cached=2)
    m.capsule_lookup("acme", True, 0.002, "host")
    m.capsule_lookup("acme", False)
    m.workers(queued=1, sessions=4)
    families = {f.name: f for f in text_string_to_metric_families(m.exposition().decode())}
    assert all(name.startswith("capsulert_") for name in families)
    labels = {k for f in families.values() for s in f.samples for k in s.labels}
    assert labels <= {"model", "namespace", "route", "status", "tier", "le"}

    def value(name, **labels):
        return sum(s.value for f in families.values() for s in f.samples
                   if s.name == name and labels.items() <= s.labels.items())
    assert value("capsulert_requests_total", model="m1", namespace="acme", route="chat", status="200") == 1
    assert value("capsulert_cached_prompt_tokens_total", namespace="acme") == 2
    assert value("capsulert_capsule_lookups_total", status="miss") == 1
    assert value("capsulert_capsule_hits_total", tier="host") == 1
    assert value("capsulert_worker_sessions", model="m1") == 4
