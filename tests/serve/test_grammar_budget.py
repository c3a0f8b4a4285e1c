"""A constrained request's plan (its grammar compiled, its tools rendered) is built off the event loop
within a time budget: a costly grammar used to block every tenant (other tenants' GET /v1/models waited
32.6 s behind a 100k-string `choice`). In process, on the stub orchestrator of test_http_edge.py."""
import asyncio
import json
import time

from capsulert.serve import grammar_budget
from tests.serve.test_http_edge import AUTH, Tenant, call, make_app


async def models(app):
    status, out = [], []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(m):
        (status if m["type"] == "http.response.start" else out).append(m)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": "/v1/models", "raw_path": b"/v1/models", "query_string": b"", "root_path": "",
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000), "headers": AUTH[:1]}
    await app(scope, receive, send)
    return status[0]["status"]


def test_a_costly_grammar_is_refused_within_its_budget_and_blocks_no_one(default_model_dir, monkeypatch):
    monkeypatch.setattr(grammar_budget, "GRAMMAR_BUDGET_S", 0.001)
    app = make_app(default_model_dir, Tenant([]), max_body_bytes=1 << 20)
    choice = [f"option number {i} of many" for i in range(6000)]  # ~0.3 MB of grammar work, under the size limit
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "pick"}],
                       "structured_outputs": {"choice": choice}}).encode()

    async def both():
        costly = asyncio.ensure_future(call(app, AUTH, [body], path="/v1/chat/completions"))
        await asyncio.sleep(0.01)  # the compile is running
        t0 = time.perf_counter()
        status = await models(app)
        waited = time.perf_counter() - t0
        return await costly, status, waited
    (status, reply, _), other, waited = asyncio.run(both())
    assert status == 400 and reply["error"]["code"] == "grammar_too_costly", reply
    assert other == 200 and waited < 0.2  # answered while the grammar compiled
