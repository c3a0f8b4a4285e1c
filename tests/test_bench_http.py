"""bench/serving.py --http on the CPU box: the HTTP server and the async API on one worker (so a one-GPU host
runs it too), the openai, httpx and lean clients in a process of their own; every HTTP answer equals the async
API's (the benchmark checks it), and the results are written, with where each client's time went. A machine without the GPU asked for is refused at once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "serving.py"


def serving_http(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), "--http", "--threads", "1", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_both_paths_on_one_worker(default_model_dir, tmp_path):
    proc = serving_http("--model", str(default_model_dir), "--ns", "1", "2", "--context", "128", "--turn", "8",
                        "--gen", "4", "--prefill-chunk", "128", "--requests", "3", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads((tmp_path / "serving_http.json").read_text())
    assert [r["request"] for r in res["latency"]] == ["stream", "whole"]
    assert [r["n"] for r in res["sweep"]] == [1, 2]
    for row in res["latency"]:
        assert row["api_p50_ms"] > 0 and row["http_p50_ms"] > 0  # both paths were timed
    # every client's requests, and where their time went: the server's own work and the client's
    assert [(r["request"], r["client"]) for r in res["by_client"]] == [
        (kind, client) for kind in ("stream", "whole") for client in ("openai", "httpx", "lean")]
    for row in res["by_client"]:
        assert row["p50_ms"] > 0 and 0 < row["server_own_p50_ms"] < row["p50_ms"]
        # each request's own work is its time before plus after its worker call, so its median is at least
        # either part's median (the order statistics of a sum of non-negative parts bound each part's)
        assert max(row["before_call_p50_ms"], row["after_call_p50_ms"]) <= row["server_own_p50_ms"]
        assert row["before_call_p50_ms"] > 0 and row["after_call_p50_ms"] > 0
        assert 0 < row["client_and_loopback_p50_ms"] < row["p50_ms"]
    for row in res["sweep"]:
        assert row["api_tokens_per_s"] > 0 and row["http_tokens_per_s"] > 0


def test_no_gpu_for_the_worker_is_refused_at_once(default_model_dir, tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the cluster Ray starts has no GPU
    proc = serving_http("--model", str(default_model_dir), "--device", "cuda", "--ns", "1", "--out", str(tmp_path),
                        env=env, timeout=180)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "serving.py --http: InsufficientResourcesError:" in proc.stderr and "GPU" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Started a local Ray instance" not in proc.stderr  # refused before Ray starts: this machine has no GPU
