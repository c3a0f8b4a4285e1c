"""Issue 15 item 1: a disk_dir is never shared by two live owners, and its index equals its files.

Two engines on one disk_dir used to overwrite each other's capsule files (file names hash only
namespace and name): engine A then restored its own tokens with B's tensors, and B's delete unlinked
A's pinned capsule. Now the second live owner is refused with DiskDirInUseError (same process or
another), the directory is taken over as soon as its owner dies (however it dies), and
load(disk_dir) re-indexes what a dead owner left, in place, so listing == files == what restores.
"""
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from capsulert.capsule_store import CapsuleMeta, CapsuleStore, capsule_file_name, tensor_nbytes
from capsulert.capsule_store.format.disk import list_capsule_files
from capsulert.capsule_store.owner import LOCK_NAME, check_unowned, host_id
from capsulert.errors import CapsuleIOError, DiskDirInUseError, InvalidRequestError

REPO = Path(__file__).resolve().parents[2]
FP, LAYOUT = "fp-shared", 1


def tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return {"kv": torch.randn(4, 8, generator=g), "ssm": torch.randn(16, generator=g)}


def meta(name, t):
    return CapsuleMeta.build(name=name, tokens=list(range(5)), grid_pos=0, fingerprint=FP, layout_version=LAYOUT,
                             grid=8, nbytes=tensor_nbytes(t))


def store(disk_dir=None, reindex=True, **budgets):
    return CapsuleStore(device="cpu", fingerprint=FP, layout_version=LAYOUT, budgets=budgets or None,
                        disk_dir=disk_dir, reindex=reindex)


def exact(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_engines_sharing_a_disk_dir_is_refused(make_engine, text, tmp_path):
    """The reported case: engine B on engine A's disk_dir. B is refused; A's capsules are untouched."""
    disk = tmp_path / "disk"
    a = make_engine(disk_dir=str(disk))
    s = a.open()
    s.append(text[:400])
    s.snapshot("x", tier="disk", pin=True)
    want = s.logits()
    with pytest.raises(DiskDirInUseError, match=f"pid {os.getpid()}"):
        make_engine(disk_dir=str(disk))
    with pytest.raises(DiskDirInUseError):  # nor a bare store, nor a save into it
        store(disk)
    with pytest.raises(DiskDirInUseError):
        store().save(disk)
    assert [p.name for p in list_capsule_files(disk)] == [capsule_file_name("default", "x")]
    assert torch.equal(a.restore("x").logits(), want)  # A still restores its own bytes
    a.store.close()
    b = make_engine(disk_dir=str(disk))  # released: the next owner takes the directory
    # and finds x there: the restore promoted a copy, the file stayed (the disk tier survives restarts)
    assert [i.name for i in b.store.list()] == ["x"] and torch.equal(b.restore("x").logits(), want)


def test_owner_in_another_process_is_refused_then_taken_over_when_it_dies(tmp_path, caplog):
    disk = tmp_path / "disk"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from capsulert.capsule_store import CapsuleStore
        s = CapsuleStore(device="cpu", fingerprint={FP!r}, layout_version={LAYOUT}, disk_dir={str(disk)!r})
        print("ready", flush=True)
        time.sleep(600)
    """)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(DiskDirInUseError, match=f"pid {holder.pid} on this host"):
            store(disk)
    finally:
        holder.send_signal(signal.SIGKILL)  # no cleanup at all: the kernel drops its flock
        holder.wait(timeout=30)
        holder.stdout.close()
    with caplog.at_level(logging.INFO, logger="capsulert.capsule_store.owner"):
        s = store(disk)
    assert any(f"pid {holder.pid}" in r.getMessage() and "taking over" in r.getMessage() for r in caplog.records)
    s.put(meta("a", tensors(0)), tensors(0), tier="disk")
    assert [p.name for p in list_capsule_files(disk)] == [capsule_file_name("default", "a")]


def test_save_refuses_its_own_disk_dir_and_a_file(tmp_path):
    s = store(tmp_path / "disk")
    s.put(meta("a", tensors(0)), tensors(0), tier="host")
    with pytest.raises(InvalidRequestError, match="disk_dir"):
        s.save(tmp_path / "disk")
    (tmp_path / "f").write_text("not a directory")
    with pytest.raises(CapsuleIOError, match="not a directory"):
        s.save(tmp_path / "f")
    assert [i.name for i in s.list()] == ["a"] and list_capsule_files(tmp_path / "disk") == []
    assert s.save(tmp_path / "out") == 1 and len(list_capsule_files(tmp_path / "out")) == 1


def test_load_of_own_disk_dir_reindexes_what_a_dead_owner_left(tmp_path):
    """After a crash the files are still there: load(disk_dir) indexes them in place (no copy), the
    index then equals the files, and a delete removes the file (no resurrection at the next load)."""
    disk = tmp_path / "disk"
    a = store(disk, gpu=tensor_nbytes(tensors(0)), host=0)
    data = {f"c{i}": tensors(i) for i in range(4)}
    for n, t in data.items():
        a.put(meta(n, t), t)  # each put pushes the previous capsule down to disk (in the background)
    a.put(meta("d", data["c0"]), data["c0"], tier="disk")
    a.flush()
    on_disk = {i.name for i in a.list() if i.tier == "disk"}
    assert on_disk == {"c0", "c1", "c2", "d"}
    a.close(flush=False)  # as a crash would: memory gone (c3), files stay, lock released
    b = store(disk, reindex=False)  # left for an explicit load (by default a store indexes them at start)
    assert b.list() == [] and b.load(disk) == 4
    assert {i.name: i.tier for i in b.list()} == dict.fromkeys(on_disk, "disk")
    assert {p.name for p in list_capsule_files(disk)} == {capsule_file_name("default", n) for n in on_disk}
    for n in ("c0", "c1", "c2"):
        assert exact(b.get(n)[1], data[n])  # promoted to gpu: a copy, its file stays in the disk tier
    assert {p.name for p in list_capsule_files(disk)} == {capsule_file_name("default", n) for n in on_disk}
    for n in on_disk:
        b.delete(n)
    assert list_capsule_files(disk) == [] and b.load(disk) == 0
    assert sorted(p.name for p in disk.iterdir()) == [LOCK_NAME]


def _holder(script: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO, stdout=subprocess.PIPE,
                            text=True)


def test_a_forked_child_of_a_dead_owner_does_not_keep_the_directory(tmp_path):
    """Issue 29 item 7: the child inherited the lock descriptor, so the directory stayed locked while it
    lived, after its owner died. Now a forked child closes its copy at once."""
    disk, ready = tmp_path / "disk", tmp_path / "child-ran"
    holder = _holder(f"""
        import os, time
        from capsulert.capsule_store import CapsuleStore
        s = CapsuleStore(device="cpu", fingerprint={FP!r}, layout_version={LAYOUT}, disk_dir={str(disk)!r})
        child = os.fork()
        if child == 0:
            open({str(ready)!r}, "w").close()  # past fork, so past its after-fork hooks
            time.sleep(600)
            os._exit(0)
        print(child, flush=True)
        time.sleep(600)
    """)
    child = int(holder.stdout.readline())
    # killing the owner before the child's hooks ran (a loaded machine) would test nothing: wait for the child
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline, "the forked child never ran"
        time.sleep(0.01)
    try:
        with pytest.raises(DiskDirInUseError, match=f"pid {holder.pid}"):  # the owner itself still holds it
            store(disk)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        os.kill(child, 0)  # the child lives on
        s = store(disk)  # and the directory is free all the same
        s.put(meta("a", tensors(0)), tensors(0), tier="disk")
    finally:
        for pid in (holder.pid, child):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        holder.wait(timeout=30)
        holder.stdout.close()


def test_a_lock_held_by_another_process_than_its_recorded_dead_owner_says_so(tmp_path):
    """The lock file names a dead pid while something still holds the lock (a descriptor passed on or
    inherited before the fork safeguard): the refusal says the recorded owner is dead and what to do."""
    disk = tmp_path / "disk"
    disk.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    (disk / LOCK_NAME).write_text(f'{{"pid": {dead.pid}, "host": "{host_id()}", "role": "capsule store", '
                                  f'"since": 0}}')
    holder = _holder(f"""
        import fcntl, os, time
        fd = os.open({str(disk / LOCK_NAME)!r}, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("ready", flush=True)
        time.sleep(600)
    """)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(DiskDirInUseError, match=f"pid {dead.pid}.* is dead, but the lock is still held"):
            store(disk)
        with pytest.raises(DiskDirInUseError, match="is dead"):
            check_unowned(disk / "worker-0")  # what `capsulert capsules rm` asks, from below
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        holder.stdout.close()
    check_unowned(disk)
