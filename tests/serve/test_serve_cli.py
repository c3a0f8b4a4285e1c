"""`capsulert serve` refuses what it cannot do in one line on stderr (no traceback, before Ray starts), and its
startup line says when the model's text is noise."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from capsulert.config.server import ServerOptions
from capsulert.serve.runner import serving_line
from capsulert.serve.tenants import Tenants

from conftest import free_port


def serve(*args: str, before: str = "pass") -> subprocess.CompletedProcess:
    """`capsulert serve ARGS` in a fresh interpreter, after running `before` there (to take something away)."""
    code = f"import sys; {before}; from capsulert.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "serve", "--log-level", "WARNING", *args],
                          capture_output=True, text=True, timeout=120)


def one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("capsulert: ") and "Traceback" not in proc.stderr
    return lines[0]


def test_cuda_without_a_gpu_is_one_line(default_model_dir):
    line = one_line(serve("--device", "cuda", "--port", str(free_port()), "--cache-dir", str(default_model_dir),
                          before="import torch; torch.cuda.device_count = lambda: 0"))
    assert "ConfigError: --device cuda" in line and "has 0" in line and "--device cpu" in line


def test_a_busy_port_is_one_line(default_model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = one_line(serve("--port", str(port), "--cache-dir", str(default_model_dir)))
    assert f"ConfigError: cannot listen on 127.0.0.1:{port}" in line


def test_a_missing_extra_is_one_line():
    for module in ("fastapi", "uvicorn"):
        line = one_line(serve("--port", str(free_port()), before=f"sys.modules[{module!r}] = None"))
        assert f"({module} is not installed)" in line and "pip install 'capsulert[serve]'" in line


def test_the_startup_line_says_when_the_weights_are_random(tmp_path):
    line = serving_line(ServerOptions.build(orchestrator={"engine": {"model": "default"}}, port=8123), Tenants.load(None))
    assert line.startswith("serving 'default' at http://127.0.0.1:8123/v1 (no API keys: one namespace)")
    assert "random weights" in line and "--model DIR" in line and "Qwen3.5" in line
    (tmp_path / "config.json").write_text("{}")  # a checkpoint directory: its weights are what they are
    line = serving_line(ServerOptions.build(orchestrator={"engine": {"model": str(tmp_path)}}), Tenants.load(None))
    assert "random" not in line and "--model" not in line


def test_the_noise_notice_comes_before_ray_starts(monkeypatch, caplog, default_model_dir):
    import ray

    from capsulert.serve.runner import start

    def no_ray(**kw):
        raise RuntimeError("Ray would start here")
    monkeypatch.setattr(ray, "init", no_ray)
    opts = ServerOptions.build(orchestrator={"engine": {"model": "default", "cache_dir": str(default_model_dir)}},
                               port=free_port())
    with pytest.raises(RuntimeError, match="Ray would start here"):
        start(opts)
    assert "note: the embedded default model has random weights" in caplog.text
