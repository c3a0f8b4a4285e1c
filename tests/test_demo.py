"""The main job runs end to end (quick mode) and its own checks pass."""
import subprocess
import sys


def test_demo_quick(default_model_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "capsulert.demo", "--quick", "--device", "cpu", "--cache-dir", str(default_model_dir)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all checks passed" in proc.stdout
    # the first line says the default model's text is noise, and how to run a real checkpoint
    first = proc.stdout.splitlines()[0]
    assert "random weights" in first and "--model DIR" in first and "Qwen3.5" in first
    assert proc.stdout.count("bitwise") == 3
    assert proc.stdout.count("same tokens as in-process") == 3
