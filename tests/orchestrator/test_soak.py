"""A short soak (bench/soak.py): 24 concurrent clients x 10 seeded operations through a two-worker
orchestrator, one worker killed midway and restarted by Ray. Zero losses: every successful reply equals
a replay on one in-process engine, every capsule the clients hold is byte-exact and continues like the
replay, every pinned capsule (the killed worker's included) survives; the only errors are WorkerLost
during the kill and the documented loss of the killed worker's unpinned capsules."""
import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.asyncio(loop_scope="session")
_spec = importlib.util.spec_from_file_location("soak", Path(__file__).resolve().parents[2] / "bench" / "soak.py")
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)


async def test_short_soak_with_a_worker_kill_loses_nothing(ray_session, default_model_dir, tmp_path):
    res = await soak.run_soak(clients=24, ops=10, seed=1, engine={"model": str(default_model_dir)},
                              disk_dir=str(tmp_path), call_timeout_s=60)
    soak.print_report(res)
    assert res["unexpected_errors"] == []
    assert res["total_losses"] == 0, res["mismatch_examples"]
    assert set(res["errors"]) <= {"WorkerLost", soak.EXPECTED_LOST_CAPSULE}
    assert res["operations"]["attempted"] == 240
    assert res["operations"]["succeeded"] >= 200  # the kill costs a few operations, not many
    assert res["kill"]["restart_s"] is not None and res["kill"]["after_operations"] >= 120
    caps = res["capsules"]
    assert caps["pinned_checked"] > 0 and caps["surviving_checked"] > caps["pinned_checked"]
    assert res["kill"]["pinned_reloaded_by_restarted_worker"] > 0  # the kill did hit persisted capsules
    assert res["operations"]["records_replayed"] > res["operations"]["succeeded"]
