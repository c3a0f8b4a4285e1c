"""The README's engine example runs as written (on the test suite's default model)."""
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_engine_example_runs(default_model_dir, tmp_path, monkeypatch):
    block = next(b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if "Engine.from_config" in b)
    block = block.replace('model="default"', f"model={str(default_model_dir)!r}, device='cpu'")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    engine = scope["engine"]
    assert [c.meta.name for c in engine.store.list()] == ["system"]
    assert engine.store.info("system").tier == "host"
    assert (tmp_path / "capsules").is_dir() and len(scope["outs"]) == 4
