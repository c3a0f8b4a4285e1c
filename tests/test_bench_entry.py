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
    serving = _serving_bench()
    assert serving.parse_args([]).step_rederive_rows is serving.ENGINE_DEFAULT
    assert serving.parse_args(["--step-rederive-rows", "none"]).step_rederive_rows is None
    assert serving.parse_args(["--step-rederive-rows", "512"]).step_rederive_rows == 512
    # the same for the batched-append graphs' cap: 0 runs the eager path the graphs are measured against
    assert serving.parse_args([]).batched_piece_rows is None
    assert serving.parse_args(["--batched-piece-rows", "0"]).batched_piece_rows == 0
    out = subprocess.run([sys.executable, "bench/serving.py", "--step-rederive-rows", "lots"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--step-rederive-rows" in out.stderr


def test_serving_bench_hands_its_step_budgets_to_the_workers_engine_config():
    """--step-prefill-tokens and --step-prefill-decoding reach SchedulerConfig; without them the scheduler's own
    defaults hold."""
    from capsulert.config.engine import EngineConfig

    serving = _serving_bench()
    told = EngineConfig(**serving.engine_config(serving.parse_args(["--step-prefill-tokens", "2048",
                                                                     "--step-prefill-decoding", "512"])))
    assert told.scheduler.step_prefill_tokens == 2048 and told.scheduler.step_prefill_tokens_decoding == 512
    plain = EngineConfig(**serving.engine_config(serving.parse_args([])))
    assert plain.scheduler == EngineConfig().scheduler


def _serving_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("serving_bench", REPO / "bench" / "serving.py")
    serving = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serving)
    return serving


def test_serving_bench_takes_one_sessions_figures_from_several_lone_runs():
    """N = 1, the denominator of every ratio, is K lone runs one after another (--n1-samples, default 5): its
    TTFT is their median, and its decode rate the median of each run's own (one after another, the runs' token
    windows never overlap, so the crowd's overlap rate would be NaN)."""
    import asyncio
    import math
    from types import SimpleNamespace

    serving = _serving_bench()
    assert serving.parse_args([]).n1_samples == 5 and serving.parse_args(["--n1-samples", "1"]).n1_samples == 1
    first_token_s = {"a": 0.03, "b": 0.01, "c": 0.02}

    class Session:
        def __init__(self, name):
            self.name = name

        async def append(self, turn):
            await asyncio.sleep(first_token_s[self.name])

        async def stream(self, gen, params):
            for t in range(gen):
                await asyncio.sleep(0.002)
                yield SimpleNamespace(token=t)

        async def close(self):
            pass

    class Orchestrator:
        async def restore(self, name):
            return Session(name)

    def run(**kw):
        return asyncio.run(serving.run_n(Orchestrator(), ["a", "b", "c"], [[1]] * 3, 4, False, **kw))

    lone = run(lone=True)
    assert lone["tokens"] == [[0, 1, 2, 3]] * 3
    assert 20 <= lone["ttft_p50_ms"] < 30  # the median of ~12, ~22 and ~32 ms: b, c, a
    assert lone["decode_tokens_per_s"] > 0 and not math.isnan(lone["decode_tokens_per_s"])
    assert math.isnan(run()["decode_tokens_per_s"])
