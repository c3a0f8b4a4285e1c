"""The `capsulert` command line: demo, capsules ls/rm, bench (capsulert.cli)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import capsulert.capsule_store.format.disk as disk
from capsulert import cli
from capsulert.capsule_store import CapsuleMeta, capsule_file_name, write_capsule

REPO = Path(__file__).resolve().parents[1]


def write(directory, name, namespace="default", n_tokens=5, fingerprint="fp-test:float32"):
    """A small valid capsule file, made without an engine."""
    tensors = {"kv_k": torch.arange(12, dtype=torch.float32).reshape(3, 4), "pos": torch.tensor([n_tokens])}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    meta = CapsuleMeta.build(name=name, namespace=namespace, tokens=range(n_tokens), grid_pos=0,
                             fingerprint=fingerprint, layout_version=1, grid=64, nbytes=nbytes)
    return write_capsule(directory, meta, tensors)


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "capsulert.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


def ls_json(capsys, directory, *extra):
    assert cli.main(["capsules", "ls", str(directory), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


# ------------------------------------------------------------------------------------------ capsules ls
def test_ls_describes_an_engines_capsules_without_reading_tensors(make_engine, tmp_path, capsys, monkeypatch, text):
    eng = make_engine()
    s = eng.open()
    s.append(text)
    s.snapshot("system", pin=True)
    s.snapshot("system", namespace="acme")
    s.append(" more")
    s.snapshot("turn-1", tier="host")
    eng.store.save(tmp_path)
    infos = {(i.namespace, i.name): i for i in eng.store.list()}
    assert len(infos) == 3

    def no_tensors(*a, **k):
        raise AssertionError("capsules ls must not load tensors")
    monkeypatch.setattr(disk, "safe_open", no_tensors)
    monkeypatch.setattr(disk, "read_capsule", no_tensors)

    out = ls_json(capsys, tmp_path)
    got = {(c["namespace"], c["name"]): c for c in out["capsules"]}
    assert list(got) == [("acme", "system"), ("default", "system"), ("default", "turn-1")]  # sorted
    for key, c in got.items():
        assert c["tokens"] == infos[key].meta.boundary
        assert c["nbytes"] == infos[key].nbytes
        assert c["fingerprint"] == eng.fingerprint
        assert c["tier"] == "disk"
        assert c["file_bytes"] == (tmp_path / c["file"]).stat().st_size > c["nbytes"]
    assert out["skipped"] == []

    assert cli.main(["capsules", "ls", str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAMESPACE", "NAME", "TOKENS", "TIER", "SIZE", "CREATED", "MODEL", "FINGERPRINT"]
    row = next(r for r in table if " turn-1 " in r).split()
    assert row[0] == "default" and row[2] == str(infos["default", "turn-1"].meta.boundary) and row[3] == "disk"
    assert row[-1] == eng.fingerprint

    assert [c["namespace"] for c in ls_json(capsys, tmp_path, "--namespace", "acme")["capsules"]] == ["acme"]


def test_ls_starts_no_engine_and_no_ray(tmp_path):
    write(tmp_path, "a")
    code = ("import sys; from capsulert.cli import main; rc = main(['capsules', 'ls', sys.argv[1]]); "
            "heavy = [m for m in ('ray', 'capsulert.engine.engine', 'capsulert.orchestrator') if m in sys.modules]; "
            "assert rc == 0 and not heavy, heavy")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert " a " in proc.stdout


def test_ls_reports_partial_and_corrupt_files(tmp_path, capsys):
    good = write(tmp_path, "good")
    partial = tmp_path / f".{capsule_file_name('default', 'late')}.tmp-0123abcd"
    partial.write_bytes(b"interrupted")
    (tmp_path / "notes.txt").write_text("not a capsule")  # other files are none of our business
    assert cli.main(["capsules", "ls", str(tmp_path)]) == 0  # a partial temp file is a routine leftover
    out, err = capsys.readouterr()
    assert "good" in out and partial.name in err and "partial write" in err and "notes" not in err

    bad = write(tmp_path, "bad")
    bad.write_bytes(bad.read_bytes()[:-3])  # truncated
    assert cli.main(["capsules", "ls", str(tmp_path)]) == 1  # listed what it could, and says what is wrong
    out, err = capsys.readouterr()
    assert "good" in out and " bad " not in out
    assert f"skipped {bad.name}" in err and "truncated" in err
    assert good.exists() and bad.exists()  # ls never changes anything


def test_ls_empty_and_missing_directories(tmp_path, capsys):
    assert cli.main(["capsules", "ls", str(tmp_path)]) == 0
    assert "no capsules in" in capsys.readouterr().out
    assert cli.main(["capsules", "ls", str(tmp_path / "nope")]) == 1
    assert "InvalidRequestError" in capsys.readouterr().err
    assert cli.main(["capsules", "ls", str(tmp_path), "--namespace", "../x"]) == 1
    assert "InvalidCapsuleNameError" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ capsules rm
def test_rm_deletes_exactly_one_capsule_and_the_store_agrees(make_engine, tmp_path, capsys, text):
    eng = make_engine()
    s = eng.open()
    s.append(text)
    s.snapshot("keep")
    s.snapshot("drop")
    s.snapshot("drop", namespace="acme")
    eng.store.save(tmp_path)

    assert cli.main(["capsules", "rm", str(tmp_path), "drop"]) == 0
    assert "deleted capsule default/drop" in capsys.readouterr().out
    assert [(c["namespace"], c["name"]) for c in ls_json(capsys, tmp_path)["capsules"]] == \
        [("acme", "drop"), ("default", "keep")]
    fresh = make_engine()
    assert fresh.store.load(tmp_path) == 2  # what is left is intact and loads

    assert cli.main(["capsules", "rm", str(tmp_path), "drop", "--namespace", "acme"]) == 0
    assert "deleted capsule acme/drop" in capsys.readouterr().out
    assert [c["name"] for c in ls_json(capsys, tmp_path)["capsules"]] == ["keep"]


def test_rm_unknown_name_is_a_typed_refusal(tmp_path, capsys):
    write(tmp_path, "x", namespace="acme")
    before = sorted(tmp_path.iterdir())
    assert cli.main(["capsules", "rm", str(tmp_path), "x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("capsulert: UnknownCapsuleError: no capsule 'x' in namespace 'default'")
    assert "it exists in namespace 'acme'" in err  # points at the namespace that has it
    assert "Traceback" not in err
    assert sorted(tmp_path.iterdir()) == before


@pytest.mark.parametrize("name", ["../victim.txt", "/tmp/victim.txt", "sub/victim.txt", "..", ".hidden", ""])
def test_rm_name_is_never_a_path(tmp_path, capsys, name):
    capsules = tmp_path / "capsules"
    path = write(capsules, "x")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    assert cli.main(["capsules", "rm", str(capsules), name]) == 1
    assert "InvalidCapsuleNameError" in capsys.readouterr().err
    assert victim.read_text() == "precious" and path.exists()


def test_rm_a_file_name_is_not_a_capsule_name(tmp_path, capsys):
    path = write(tmp_path, "x")
    assert cli.main(["capsules", "rm", str(tmp_path), path.name]) == 1
    assert "UnknownCapsuleError" in capsys.readouterr().err and path.exists()


def test_rm_damaged_file_needs_force(tmp_path, capsys):
    path = write(tmp_path, "x")
    path.write_bytes(path.read_bytes()[:40])
    assert cli.main(["capsules", "rm", str(tmp_path), "x"]) == 1
    err = capsys.readouterr().err
    assert "CorruptCapsuleError" in err and "--force" in err and path.exists()
    assert cli.main(["capsules", "rm", str(tmp_path), "x", "--force"]) == 0
    assert not path.exists()


def test_rm_is_refused_where_a_live_owner_holds_the_directory(tmp_path, capsys):
    """Issue 29 item 3: rm used to delete a capsule file under a live owner (exit 0, file gone)."""
    from capsulert.capsule_store import CapsuleStore
    from capsulert.capsule_store.owner import DirLock

    owned = tmp_path / "disk"
    store = CapsuleStore(device="cpu", fingerprint="fp-test:float32", layout_version=1, disk_dir=owned)
    path = write(owned, "x")
    assert cli.main(["capsules", "rm", str(owned), "x"]) == 1
    err = capsys.readouterr().err
    assert "DiskDirInUseError" in err and f"pid {os.getpid()}" in err and path.exists()
    # an orchestrator owns its workers' directories below its own: pinned/ of a worker is refused too
    orch_dir = tmp_path / "orch"
    lock = DirLock(orch_dir, "orchestrator")
    pinned = write(orch_dir / "worker-0" / "pinned", "p")
    assert cli.main(["capsules", "rm", str(orch_dir / "worker-0" / "pinned"), "p"]) == 1
    assert "orchestrator" in capsys.readouterr().err and pinned.exists()
    store.close()
    lock.release()
    assert cli.main(["capsules", "rm", str(owned), "x"]) == 0 and not path.exists()
    assert cli.main(["capsules", "rm", str(orch_dir / "worker-0" / "pinned"), "p"]) == 0 and not pinned.exists()


# ------------------------------------------------------------------------------------- entry points
def test_module_entry_point_help_lists_the_commands():
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    for command in ("demo", "capsules", "bench", "serve"):
        assert command in proc.stdout
    proc = run_cli("serve", "--help")  # the HTTP server's options (tests/serve runs the server itself)
    assert proc.returncode == 0 and "--keys" in proc.stdout and "--num-workers" in proc.stdout


def test_version(capsys):
    import capsulert

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"capsulert {capsulert.__version__}\n"
    assert capsulert.__version__ != "0+unknown"  # the package's own metadata: it is installed


def test_usage_errors_exit_2(capsys):
    for argv in ([], ["capsules"], ["capsules", "ls"], ["capsules", "ls", ".", "extra"], ["capsules", "rm", "."]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2, argv
    capsys.readouterr()


def test_demo_passes_its_arguments_through(default_model_dir):
    proc = run_cli("demo", "--quick", "--device", "cpu", "--no-orchestrator", "--cache-dir", default_model_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all checks passed" in proc.stdout and proc.stdout.count("bitwise") == 3
    help_ = run_cli("demo", "--help")
    assert help_.returncode == 0 and help_.stdout.startswith("usage: capsulert demo") and "--quick" in help_.stdout


# ------------------------------------------------------------------------------------------------ bench
def test_bench_lists_and_runs_scripts_of_the_checkout(capsys):
    assert cli.find_checkout() == REPO
    assert cli.main(["bench"]) == 0
    out = capsys.readouterr().out
    assert "capsules" in out and "working_set" in out
    assert "common" not in out  # a helper module, not a benchmark
    proc = run_cli("bench", "capsules", "--help", cwd=REPO / "bench")
    assert proc.returncode == 0, proc.stderr
    assert "--lengths" in proc.stdout  # the script's own options: the arguments reached it


def test_bench_refuses_unknown_names_and_paths(capsys):
    for name in ("nope", "common", "../bench/capsules", str(REPO / "bench" / "capsules.py")):
        assert cli.main(["bench", name]) == 1, name
        assert "InvalidRequestError: unknown benchmark" in capsys.readouterr().err


def test_bench_outside_a_checkout_says_why(tmp_path, monkeypatch, capsys):
    # as from an installed wheel: the package lives in site-packages and the cwd is no checkout
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site-packages" / "capsulert" / "cli.py"))
    monkeypatch.chdir(tmp_path)
    assert cli.find_checkout() is None
    assert cli.main(["bench", "capsules"]) == 1
    err = capsys.readouterr().err
    assert "InvalidRequestError" in err and "repository checkout" in err
