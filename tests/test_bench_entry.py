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


def test_serving_bench_leaves_the_rederive_bound_to_the_engine_unless_told():
    """bench/serving.py without --step-rederive-rows runs the engine's default bound (it once passed None, which
    is unbounded); `none` asks for unbounded and a number for that bound; anything else is refused."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serving_bench", REPO / "bench" / "serving.py")
    serving = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serving)
    assert serving.parse_args([]).step_rederive_rows is serving.ENGINE_DEFAULT
    assert serving.parse_args(["--step-rederive-rows", "none"]).step_rederive_rows is None
    assert serving.parse_args(["--step-rederive-rows", "512"]).step_rederive_rows == 512
    # the same for the batched-append graphs' cap: 0 runs the eager path the graphs are measured against
    assert serving.parse_args([]).batched_piece_rows is None
    assert serving.parse_args(["--batched-piece-rows", "0"]).batched_piece_rows == 0
    out = subprocess.run([sys.executable, "bench/serving.py", "--step-rederive-rows", "lots"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--step-rederive-rows" in out.stderr
