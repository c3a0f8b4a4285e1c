"""The docs run as written: every ```python block of README.md and docs/*.md (CPU, the default model; those
that need `capsulert serve` in tests/serve/test_docs_http.py), and the README's commands for the examples."""
from __future__ import annotations

import sys

import pytest

from docs_blocks import REPO, docs_env, example_commands, python_blocks, run, run_block

BLOCKS = python_blocks()
LOCAL = [b for b in BLOCKS if b.no_run is None and not b.needs_server]
EXAMPLES = sorted(p.name for p in (REPO / "examples").glob("*.py"))


def test_every_block_runs_or_says_why():
    assert len(BLOCKS) >= 9 and {b.doc for b in BLOCKS} >= {"README.md", "docs/guide.md"}
    skipped = [b for b in BLOCKS if b.no_run is not None]
    assert all(len(b.no_run.split()) >= 3 for b in skipped), [b.no_run for b in skipped]  # a reason, not a tag
    assert len(skipped) <= 2, [b.id for b in skipped]  # rare: only what needs hardware or data we do not have
    for b in BLOCKS:  # a program each: nothing used that the block does not define or import itself
        compile(b.code, b.id, "exec")


@pytest.mark.slow
@pytest.mark.parametrize("block", LOCAL, ids=[b.id for b in LOCAL])
def test_block_runs_as_written(block, default_model_dir, tmp_path):
    proc = run_block(block.code, tmp_path, docs_env(default_model_dir, tmp_path / "cache"))
    assert "Traceback" not in proc.stderr


def test_the_readme_gives_a_command_for_every_example():
    assert sorted(script.removeprefix("examples/") for script, _ in example_commands()) == EXAMPLES


@pytest.mark.slow
@pytest.mark.parametrize("script, args", example_commands(), ids=[s for s, _ in example_commands()])
def test_example_runs_from_the_readme_command(script, args, default_model_dir, tmp_path):
    proc = run([sys.executable, str(REPO / script), *args], tmp_path, docs_env(default_model_dir, tmp_path / "cache"))
    assert proc.stdout.startswith("note: the embedded default model has random weights"), proc.stdout[:300]
    assert "--model DIR" in proc.stdout.splitlines()[0]
