"""The server's parts on their own: tenants and keys, stop-string holdback, request validation, error
statuses, and `capsulert serve` refusing bad settings before anything starts."""
from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from capsulert import errors as E
from capsulert.serve.http_errors import ApiError, describe, kind_of
from capsulert.serve.bodies import ChatCompletionRequest, CompletionRequest
from capsulert.serve.tenants import Tenants
from capsulert.engine.stops import HeldText


# ------------------------------------------------------------------------------------------------ keys
def test_keys_map_to_namespaces(tmp_path):
    f = tmp_path / "keys.yaml"
    f.write_text("keys:\n  sk-acme-00000001: acme\n  sk-acme-00000002: acme\n  sk-globex-000001: globex\n")
    t = Tenants.load(f)
    assert t.namespaces == ["acme", "globex"] and not t.open
    assert t.namespace_for("Bearer sk-acme-00000002") == "acme"
    assert t.namespace_for("bearer  sk-globex-000001 ") == "globex"
    for header in (None, "", "Bearer", "Bearer sk-acme-0000000", "Basic sk-acme-00000001", "sk-acme-00000001"):
        with pytest.raises(ApiError) as e:
            t.namespace_for(header)
        assert e.value.kind.status == 401
    assert "sk-acme" not in repr(t)  # keys are kept as digests only


def test_without_keys_the_server_is_open():
    t = Tenants.load(None)
    assert t.open and t.namespace_for(None) == "default" and t.namespace_for("Bearer anything") == "default"


@pytest.mark.parametrize("text, problem", [
    ("keys: [", "not valid YAML"),
    ("keys: {}", "at least 1"),
    ("keys:\n  short: acme\n", "at least 8 characters"),
    ("keys:\n  sk-0000000001: ../etc\n", "namespace"),
    ("keys:\n  sk-0000000001: acme\nextra: 1\n", "extra"),
    ("- just a list\n", "keys"),
])
def test_bad_keys_files_are_refused(tmp_path, text, problem):
    f = tmp_path / "keys.yaml"
    f.write_text(text)
    with pytest.raises(E.ConfigError, match=problem):
        Tenants.load(f)
    with pytest.raises(E.ConfigError, match="cannot read"):
        Tenants.load(tmp_path / "missing.yaml")


# ------------------------------------------------------------------------------------------- held text
def replay(stops, deltas, final):
    held = HeldText(tuple(stops))
    shown = [held.push(d) for d in deltas]
    return shown, held.finish(final)


def test_without_stops_text_shows_at_once():
    shown, rest = replay((), ["ab", "", "c"], "abc")
    assert shown == ["ab", "", "c"] and rest == ""


def test_a_possible_stop_start_is_held_back_until_decided():
    # the last len("XYZ") - 1 characters wait: "cX" could start the stop, then "Yd" shows it does not
    shown, rest = replay(("XYZ",), ["ab", "cX", "Yd"], "abcXYd")
    assert shown == ["", "ab", "cX"] and rest == "Yd"


def test_the_token_completing_a_stop_shows_nothing_of_it():
    # the stop "spt" completes inside the last delta, which also carries text after it
    shown, rest = replay(("spt",), [" This", "pt more"], " Thi")
    assert "".join(shown) + rest == " Thi" and "s" not in "".join(shown)


# -------------------------------------------------------------------------------------------- requests
def test_completion_prompts_of_every_shape():
    base = {"model": "m"}
    assert CompletionRequest(**base, prompt="hi").prompts == ["hi"]
    assert CompletionRequest(**base, prompt=[1, 2]).prompts == [[1, 2]]
    assert CompletionRequest(**base, prompt=["a", "b"]).prompts == ["a", "b"]
    assert CompletionRequest(**base, prompt=[[1], [2, 3]]).prompts == [[1], [2, 3]]


@pytest.mark.parametrize("extra", [
    {"pin": True}, {"n": 2, "snapshot_as": "x"}, {"echo": True}, {"best_of": 3}, {"logit_bias": {"1": 2.0}},
    {"frequency_penalty": 0.1}, {"stop": [""]}, {"stream_options": {"include_usage": True}}, {"logprobs": 21},
    {"n": 0}, {"max_tokens": "5"}, {"structured_outputs": {"regex": "a", "choice": ["b"]}},
])
def test_unsupported_or_invalid_fields_are_refused(extra):
    with pytest.raises(ValidationError):
        CompletionRequest(model="m", prompt="x", **extra)


def test_unknown_fields_are_accepted_with_one_warning_per_name(caplog):
    from capsulert.serve import bodies

    bodies._warned.discard("store_test_field")
    with caplog.at_level("WARNING", logger="capsulert.serve.bodies"):
        for _ in range(3):
            req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                        store_test_field=True, metadata={"a": "b"})
            assert req.model_extra["store_test_field"] is True
    warned = [r.getMessage() for r in caplog.records if "store_test_field" in r.getMessage()]
    assert len(warned) == 1 and "ignoring request field 'store_test_field'" in warned[0]


def test_chat_request_checks():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    req = ChatCompletionRequest(model="m", messages=msgs, max_completion_tokens=5)
    assert req.messages[0].for_template() == {"role": "user", "content": "ab"} and req.token_limit == 5
    for bad in ({"messages": []}, {"messages": msgs, "top_logprobs": 2}, {"messages": msgs, "tools": [{}]},
                {"messages": msgs, "tool_choice": "sometimes"}, {"messages": msgs, "response_format": {"type": "xml"}},
                {"messages": msgs, "response_format": {"type": "json_schema"}},
                {"messages": [{"role": "wizard", "content": "x"}]},
                {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest(model="m", **bad)


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("error, status", [
    (E.InvalidRequestError("x"), 400), (E.InvalidTokenError("x"), 400), (E.SequenceTooLongError("x"), 400),
    (E.InvalidCapsuleNameError("x"), 400), (E.UnknownCapsuleError("x"), 404), (E.DuplicateCapsuleError("x"), 409),
    (E.StaleCapsuleError("x"), 409), (E.QueueFullError("x"), 429), (E.NoFreeSlotError("x"), 429),
    (E.WorkerLost("x"), 503), (E.CapsuleIOError("x"), 500),
    (E.ExceedsCapacityError("x"), 400), (E.StaleSessionError("x"), 409),
])
def test_error_statuses(error, status):
    assert kind_of(error).status == status
    kind, body = describe(error)
    assert body["error"]["message"] == "x" and body["error"]["type"] == kind.type


def test_a_429_says_when_to_come_back():
    from capsulert.serve.http_errors import retry_headers

    full = E.QueueFullError("x", retry_after_s=2.3)
    assert retry_headers(kind_of(full), full) == {"Retry-After": "3"}
    assert retry_headers(kind_of(E.QueueFullError("x")), E.QueueFullError("x")) == {"Retry-After": "1"}
    assert retry_headers(kind_of(E.WorkerLost("x")), E.WorkerLost("x")) == {}


def test_unexpected_errors_say_nothing_of_their_insides():
    kind, body = describe(RuntimeError("secret path /etc/x at line 3"))
    assert kind.status == 500 and "secret" not in body["error"]["message"]


# ------------------------------------------------------------------------------------------------- CLI
def run_serve(*args):
    return subprocess.run([sys.executable, "-m", "capsulert.cli", "serve", *args], capture_output=True, text=True,
                          timeout=120)


def test_serve_refuses_bad_settings_before_starting(tmp_path):
    proc = run_serve("--keys", str(tmp_path / "missing.yaml"), "--port", "1")
    assert proc.returncode == 1 and "ConfigError: cannot read keys file" in proc.stderr
    assert "Traceback" not in proc.stderr and "Started a local Ray" not in proc.stderr
    proc = run_serve("--max-seq", "1000", "--prefill-chunk", "256")
    assert proc.returncode == 1 and "max_seq" in proc.stderr and "Traceback" not in proc.stderr


# --------------------------------------------------------------------------------------- disconnects
def _asgi_run(answer_after: float | None, disconnect_after: float) -> tuple[bool, list[dict]]:
    """A request through CancelOnDisconnect to an app that answers after `answer_after` s (None: never),
    from a client that goes away after `disconnect_after` s. Whether the app was cancelled, what it sent."""
    import asyncio

    from capsulert.serve.ingress import CancelOnDisconnect

    cancelled, sent = [], []

    async def app(scope, receive, send):
        assert (await receive())["type"] == "http.request"
        try:
            await asyncio.sleep(3600 if answer_after is None else answer_after)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    async def main():
        messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive():
            if messages:
                return messages.pop(0)
            await asyncio.sleep(disconnect_after)
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
        await asyncio.wait_for(CancelOnDisconnect(app)({"type": "http"}, receive, send), 10)
    asyncio.run(main())
    return bool(cancelled), sent


def test_a_client_that_goes_away_cancels_its_request():
    cancelled, sent = _asgi_run(answer_after=None, disconnect_after=0.05)
    assert cancelled and sent == []  # the handler (its generates, its sessions) is cancelled at once


def test_a_request_answered_before_the_client_goes_is_not_cancelled():
    cancelled, sent = _asgi_run(answer_after=0.01, disconnect_after=0.2)
    assert not cancelled and [m["type"] for m in sent] == ["http.response.start", "http.response.body"]


def test_the_access_log_has_a_line_per_request(caplog):
    import asyncio
    import logging

    from capsulert.serve.ingress import CancelOnDisconnect

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    async def receive():  # the request, then nothing: the client stays
        if not asked:
            asked.append(True)
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.sleep(3600)

    async def send(message):
        pass
    asked: list = []
    scope = {"type": "http", "method": "GET", "path": "/v1/nothing", "client": ("127.0.0.1", 5000)}
    with caplog.at_level(logging.INFO, logger="capsulert.serve.access"):
        asyncio.run(CancelOnDisconnect(app, access_log=True)(scope, receive, send))
        asked.clear()
        asyncio.run(CancelOnDisconnect(app)(scope, receive, send))  # without access_log: no line
    lines = [r.getMessage() for r in caplog.records if r.name == "capsulert.serve.access"]
    assert len(lines) == 1 and lines[0].startswith("127.0.0.1:5000 GET /v1/nothing 404 ")
