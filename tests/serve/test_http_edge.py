"""The HTTP edge (serve/edge.py), in process on a stub orchestrator: the API key is checked before a byte of
the body is read (an unauthenticated 300 MB body used to be read whole before its 401), a body past the
limit is refused with 413 without reading the rest, and a tenant's capsule quotas refuse a snapshot_as with
403 naming the quota before anything is generated."""
from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import pytest

from capsulert.chat.prompt import ChatRenderer
from capsulert.protocol.results import GenerateResult
from capsulert.serve.app import Admission, ServerState, build_app
from capsulert.serve.edge import EdgeLimits
from capsulert.serve.metrics import NoMetrics
from capsulert.serve.plans import Limits
from capsulert.serve.tenants import Tenants
from capsulert.serve.token_text import TokenText

KEY = "sk-edge-test-0001"
LIMIT = 4096


class Tenant:
    """A namespace holding `rows` capsules; records what the server asked of it."""

    def __init__(self, rows):
        self.rows, self.calls = rows, []

    @asynccontextmanager
    async def admitted(self, sessions, *, together=1):
        yield

    async def capsules(self):
        return self.rows

    async def open(self):
        self.calls.append("open")
        return Session()

    async def append_generate(self, prompt, max_new_tokens, sampling=None):  # open, turn and close in one
        self.calls.append("append_generate")
        return await Session().turn(prompt, max_new_tokens, sampling)


class Session:
    length, restored_from = 3, None

    async def turn(self, prompt, max_tokens, params=None):
        return GenerateResult([5], [-0.5], [], "length", "x", length=4)

    async def snapshot(self, name, pin=False):
        from capsulert.capsule_store.capsule import CapsuleRef
        return CapsuleRef(name, "acme", "device", 10, 4)

    async def close(self):
        pass


class Orchestrator:
    def __init__(self, tenant):
        self.tenant = tenant

    def namespace(self, name):
        return self.tenant


def make_app(default_model_dir, tenant, **limits):
    tokens = TokenText.load(default_model_dir, 4096)
    m = NoMetrics()
    state = ServerState(Orchestrator(tenant), Tenants.from_keys({KEY: "acme"}), Limits("m", 512, 4), tokens,
                        ChatRenderer(default_model_dir, tokens.tokenizer), Admission(8, m), m,
                        edge=EdgeLimits(**{"max_body_bytes": LIMIT, **limits}))
    return build_app(state)


async def call(app, headers, pieces=None, path="/v1/completions"):
    """POST the body `pieces` (None: 1 KB pieces without end) to the app; (status, body, pieces read)."""
    read, status, out = [0], [], []
    left = None if pieces is None else list(pieces)

    async def receive():
        if left == []:
            await asyncio.sleep(3600)  # the client waits for the answer
        read[0] += 1
        piece = b"x" * 1024 if left is None else left.pop(0)
        return {"type": "http.request", "body": piece, "more_body": left is None or bool(left)}

    async def send(m):
        if m["type"] == "http.response.start":
            status.append(m["status"])
        else:
            out.append(m.get("body", b""))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000), "headers": headers}
    await asyncio.wait_for(app(scope, receive, send), 10)
    return status[0], json.loads(b"".join(out)), read[0]


AUTH = [(b"authorization", f"Bearer {KEY}".encode()), (b"content-type", b"application/json")]


def test_an_unauthenticated_body_is_never_read(default_model_dir):
    app = make_app(default_model_dir, Tenant([]))
    for headers in ([], [(b"authorization", b"Bearer sk-wrong-key-00000")],
                    [(b"authorization", b"Bearer sk-wrong-key-00000"), (b"content-length", b"314572800")]):
        status, body, read = asyncio.run(call(app, headers, None))
        assert status == 401 and body["error"]["code"] == "invalid_api_key" and read == 0


def test_a_body_past_the_limit_is_refused_with_413_and_not_read_on(default_model_dir):
    app = make_app(default_model_dir, Tenant([]))
    status, body, read = asyncio.run(call(app, AUTH + [(b"content-length", str(LIMIT + 1).encode())], None))
    assert status == 413 and body["error"]["code"] == "request_too_large" and read == 0
    status, body, read = asyncio.run(call(app, AUTH, None))  # chunked: no length said
    assert status == 413 and "--max-body-mb" in body["error"]["message"] and read == LIMIT // 1024 + 1
    ok = json.dumps({"model": "m", "prompt": [5], "max_tokens": 1}).encode()
    status, _, _ = asyncio.run(call(app, AUTH, [ok[:5], ok[5:]]))  # under the limit, in two pieces
    assert status == 200


@pytest.mark.parametrize("limits,refused", [
    (dict(max_capsules=2), True), (dict(max_capsules=3), False),
    (dict(max_capsule_bytes=300), True), (dict(max_capsule_bytes=301), False)])
def test_capsule_quotas_refuse_a_snapshot_before_generating(default_model_dir, limits, refused):
    rows = [{"name": n, "size_bytes": 150} for n in ("a", "b")] + [{"name": "capsulert:tmp", "size_bytes": 10**9}]
    tenant = Tenant(rows)
    app = make_app(default_model_dir, tenant, **limits)
    req = json.dumps({"model": "m", "prompt": [5], "max_tokens": 1, "snapshot_as": "c"}).encode()
    status, body, _ = asyncio.run(call(app, AUTH, [req[:-1], req[-1:]]))
    if refused:
        assert status == 403 and body["error"]["code"] == "capsule_quota_exceeded" and tenant.calls == []
        assert "--capsule-quota" in body["error"]["message"]
    else:  # the server's own capsules (capsulert:) are not the tenant's
        assert status == 200 and tenant.calls == ["open"]
