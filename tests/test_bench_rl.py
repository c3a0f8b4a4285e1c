"""bench/rl.py's in-process path: the rates and where a step's time goes, on the embedded default model."""
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_in_process_steps_report_their_append_and_generate_time(engine):
    sys.path.insert(0, str(BENCH))
    try:
        import rl
    finally:
        sys.path.remove(str(BENCH))
    s = engine.open()
    s.append(list(range(10, 150)))
    s.snapshot("c0")
    s.close()
    for one_by_one in (False, True):
        out = rl.in_process(engine, 2, 2, 2, list(range(20, 28)), 3, one_by_one=one_by_one)
        assert out["steps_per_s"] > 0 and out["resets_per_s"] > 0
        assert out["append_ms_per_step"] > 0 and out["generate_ms_per_step"] > 0
        # the two parts are the step: 2 steps of 2 envs in 4 / steps_per_s seconds
        total_ms = 2 * 2 / out["steps_per_s"] * 1e3
        assert out["append_ms_per_step"] + out["generate_ms_per_step"] <= total_ms / 2 * 1.001
        assert out["append_ms_per_step"] + out["generate_ms_per_step"] >= total_ms / 2 * 0.8
