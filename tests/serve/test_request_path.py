"""The pieces of a request's path through the server that keep its cost down, each doing what it did before:
a request's sampling parameters checked once (Plan.of), the response head written with the body
(HeadWithBody), the body read before the handler runs (CancelOnDisconnect), metrics recorded once per loop
turn into cached series (Deferred, PromMetrics)."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from capsulert.errors import InvalidRequestError
from capsulert.serve.generation import Plan
from capsulert.serve.ingress import CancelOnDisconnect, HeadWithBody
from capsulert.serve.metrics import Deferred, PromMetrics

SAMPLING = dict(temperature=0.5, top_p=1.0, top_k=0, stop=(), stop_token_ids=(), ignore_eos=False, logprobs=0)


# ------------------------------------------------------------------------------------------------ plans
def test_each_choice_samples_with_its_own_seed():
    plan = Plan.of(((5,),), 3, 4, SAMPLING, 10)
    assert [plan.params(j).seed for j in range(3)] == [10, 11, 12]
    assert plan.params(2).temperature == 0.5 and plan.params(0) is plan.sampling
    unseeded = Plan.of(((5,),), 3, 4, SAMPLING, None)
    assert [unseeded.params(j).seed for j in range(3)] == [None, None, None]


@pytest.mark.parametrize("n, seed, sampling", [
    (3, (1 << 63) - 2, SAMPLING),  # the last choice's seed is past the range
    (1, -2, SAMPLING),  # -1 is no seed (as vLLM reads it); other negative seeds are refused
    (1, 0, {**SAMPLING, "temperature": -1.0}),
])
def test_a_plan_with_a_bad_sampling_value_is_refused_when_made(n, seed, sampling):
    with pytest.raises(InvalidRequestError):
        Plan.of(((5,),), n, 4, sampling, seed)


# ----------------------------------------------------------------------------------- the response head
class Transport:
    def __init__(self):
        self.writes, self.closed = [], False

    def write(self, data) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name):
        return f"info:{name}"


HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


def test_a_head_leaves_with_the_body_in_one_write():
    async def main():
        t = Transport()
        w = HeadWithBody(t, asyncio.get_running_loop())
        w.write(HEAD)
        assert t.writes == []  # held for the body
        w.write(b"{}")
        await asyncio.sleep(0)
        return t.writes
    assert asyncio.run(main()) == [HEAD + b"{}"]


def test_a_head_without_a_body_in_its_turn_leaves_at_the_end_of_it():
    async def main():
        t = Transport()
        w = HeadWithBody(t, asyncio.get_running_loop())
        w.write(HEAD)
        await asyncio.sleep(0)
        first = list(t.writes)
        w.write(b"data: 1\n\n")  # a body write later: on its own
        w.write(b"HTTP/1.1 100 Continue")  # not a whole head: written at once
        return first, t.writes, w.get_extra_info("socket")
    first, writes, info = asyncio.run(main())
    assert first == [HEAD] and writes == [HEAD, b"data: 1\n\n", b"HTTP/1.1 100 Continue"] and info == "info:socket"


def test_closing_writes_a_held_head_first():
    async def main():
        t = Transport()
        w = HeadWithBody(t, asyncio.get_running_loop())
        w.write(HEAD)
        w.close()
        return t
    t = asyncio.run(main())
    assert t.writes == [HEAD] and t.closed


# ------------------------------------------------------------------------------------------- the body
def run_asgi(messages: list[dict], stay: bool):
    """The app behind CancelOnDisconnect gets `messages` (the request's body in parts, maybe a disconnect):
    (what its receive gave it, whether it was cancelled). The client stays (`stay`) or is gone after them."""
    got, cancelled = [], []

    async def app(scope, receive, send):
        try:
            while True:
                message = await receive()
                got.append(message)
                if message["type"] == "http.disconnect" or not message.get("more_body", False):
                    break
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def receive():
        if messages:
            return messages.pop(0)
        if stay:
            await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message):
        pass

    asyncio.run(asyncio.wait_for(CancelOnDisconnect(app)({"type": "http"}, receive, send), 10))
    return got, bool(cancelled)


def test_the_app_reads_the_body_as_it_was_sent():
    parts = [{"type": "http.request", "body": b'{"a"', "more_body": True},
             {"type": "http.request", "body": b": 1}", "more_body": False}]
    assert run_asgi(list(parts), stay=True) == (parts, False)


def test_a_client_gone_while_its_body_is_read_is_seen_by_the_app():
    parts = [{"type": "http.request", "body": b'{"a"', "more_body": True}, {"type": "http.disconnect"}]
    assert run_asgi(list(parts), stay=False) == (parts, False)


# ---------------------------------------------------------------------------------------------- metrics
class Recorder:
    def __init__(self):
        self.calls = []

    def inflight(self, n):
        self.calls.append(n)


def test_the_metrics_of_one_turn_are_recorded_by_one_callback(monkeypatch):
    rec = Recorder()
    m = Deferred(rec)

    async def main():
        loop = asyncio.get_running_loop()
        scheduled = []
        call_soon = loop.call_soon

        def counted(callback, *args, **kw):
            if getattr(callback, "__self__", None) is m:  # the metrics' own (the loop schedules tasks too)
                scheduled.append(callback)
            return call_soon(callback, *args, **kw)
        monkeypatch.setattr(loop, "call_soon", counted)
        for n in range(5):
            m.inflight(n)
        await asyncio.sleep(0)
        m.inflight(9)  # the next turn: a callback of its own
        await asyncio.sleep(0)
        return len(scheduled)
    assert asyncio.run(main()) == 2 and rec.calls == [0, 1, 2, 3, 4, 9]


def test_each_label_set_is_one_series_however_often_recorded():
    prom = PromMetrics("m")
    for namespace in ("acme", "acme", "globex"):
        prom.request(namespace, "completions", 200, 0.01)
        prom.tokens(namespace, "completions", 5, 2, 1)
        prom.capsule_lookup(namespace, True, 0.001, "device")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(prom.exposition().decode()) for s in family.samples}
    acme = (("model", "m"), ("namespace", "acme"), ("route", "completions"))
    globex = (("model", "m"), ("namespace", "globex"), ("route", "completions"))
    assert samples[("capsulert_requests_total", tuple(sorted(acme + (("status", "200"),))))] == 2
    assert samples[("capsulert_requests_total", tuple(sorted(globex + (("status", "200"),))))] == 1
    assert samples[("capsulert_generated_tokens_total", acme)] == 4
    assert samples[("capsulert_cached_prompt_tokens_total", globex)] == 1
    assert samples[("capsulert_restore_seconds_count", (("model", "m"), ("tier", "device")))] == 3
