"""Multi-node: an orchestrator joins an existing two-node Ray cluster by address, Ray places its two workers
on different nodes, and a capsule made on one node continues bitwise on the other, copied through the
object store and through a shared directory. The scenario runs in a subprocess (multinode_scenario.py):
its Cluster needs a Ray of its own, and this process holds the suite's local Ray."""
import json
import subprocess
import sys
from pathlib import Path

SCENARIO = Path(__file__).with_name("multinode_scenario.py")


def test_workers_on_two_nodes_and_capsules_migrate_between_them(default_model_dir, tmp_path):
    proc = subprocess.run([sys.executable, str(SCENARIO), "--model", str(default_model_dir),
                           "--shared-dir", str(tmp_path)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(r["worker_nodes"]) == ["node_a", "node_b"]  # one worker per node
    assert r["via_store"] == [0, 1] and r["via_disk"] == [0, 1]  # both copies landed on the other node
    assert r["export_equal"] and r["logits_equal"]  # the same capsule bytes, the same next-token logits
    for key in ("store_tokens", "store_logprobs", "disk_tokens", "disk_logprobs"):
        source, copy = r[key]
        assert source == copy and len(source) == 8, key  # greedy continuations identical, logprobs bitwise
