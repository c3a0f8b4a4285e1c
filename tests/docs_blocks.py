"""The code in the docs, for the tests that run it: every ```python block of README.md and docs/*.md, and the
README's commands for the examples. A block that cannot run on a CPU box says why in a line
`<!-- no-run: REASON -->` just above its fence (an HTML comment: neither GitHub nor MkDocs shows it).

Blocks run as written, each as a program of its own in a fresh interpreter (`run`), in an environment whose
cache home holds the test session's default model, so `model="default"` finds it instead of generating one
in the user's cache."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from capsulert.engine.default_model import default_cache_dir

REPO = Path(__file__).resolve().parents[1]
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
SERVER_URL = "http://127.0.0.1:8000"  # where the docs' HTTP examples find `capsulert serve`
_BLOCK = re.compile(r"^(?:<!-- no-run: (?P<reason>.*?) -->\n)?```python\n(?P<code>.*?)^```$", re.S | re.M)
_EXAMPLE = re.compile(r"^\.venv/bin/python (examples/\S+\.py)(.*?)(?:\s+#.*)?$", re.M)


@dataclass(frozen=True)
class Block:
    doc: str  # file name, relative to the repository
    line: int
    code: str
    no_run: str | None  # why it cannot run here; None: it runs

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def needs_server(self) -> bool:
        return SERVER_URL in self.code


def python_blocks() -> list[Block]:
    out = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for m in _BLOCK.finditer(text):
            line = text.count("\n", 0, m.start("code"))  # the fence's line, 1-based
            out.append(Block(str(path.relative_to(REPO)), line, m.group("code"), m.group("reason")))
    return out


def example_commands() -> list[tuple[str, list[str]]]:
    """The README's `.venv/bin/python examples/NAME.py ARGS` lines: (script, args)."""
    return [(script, args.split()) for script, args in _EXAMPLE.findall((REPO / "README.md").read_text())]


def docs_env(default_model_dir: Path, home: Path) -> dict[str, str]:
    """The environment blocks run in: a cache home (under `home`) whose default model is the session's."""
    models = home / "capsulert" / "models"
    models.mkdir(parents=True, exist_ok=True)
    link = models / default_cache_dir().name
    if not link.exists():
        link.symlink_to(default_model_dir, target_is_directory=True)
    return {**os.environ, "XDG_CACHE_HOME": str(home)}


def run(argv: list[str], cwd: Path, env: dict[str, str] | None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run argv (in env; None: this process's), which must succeed."""
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(argv)[:200]} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-5000:]}"
    return proc


def run_block(code: str, cwd: Path, env: dict[str, str] | None) -> subprocess.CompletedProcess:
    return run([sys.executable, "-c", code], cwd, env)
