"""Benchmark entry points that lead to another benchmark."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_bench_speculate_runs_the_speculation_benchmark_with_its_options():
    out = subprocess.run([sys.executable, "bench/gpu.py", "--speculate", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--corrupt-every" in out.stdout and "--per-position-verify" in out.stdout  # speculate.py's own options
