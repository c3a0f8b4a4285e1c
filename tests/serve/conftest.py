"""Fixtures: a real `capsulert serve` (Ray Serve, one CPU worker, the default model, two tenants) on a free
loopback port, started as a subprocess once for a group of modules (SharedServer), and the in-process engine
its answers are compared with (same model files and engine settings, so greedy and seeded outputs are bitwise
equal)."""
from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from capsulert.engine.engine import Engine

ENGINE = dict(slots=8, max_seq=512, prefill_chunk=128)
KEYS = {"acme": "sk-acme-test-0123456789", "globex": "sk-globex-test-0123456789"}
MODEL = "capsulert-default"
MAX_INFLIGHT = 4
START_TIMEOUT_S = 180
# one TLS context for every client the tests make (their URLs are plain http): a client that builds its own loads
# the CA bundle, ~50 ms of CPU, and the start-up poll below makes ten a second while the server's processes start
TLS = ssl.create_default_context()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Server:
    url: str
    model_dir: Path
    log: Path
    model: str = MODEL
    keys: dict = field(default_factory=lambda: dict(KEYS))
    max_inflight: int = MAX_INFLIGHT
    pid: int = 0  # the `capsulert serve` process (Ray's processes are its descendants)

    def client(self, tenant: str = "acme", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=60,
                             http_client=openai.DefaultHttpxClient(verify=TLS), **kw)

    def http(self, method: str, path: str, tenant: str | None = "acme", headers: dict | None = None,
             **kw) -> httpx.Response:
        """A raw request; as `tenant` (its key), or with exactly the `headers` given."""
        if headers is None:
            headers = {"Authorization": f"Bearer {KEYS[tenant]}"} if tenant else {}
        return httpx.request(method, self.url + path, headers=headers, timeout=60, verify=TLS, **kw)


@contextmanager
def running_server(default_model_dir, work: Path, *extra: str, keys: bool = True, model: str = MODEL,
                   max_inflight: int = MAX_INFLIGHT):
    """A `capsulert serve` subprocess on a free loopback port, serving `model` (two tenants; keys=False: open),
    stopped by SIGINT on exit."""
    auth = []
    if keys:
        (work / "keys.yaml").write_text("keys:\n" + "".join(f"  {k}: {ns}\n" for ns, k in KEYS.items()))
        auth = ["--keys", str(work / "keys.yaml")]
    port, log = free_port(), work / "server.log"
    cmd = [sys.executable, "-m", "capsulert.cli", "serve", "--model", str(default_model_dir),
           "--served-model-name", model, "--port", str(port), *auth, "--device", "cpu",
           "--slots", str(ENGINE["slots"]), "--max-seq", str(ENGINE["max_seq"]),
           "--prefill-chunk", str(ENGINE["prefill_chunk"]), "--torch-threads", "1",
           "--max-inflight", str(max_inflight), "--log-level", "WARNING", *extra]
    env = {**os.environ, "RAY_DEDUP_LOGS": "0"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    srv = Server(f"http://127.0.0.1:{port}", Path(default_model_dir), log, model, max_inflight=max_inflight, pid=proc.pid)
    try:
        _wait_ready(srv, proc)
        yield srv
    finally:
        proc.send_signal(signal.SIGINT)
        stopping = threading.Thread(target=_reap, args=(proc,), name=f"stop-serve-{proc.pid}")
        stopping.start()
        STOPPING.append(stopping)


# servers told to stop (SIGINT) whose exit is waited for in the background: a stop takes ~5 s (Serve's graceful
# shutdown, then Ray's), nearly all of it waiting, which the test worker spends on its next test instead; every
# one is waited for before the session ends (pytest_sessionfinish), so none outlives the run
STOPPING: list[threading.Thread] = []


def _reap(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def pytest_sessionfinish(session):
    while STOPPING:
        STOPPING.pop().join()


class SharedServer:
    """One server for a group of test modules (one unit of work under pytest-xdist: FILE_GROUPS in
    tests/conftest.py): started by the first test that asks for it, stopped once the test worker's next test is
    in none of them, so a server starts once per group and none idles for the rest of the run."""

    def __init__(self, name: str, files: tuple[str, ...], *args: str, **options):
        self.name, self.files, self.args, self.options = name, files, args, options
        self._stack = ExitStack()
        self._server: Server | None = None

    def get(self, request, default_model_dir, tmp_path_factory) -> Server:
        if request.path.name not in self.files:  # it would be stopped after that module's first test
            pytest.fail(f"{request.path.name} is not one of the {self.name} server's modules {self.files}")
        if self._server is None:
            work = tmp_path_factory.mktemp(self.name)
            self._server = self._stack.enter_context(running_server(default_model_dir, work, *self.args,
                                                                         **self.options))
        return self._server

    def leaving(self, nextitem) -> None:
        if self._server is not None and (nextitem is None or nextitem.path.name not in self.files):
            self._server = None
            self._stack.close()


# the server agent frameworks meet (test_frameworks.py, test_responses_api.py): they send no max_tokens, so
# --max-tokens bounds their replies; their prompts (tool schemas, instructions) need more than ENGINE's max_seq.
# test_load.py's 200 clients share it (a server start is ~30-60 s of the 2-core suite): they need an in-flight
# bound above the clients, so that every request may queue, and send max_tokens and short prompts themselves
# (neither --max-tokens nor the longer max_seq touches them); no module of the group relies on the suite's
# usual bound of MAX_INFLIGHT (test_server.py's 429 test runs on MAIN)
AGENT_MAX_TOKENS, AGENT_MAX_SEQ, AGENT_MAX_INFLIGHT = 160, 2048, 512
MAIN = SharedServer("serve", ("test_server.py", "test_tools_structured.py"))
AGENTS = SharedServer("agents", ("test_frameworks.py", "test_load.py", "test_responses_api.py"),
                      "--max-tokens", str(AGENT_MAX_TOKENS), "--max-seq", str(AGENT_MAX_SEQ),
                      max_inflight=AGENT_MAX_INFLIGHT)
SHARED = (MAIN, AGENTS)


@pytest.fixture(scope="module")
def server(request, default_model_dir, tmp_path_factory):
    """The server of test_server.py and test_tools_structured.py, started once for both."""
    return MAIN.get(request, default_model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def agent_server(request, default_model_dir, tmp_path_factory):
    """One server for the modules that run agent frameworks and the Responses API, and for test_load.py."""
    return AGENTS.get(request, default_model_dir, tmp_path_factory)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    out = yield
    for shared in SHARED:
        shared.leaving(nextitem)
    return out


def _wait_ready(srv: Server, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"capsulert serve exited with {proc.returncode}:\n{srv.log.read_text()[-4000:]}")
        try:
            if srv.http("GET", "/v1/models").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pytest.fail(f"capsulert serve did not answer within {START_TIMEOUT_S}s:\n{srv.log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def oracle(default_model_dir):
    """The in-process engine the server's answers are checked against."""
    eng = Engine.from_config(dict(model=str(default_model_dir), device="cpu", **ENGINE))
    yield eng
    eng.close()


@pytest.fixture
def acme(server):
    return server.client("acme")


@pytest.fixture
def globex(server):
    return server.client("globex")
