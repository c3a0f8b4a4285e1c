"""The docs site (`make docs`: MkDocs Material, the API reference by mkdocstrings) builds in strict mode, and
strict mode is what makes a broken link, a page missing from the nav or an API reference that does not
resolve fail the build."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def copy(tmp_path) -> Path:
    """A copy of the site's sources to break (the package linked in, for the API reference)."""
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    (tmp_path / "capsulert").symlink_to(REPO / "capsulert", target_is_directory=True)
    return tmp_path


def test_the_site_builds_in_strict_mode(tmp_path):
    proc = build(REPO / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-4000:]
    for page in ("index.html", "guide/index.html", "design/index.html", "api/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in ("capsulert.engine.engine.Engine.from_config", "capsulert.orchestrator.orchestrator.Orchestrator.start",
                 "capsulert.orchestrator.search.best_of_n", "capsulert.errors.NoFreeSlotError"):
        assert f'id="{name}"' in api, name  # generated from the code, documented or not


@pytest.mark.parametrize("break_it, says", [
    (lambda d: (d / "docs" / "guide.md").open("a").write("\nSee [the missing page](missing.md).\n"), "missing.md"),
    (lambda d: (d / "mkdocs.yml").write_text((d / "mkdocs.yml").read_text().replace(
        "  - API reference: api.md\n", "  - API reference: api.md\n  - Gone: gone.md\n")), "gone.md"),
    (lambda d: (d / "docs" / "api.md").open("a").write("\n::: capsulert.no_such_module\n"), "no_such_module"),
], ids=["broken link", "missing page", "unknown API object"])
def test_strict_mode_fails_on(copy, break_it, says):
    break_it(copy)
    proc = build(copy / "mkdocs.yml", copy / "site")
    assert proc.returncode != 0 and says in proc.stderr, proc.stderr[-3000:]
