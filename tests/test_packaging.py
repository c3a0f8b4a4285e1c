"""Front doors: the top-level API (lazy, light), and the wheel: built from the sources, installed into a
clean virtualenv, working from a directory outside the repository."""
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import capsulert

REPO = Path(__file__).resolve().parents[1]
ISSUE_NAMES = ["Engine", "EngineConfig", "SamplingParams", "Orchestrator", "best_of_n", "tree_search",
               "EpisodeDriver", "errors", "CapsuleRef", "CapsuleInfo", "GenerateResult", "Candidate"]


def python(code: str, *, exe: str = sys.executable, cwd=None, env=None) -> str:
    proc = subprocess.run([exe, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


# ------------------------------------------------------------------------------------- top-level API
def test_top_level_names_are_the_real_objects():
    from capsulert.capsule_store.capsule import CapsuleRef
    from capsulert.orchestrator import EpisodeDriver, Orchestrator, best_of_n, tree_search
    from capsulert.engine.engine import Engine
    from capsulert.config.engine import EngineConfig
    from capsulert.protocol.sampling import SamplingParams

    from capsulert import errors  # noqa: I001 - the import under test
    assert errors.UnknownCapsuleError.__module__ == "capsulert.errors"
    assert (capsulert.Engine, capsulert.EngineConfig, capsulert.SamplingParams, capsulert.Orchestrator,
            capsulert.best_of_n, capsulert.tree_search, capsulert.EpisodeDriver, capsulert.CapsuleRef) == \
        (Engine, EngineConfig, SamplingParams, Orchestrator, best_of_n, tree_search, EpisodeDriver, CapsuleRef)
    assert set(ISSUE_NAMES) <= set(capsulert.__all__) <= set(dir(capsulert))
    for name in capsulert.__all__:  # every advertised name resolves
        assert getattr(capsulert, name) is not None, name
    version = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert capsulert.__version__ == version


def test_unknown_top_level_name_is_an_attribute_error():
    try:
        capsulert.Engin  # noqa: B018
    except AttributeError as e:
        assert "Engin" in str(e)
    else:
        raise AssertionError("capsulert.Engin resolved")


def test_import_capsulert_is_light():
    # subprocesses: this test process has long imported torch and ray
    out = python("import sys, capsulert; from capsulert import errors; errors.UnknownCapsuleError; "
                 "print(sorted(m for m in ('torch', 'ray', 'capsulert.worker') if m in sys.modules))")
    assert out.strip() == "[]"
    out = python("import sys; from capsulert import Engine, SamplingParams, CapsuleRef; "
                 "print('torch' in sys.modules, 'ray' in sys.modules)")
    assert out.split() == ["True", "False"]  # the in-process engine never pays for Ray
    out = python("import sys; from capsulert import Orchestrator, best_of_n; print('ray' in sys.modules)")
    assert out.split() == ["True"]
    # `capsulert serve` validates its options and refuses bad ones, and its driver starts Ray and Serve,
    # without torch (its workers import it): a config reads the kernels' chunk from kernels/chunk.py
    out = python("import sys, capsulert.cli, capsulert.serve.runner, capsulert.serve.deployment; "
                 "print('torch' in sys.modules)")
    assert out.split() == ["False"]


def test_guide_engine_example_runs(default_model_dir, capsys):
    guide = (REPO / "docs" / "guide.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", guide, re.S) if "Engine.from_config" in b)
    block = block.replace('model="default"', f"model={str(default_model_dir)!r}, device='cpu'")
    exec(compile(block, "docs/guide.md", "exec"), {})
    assert "no capsule 'no-such-capsule'" in capsys.readouterr().out


def test_py_typed_ships():
    assert (REPO / "capsulert" / "py.typed").is_file()


# ------------------------------------------------------------------------------------------- the wheel
def test_wheel_works_from_a_clean_venv_outside_the_repository(tmp_path):
    # build from a copy of what a wheel may use, so nothing outside the package can leak in
    src = tmp_path / "src"
    src.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / f, src / f)
    shutil.copytree(REPO / "capsulert", src / "capsulert", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist")], check=True, capture_output=True, timeout=120, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("capsulert-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {p.name for p in (REPO / "capsulert" / "configs" / "models").glob("*.yaml")}
    assert "default.yaml" in configs
    assert {f"capsulert/configs/models/{c}" for c in configs} <= names
    assert {"capsulert/py.typed", "capsulert/data/corpus.txt", "capsulert/cli.py"} <= names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "capsulert = capsulert.cli:main" in entry_points

    # a fresh venv; dependencies (torch, ray, ...) come from this environment's site-packages through a
    # plain path line, which does not run this environment's editable-install hook (so the repo's
    # capsulert stays invisible)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    vpy = venv / "bin" / "python"
    purelib = Path(python("import sysconfig; print(sysconfig.get_paths()['purelib'])", exe=str(vpy)).strip())
    (purelib / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(vpy), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, capture_output=True, timeout=120)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # the default model is generated afresh from package data
    out = python(
        "import capsulert\n"
        "from capsulert import Engine\n"
        "print(capsulert.__file__)\n"
        "engine = Engine.from_config(model='default')\n"
        "s = engine.open()\n"
        "s.append('A long shared system prompt')\n"
        "print('tokens', len(s.generate(4)))\n",
        exe=str(vpy), cwd=elsewhere, env=env)
    assert out.splitlines()[0].startswith(str(purelib / "capsulert")), out  # the wheel's copy, not the repo's
    assert "tokens 4" in out
    assert (tmp_path / "cache" / "capsulert" / "models").is_dir()

    cli = [str(venv / "bin" / "capsulert")]
    proc = subprocess.run(cli + ["capsules", "ls", str(elsewhere)], capture_output=True, text=True, cwd=elsewhere,
                          env=env, timeout=60)
    assert proc.returncode == 0 and "no capsules" in proc.stdout, proc.stderr
    proc = subprocess.run(cli + ["bench", "capsules"], capture_output=True, text=True, cwd=elsewhere, env=env,
                          timeout=60)
    assert proc.returncode == 1 and "repository checkout" in proc.stderr and "Traceback" not in proc.stderr


def test_docs_live_in_the_repository():
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert {p.name for p in docs} >= {"README.md", "design.md", "guide.md"}
    for doc in docs:
        text = doc.read_text()
        assert "../shared" not in text and "DESIGN.md" not in text, doc
        for target in re.findall(r"\]\(([^)#:]+)\)", text):  # relative links resolve
            assert (doc.parent / target).exists(), (doc.name, target)
