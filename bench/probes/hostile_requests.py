"""Hostile HTTP requests against the app (capsulert/serve/app.py) on a stub orchestrator (no worker: what is
measured is the edge and the event loop), served by uvicorn in a child process:

- an unauthenticated 300 MB body: its status and the server process's RSS growth;
- hostile grammars (a `choice` of 100k strings, the regex `(a{1000}){1000}`, 10k tools with tool_choice
  "required", a 20,000-deep schema): each one's status and time to answer, and other tenants' GET /v1/models
  latency while they run, against undisturbed.

    python bench/probes/hostile_requests.py
"""
from __future__ import annotations

import json
import multiprocessing
import os
import socket
import statistics
import threading
import time
from contextlib import asynccontextmanager

KEY = "sk-probe-key-0001"


def serve(port: int) -> None:
    import uvicorn

    from capsulert.chat.prompt import ChatRenderer
    from capsulert.errors import QueueFullError
    from capsulert.engine.default_model import ensure_default_model
    from capsulert.serve.app import Admission, ServerState, build_app
    from capsulert.serve.metrics import NoMetrics
    from capsulert.serve.plans import Limits
    from capsulert.serve.tenants import Tenants
    from capsulert.serve.token_text import TokenText

    class Namespace:
        @asynccontextmanager
        async def admitted(self, sessions, *, together=1):
            yield

        async def capsules(self):
            return []

        async def open(self):  # a request that got past the edge: what a worker would then run is not measured
            raise QueueFullError("stub orchestrator: no worker behind this probe")

    class Orchestrator:
        def namespace(self, name):
            return Namespace()

    path = ensure_default_model()
    tokens = TokenText.load(path, 4096)
    m = NoMetrics()
    state = ServerState(Orchestrator(), Tenants.from_keys({KEY: "acme", KEY + "b": "other"}), Limits("m", 512, 4),
                        tokens, ChatRenderer(path, tokens.tokenizer), Admission(64, m), m)
    uvicorn.run(build_app(state), host="127.0.0.1", port=port, log_level="error")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def main() -> None:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = multiprocessing.get_context("spawn").Process(target=serve, args=(port,), daemon=True)
    p.start()
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {KEY}"}
    for _ in range(600):
        try:
            httpx.get(url + "/v1/models", headers=auth, timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.1)

    def models_latency(n: int = 20) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}b"}, timeout=120)
            out.append(time.perf_counter() - t0)
        return out

    # an unauthenticated 300 MB body
    before = rss_mb(p.pid)

    def body():
        chunk = b"x" * (1 << 20)
        for _ in range(300):
            yield chunk
    t0 = time.perf_counter()
    try:
        r = httpx.post(url + "/v1/completions", content=body(), headers={"Content-Type": "application/json"},
                       timeout=120)
        status = r.status_code
    except httpx.HTTPError as e:  # the server answered and closed while the client still sent
        status = f"connection closed by the server after its answer ({type(e).__name__})"
    print(f"unauthenticated 300 MB body: {status} in {time.perf_counter() - t0:.2f} s; server RSS "
          f"{before:.0f} -> {rss_mb(p.pid):.0f} MB")

    quiet = models_latency()
    print(f"GET /v1/models undisturbed: median {statistics.median(quiet) * 1e3:.1f} ms, max {max(quiet) * 1e3:.1f} ms")
    deep = cur = {}
    for _ in range(20000):
        cur["items"] = {}
        cur = cur["items"]
    tool = lambda i: {"type": "function", "function": {"name": f"f{i}", "parameters": {  # noqa: E731
        "type": "object", "properties": {"a": {"type": "string"}}}}}
    hostile = {
        "choice of 100k": {"structured_outputs": {"choice": [f"option {i}" for i in range(100_000)]}},
        "(a{1000}){1000}": {"structured_outputs": {"regex": "(a{1000}){1000}"}},
        "10k tools, required": {"tools": [tool(i) for i in range(10_000)], "tool_choice": "required"},
        "20,000-deep schema": {"response_format": {"type": "json_schema", "json_schema": {"schema": deep}}},
    }
    for name, extra in hostile.items():
        req = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
        raw = json.dumps(req).encode() if name != "20,000-deep schema" else \
            (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": '
             b'"json_schema", "json_schema": {"schema": ' + b'{"items": ' * 20000 + b"{}" + b"}" * 20000 + b"}}}")
        result = {}

        def send():
            t0 = time.perf_counter()
            r = httpx.post(url + "/v1/chat/completions", content=raw, timeout=300,
                           headers={**auth, "Content-Type": "application/json"})
            result.update(status=r.status_code, s=time.perf_counter() - t0,
                          code=(r.json().get("error") or {}).get("code") if r.status_code >= 400 else None)
        th = threading.Thread(target=send)
        th.start()
        time.sleep(0.02)
        loud = []
        while th.is_alive():
            loud += models_latency(1)
        th.join()
        print(f"{name}: {result['status']} {result['code']} in {result['s']:.2f} s ({len(raw) >> 10} KiB); "
              f"other tenant's GET /v1/models meanwhile: median {statistics.median(loud) * 1e3:.1f} ms, "
              f"max {max(loud) * 1e3:.1f} ms ({len(loud)} requests)")
    p.kill()


if __name__ == "__main__":
    main()
