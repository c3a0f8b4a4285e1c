"""Issue 29 item 1 over HTTP: requests queue for their sessions instead of being refused. 200 concurrent
clients with mixed n and batch prompts against a server of 8 slots are all answered 200, nothing lost,
no stream ended by an error event (bench/http_load.py drives and checks them; bench/RESULTS.md has its
p99); a request larger than the whole server is refused at once with a 400."""
import asyncio
import importlib.util
import time
from pathlib import Path

import pytest

from tests.serve.conftest import AGENT_MAX_INFLIGHT, ENGINE, KEYS, MODEL

_spec = importlib.util.spec_from_file_location("http_load", Path(__file__).resolve().parents[2] / "bench" / "http_load.py")
http_load = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(http_load)


@pytest.fixture(scope="module")
def roomy(agent_server):
    """A server of 8 slots whose in-flight bound is above the clients: every request may queue. The agents'
    server (tests/serve/conftest.py: AGENTS, started once for its group of modules) is one."""
    assert ENGINE["slots"] == 8 and agent_server.max_inflight == AGENT_MAX_INFLIGHT > 200
    return agent_server


@pytest.mark.slow
def test_200_concurrent_clients_with_mixed_n_and_batches_are_all_answered(roomy):
    # two tokens a choice: a stream still carries a chunk per token before its finish; what is checked, that
    # every request queues for its sessions and is answered whole, does not depend on the length
    res = asyncio.run(http_load.run_load(roomy.url, MODEL, KEYS["acme"], clients=200, requests=1, max_tokens=2,
                                         slots=ENGINE["slots"], timeout=240))
    print(f"200 clients: p50 {res['p50_s']:.2f} s, p99 {res['p99_s']:.2f} s, {res['requests_per_s']:.1f} req/s")
    assert res["statuses"] == {"200": 200} and res["lost"] == 0, res["problems"]


def test_a_request_larger_than_the_server_is_refused_at_once(roomy):
    for body in ({"prompt": ["x"] * 4, "n": 4}, {"prompt": ["x"] * 9}, {"prompt": ["x"] * 3, "n": 3, "stream": True}):
        t0 = time.monotonic()
        r = roomy.http("POST", "/v1/completions", json={"model": MODEL, "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["code"] == "exceeds_capacity", r.text
        assert time.monotonic() - t0 < 5.0  # never after a wait
    r = roomy.http("POST", "/v1/completions", json={"model": MODEL, "max_tokens": 2, "prompt": ["x"] * 2, "n": 4})
    assert r.status_code == 200 and len(r.json()["choices"]) == 8  # exactly the server's slots: it runs
