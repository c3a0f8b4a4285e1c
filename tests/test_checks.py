"""Checks that keep the tree readable: ruff (its rule set in pyproject.toml), mypy on the layers every front end
shares (protocol/, config/, sessions/), and every file path a docstring, a comment or a doc names exists."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# a path in prose: `engine/runner.py`, `capsulert/progress.py`, `bench/RESULTS.md`, or a bare `runner.py`
PATH_RE = re.compile(r"(?<![\w./<-])((?:[\w.-]+/)*[\w-]+\.(?:py|md))\b")
# where a path with a folder may start
BASES = (ROOT, ROOT / "capsulert", ROOT / "tests", ROOT / "bench", ROOT / "docs")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    out = _run("ruff", "check", "capsulert", "tests", "bench", "examples")
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_finds_nothing_in_the_shared_layers():
    out = _run("mypy")  # its files and settings: [tool.mypy] in pyproject.toml
    assert out.returncode == 0, out.stdout + out.stderr


def _resolves(ref: str, source: Path) -> bool:
    here = source.parent
    if "/" in ref:
        return any((base / ref).exists() for base in (here, *BASES))
    # a bare module name in the package's own docstrings names a module of its package (or a top-level one);
    # docs use bare names only beside the folder they describe, so they are left to their readers
    if not ref.endswith(".py") or source.suffix != ".py":
        return True
    return any((base / ref).exists() for base in (here, ROOT, ROOT / "capsulert", ROOT / "bench", ROOT / "examples"))


def stale_paths(text: str, source: Path) -> list[tuple[int, str]]:
    """(line, path) for each path `text` (the contents of `source`) names that does not exist."""
    out = []
    text = re.sub(r"/\n\s*(?:#\s*)?", "/", text)  # a path broken across a line ("engine/\n  runner.py") is one
    for i, line in enumerate(text.splitlines(), 1):
        for m in PATH_RE.finditer(line):
            if "://" not in line[:m.start()] and not _resolves(m.group(1), source):
                out.append((i, m.group(1)))
    return out


def test_every_path_a_docstring_or_doc_names_exists():
    files = [*ROOT.joinpath("capsulert").rglob("*.py"), *ROOT.joinpath("examples").rglob("*.py"),
             *ROOT.joinpath("docs").rglob("*.md"), *ROOT.joinpath("bench").rglob("*.md"), ROOT / "README.md"]
    assert [f"{f.relative_to(ROOT)}:{i}: {p}" for f in files for i, p in stale_paths(f.read_text(), f)] == []


@pytest.mark.parametrize("text, stale", [
    ('"""Held by the table (engine/session_table.py)."""', []),
    ('"""Held by the table (engine/sessions_table.py)."""', ["engine/sessions_table.py"]),
    ('# see capsulert/engine/\n#   runner.py', []),
    ('"""The old one (gone.py) and the new one (runner.py)."""', ["gone.py"]),
    ('"""A URL https://example.com/a/b.py is not a path."""', []),
])
def test_the_path_check_finds_what_is_gone(text, stale):
    source = ROOT / "capsulert" / "engine" / "a_module.py"  # as if the text were this module's
    assert [p for _, p in stale_paths(text, source)] == stale
