"""The request path's shortcuts answer exactly what the plain path does: the generation routes' lane
(lane.py) against FastAPI's own routes; the event stream's response; a client going away. In
process, on a stub orchestrator (no worker)."""
from __future__ import annotations

import asyncio
import json
import re
from contextlib import asynccontextmanager

import pytest

from capsulert.serve import lane
from capsulert.serve.app import Admission, ServerState, build_app
from capsulert.chat.prompt import ChatRenderer
from capsulert.serve.ingress import CancelOnDisconnect
from capsulert.serve.metrics import NoMetrics
from capsulert.serve.plans import Limits
from capsulert.serve.bodies import ChatCompletionRequest, CompletionRequest
from capsulert.serve.tenants import Tenants
from capsulert.serve.token_text import TokenText
from capsulert.protocol.results import FinalEvent, GenerateResult, TokenEvent

KEY = "sk-fast-path-0001"
OUT = [(1734, " h\u00e9"), (1735, ' "q"\n'), (1736, "\u2603")]


def _result() -> GenerateResult:
    return GenerateResult([t for t, _ in OUT], [-0.5, -1.25, -2.0], [], "length", "".join(x for _, x in OUT),
                          length=20 + len(OUT))


class _Session:
    length, restored_from = 20, "device"

    async def turn(self, prompt, max_tokens, params=None):
        return _result()

    async def stream_turn(self, prompt, max_tokens, params):
        for i, (t, text) in enumerate(OUT):
            yield TokenEvent(t, -0.5, text, i)
        yield FinalEvent(_result())

    async def snapshot(self, name, pin=False):
        pass

    async def close(self):
        pass


class _SlowSession(_Session):
    """Streams its first token, then waits for the next one (the worker is slow); counts its closes."""
    closed = 0

    async def stream_turn(self, prompt, max_tokens, params):
        yield TokenEvent(OUT[0][0], -0.5, OUT[0][1], 0)
        await asyncio.sleep(3600)

    async def close(self):
        type(self).closed += 1


class _SlowStream:
    """A one-request stream (restore, turn and close in one request) that streams its first token, then waits;
    counts the streams that ended unfinished (their generate interrupted)."""
    stopped = 0

    @classmethod
    async def events(cls):
        try:
            yield TokenEvent(OUT[0][0], -0.5, OUT[0][1], 0)
            await asyncio.sleep(3600)
        finally:
            cls.stopped += 1


class _Namespace:
    calls: list[str] = []  # the verbs the server used, in order

    @asynccontextmanager
    async def admitted(self, sessions, *, together=1):  # the admission queue: always room here
        yield

    async def open(self):
        self.calls.append("open")
        return _Session()

    async def restore(self, name):
        self.calls.append("restore")
        return _SlowSession() if name == "slow" else _Session()

    async def restore_append_generate(self, name, suffix, max_new_tokens, sampling=None):
        self.calls.append("restore_append_generate")
        return _result()

    def restore_append_stream(self, name, suffix, max_new_tokens, sampling=None):
        self.calls.append("restore_append_stream")
        return _SlowStream.events() if name == "slow" else _Session().stream_turn(suffix, max_new_tokens, sampling)

    async def append_generate(self, prompt, max_new_tokens, sampling=None):
        self.calls.append("append_generate")
        return _result()

    def append_stream(self, prompt, max_new_tokens, sampling=None):
        self.calls.append("append_stream")
        return _Session().stream_turn(prompt, max_new_tokens, sampling)

    async def fork(self, name, n):
        return [_Session() for _ in range(n)]

    async def delete(self, name):
        pass


class _Orchestrator:
    def namespace(self, name):
        return _Namespace()


@pytest.fixture(scope="module")
def app(default_model_dir):
    tokens = TokenText.load(default_model_dir, 4096)
    m = NoMetrics()
    state = ServerState(_Orchestrator(), Tenants.from_keys({KEY: "acme"}), Limits("m", 512, 4), tokens,
                        ChatRenderer(default_model_dir, tokens.tokenizer), Admission(8, m), m)
    return CancelOnDisconnect(build_app(state))


def _scope(path: str, headers: list) -> dict:
    """An ASGI scope of a POST to `path`."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000), "headers": headers}


JSON_WITH_KEY = [(b"content-type", b"application/json"), (b"authorization", f"Bearer {KEY}".encode())]


async def _call(app, path: str, body: bytes, headers: list) -> tuple[int, bytes]:
    scope = _scope(path, headers)
    messages, done, status, out = [{"type": "http.request", "body": body, "more_body": False}], asyncio.Event(), [], []

    async def receive():
        if messages:
            return messages.pop(0)
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(m):
        if m["type"] == "http.response.start":
            status.append(m["status"])
        else:
            out.append(m.get("body", b""))
            if not m.get("more_body"):
                done.set()
    await app(scope, receive, send)
    return status[0], b"".join(out)


def _normal(body: bytes) -> bytes:
    """A response with its random id and its creation time left out."""
    body = re.sub(rb'"(chatcmpl|cmpl)-[0-9a-f]{32}"', b'"ID"', body)
    return re.sub(rb'"created":[0-9]+', b'"created":0', body)


BODIES = [
    {"model": "m", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "return_token_ids": True},
    {"model": "m", "prompt": "Once upon", "max_tokens": 3, "logprobs": 2, "stop": ["zz"], "seed": 3},
    {"model": "m", "prompt": [[5], [6, 7]], "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
    {"model": "m", "prompt": [5], "capsule": "agent0", "stream": True, "logprobs": 1, "return_token_ids": True},
    {"model": "m", "prompt": [5], "n": 2, "temperature": 0.5},
    {"model": "other", "prompt": [5]},
    {"model": "m", "prompt": [5], "capsule": "capsulert:x"},
    {"model": "m", "prompt": [5], "n": 99},
    {"model": "m", "prompt": [5], "temperature": "hot"},
    {"model": "m", "prompt": [], "max_tokens": -1},
    {"model": "m", "prompt": [5], "unknown": 1},
    {"model": "m", "prompt": [5], "echo": True},
    {"model": "m", "messages": [{"role": "user", "content": "Hi \u00e9"}], "max_tokens": 3, "logprobs": True,
     "top_logprobs": 2},
    {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}], "stream": True},
    {"model": "m", "messages": [{"role": "wizard", "content": "x"}]},
    {"model": "m", "messages": []},
]
RAW = [b"", b"{", b"[]", b"null", b'{"model": "m", "prompt": "\\ud800"}', b'\xef\xbb\xbf{"model": "m", "prompt": [5]}',
       b'{"model": "m", "prompt": [5], "temperature": NaN}', b'{"model": "m", "prompt": "caf\xe9"}']


@pytest.mark.parametrize("raw", [json.dumps(b).encode() for b in BODIES] + RAW)
@pytest.mark.parametrize("auth", [True, False])
def test_the_body_fast_path_answers_as_fastapi_does(app, raw, auth, monkeypatch):
    """The same request as plain JSON (the fast path when valid) and with a charset (always FastAPI's path)."""
    parsed, fast_body = [], lane.fast_body

    def recorded(content_type, raw, model):
        body = fast_body(content_type, raw, model)
        parsed.append(body is not None)
        return body
    monkeypatch.setattr(lane, "fast_body", recorded)
    chat = b'"messages"' in raw
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = [(b"authorization", f"Bearer {KEY}".encode())] if auth else []

    async def both():
        fast = await _call(app, path, raw, base + [(b"content-type", b"application/json")])
        plain = await _call(app, path, raw, base + [(b"content-type", b"application/json; charset=utf-8")])
        return fast, plain
    (s1, b1), (s2, b2) = asyncio.run(both())
    assert s1 == s2 and _normal(b1) == _normal(b2), (b1, b2)
    if not auth:  # the key is checked before the body is read (edge.py): neither path parses it
        assert parsed == [] and s1 == 401
        return
    assert not parsed[1]
    if raw == json.dumps(BODIES[0]).encode():
        assert parsed[0] and s1 == 200


@pytest.mark.parametrize("raw", [json.dumps(b).encode() for b in BODIES] + RAW + [
    b'{"model": "m", "prompt": "x", "temperature": -0, "top_p": 1, "seed": 123456789012345678901234567890}',
    b'{"model": "m", "prompt": "x", "temperature": 0.1000000000000000055511151231257827, "model": "m2"}',
    b'{"model": "m", "messages": [{"role": "user", "content": "a", "x": [1, 2.5e-308, 1e999, null, "\\u00e9"]}], '
    b'"chat_template_kwargs": {"a": {"b": 1, "b": 2}, "c": -Infinity}}',
])
def test_pydantic_json_reads_bodies_as_json_loads_does(raw):
    model = ChatCompletionRequest if b'"messages"' in raw else CompletionRequest
    try:
        fast = model.model_validate_json(raw)
    except ValueError:
        return  # FastAPI's path decides
    assert repr(fast.model_dump()) == repr(model.model_validate(json.loads(raw)).model_dump())


# ----------------------------------------------------------------------------------------- event stream
async def _stream_call(app, raw: bytes, sent: list, after_body) -> None:
    """POST `raw` to /v1/completions; the messages the app sends go to `sent`, and once the body is read the
    app's receive waits on `after_body()` (what the client does next)."""
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else await after_body()

    async def send(m):
        sent.append(m)
    await app(_scope("/v1/completions", JSON_WITH_KEY), receive, send)


def test_a_stream_ends_with_its_done_event_in_one_message(app):
    raw = json.dumps(BODIES[3]).encode()
    sent = []
    asyncio.run(_stream_call(app, raw, sent, lambda: asyncio.sleep(3600)))
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert bodies[-1] == {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
    assert all(m["more_body"] for m in bodies[:-1]) and len(bodies) == len(OUT) + 2  # a chunk a token + the final


@pytest.mark.parametrize("prompt", [[5], [[5], [6]]], ids=["one-request", "sessions"])
def test_a_client_that_goes_away_mid_stream_ends_it(app, prompt):
    """The replica's own server: the request is cancelled at once, its generates stopped (a one-request
    stream closed unfinished, or each restored session closed), its task not left cancelled."""
    raw = json.dumps({"model": "m", "prompt": prompt, "capsule": "slow", "stream": True}).encode()
    sent, left = [], []
    stopped, closed = _SlowStream.stopped, _SlowSession.closed

    async def leave():  # after the first event
        while not any(m["type"] == "http.response.body" and m["body"] for m in sent):
            await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    async def main():
        await asyncio.wait_for(_stream_call(app, raw, sent, leave), 10)
        left.append(asyncio.current_task().cancelling())
    asyncio.run(main())
    events = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert events[0].startswith(b'data: {"id":"cmpl-') and b"[DONE]" not in b"".join(events)
    if prompt == [5]:
        assert (_SlowStream.stopped - stopped, _SlowSession.closed - closed) == (1, 0) and left == [0]
    else:
        assert (_SlowStream.stopped - stopped, _SlowSession.closed - closed) == (0, 2) and left == [0]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("capsule, one, many", [
    ("agent0", "restore_append_", ["restore", "restore"]),  # two prompts: a session per prompt
    (None, "append_", ["open"]),  # two choices: a session to fork
], ids=["capsule", "no-capsule"])
def test_one_prompt_one_choice_is_one_request_to_the_worker(app, stream, capsule, one, many):
    """One prompt, one choice, nothing kept: the open (or the capsule's restore), the turn and the close are one
    request (no session of its own, nothing to close)."""
    body = {"model": "m", "prompt": [5], "stream": stream, **({"capsule": capsule} if capsule else {})}
    _Namespace.calls.clear()
    status, out = asyncio.run(_call(app, "/v1/completions", json.dumps(body).encode(), JSON_WITH_KEY))
    text = "".join(x for _, x in OUT)
    if stream:
        chunks = [json.loads(line[6:]) for line in out.decode().split("\n\n") if line.startswith("data: {")]
        assert status == 200 and "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
    else:
        assert status == 200 and json.loads(out)["choices"][0]["text"] == text
    assert _Namespace.calls == [one + ("stream" if stream else "generate")]
    _Namespace.calls.clear()
    more = {**body, "prompt": [[5], [6]]} if capsule else {**body, "n": 2}
    assert asyncio.run(_call(app, "/v1/completions", json.dumps(more).encode(), JSON_WITH_KEY))[0] == 200
    assert _Namespace.calls == many


# ------------------------------------------------------------------------------------------ disconnects
def test_a_request_cancelled_by_the_server_stays_cancelled():
    """CancelOnDisconnect swallows only its own cancellation (the client went away), not the server's."""
    async def app(scope, receive, send):
        await receive()
        await asyncio.sleep(3600)

    async def main():
        async def receive():
            if not asked:
                asked.append(True)
                return {"type": "http.request", "body": b"", "more_body": False}
            await asyncio.sleep(3600)

        async def send(m):
            pass
        task = asyncio.ensure_future(CancelOnDisconnect(app)({"type": "http"}, receive, send))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asked: list = []
    asyncio.run(main())
