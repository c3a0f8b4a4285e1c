"""Issue 15 items 8 and 9: what a budget cascade does off the caller's path, and what it drops.

Item 9: disk demotions of a cascade are written by a background thread: the verb that caused the
cascade returns before the write, the capsule is in the disk tier at once and readable from its source
bytes until its file is durable, a crash before that leaves no file (only what a crash just before the
demotion would have left), a failed write keeps the capsule readable and is reported by flush(), and
a delete or promotion meanwhile cancels the write. Writes the caller asked for stay synchronous.
Item 8: an unpinned capsule dropped because every tier is full is logged and counted in stats().
"""
import logging
import threading
import time
from pathlib import Path

import pytest
import torch

import capsulert.capsule_store.writer as writer_mod
from capsulert.capsule_store import CapsuleMeta, CapsuleStore, capsule_file_name, tensor_nbytes
from capsulert.capsule_store.format.disk import list_capsule_files
from capsulert.errors import CapsuleIOError

FP, LAYOUT = "fp-bg", 1
README = Path(__file__).resolve().parents[2] / "README.md"


def tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return {"kv": torch.randn(64, 64, generator=g), "ssm": torch.randn(256, generator=g)}


NB = tensor_nbytes(tensors(0))


def put(s, name, seed, **kw):
    t = tensors(seed)
    s.put(CapsuleMeta.build(name=name, tokens=[1, 2, 3], grid_pos=0, fingerprint=FP, layout_version=LAYOUT,
                            grid=8, nbytes=NB), t, **kw)
    return t


def exact(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def files(d):
    return {p.name for p in list_capsule_files(d)}


@pytest.fixture
def gate(monkeypatch):
    """Background writes wait for gate.set() before writing (a slow disk)."""
    ev = threading.Event()
    real = writer_mod.stage_capsule

    def slow(*a, **k):
        assert ev.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(writer_mod, "stage_capsule", slow)
    return ev


def small(tmp_path, **budgets):
    return CapsuleStore(device="cpu", fingerprint=FP, layout_version=LAYOUT, disk_dir=tmp_path,
                        budgets={"device": NB, "host": 0, **budgets})


def test_cascade_write_is_off_the_callers_path_and_readable_until_durable(tmp_path, gate):
    s = small(tmp_path)
    a = put(s, "a", 0)
    t0 = time.perf_counter()
    put(s, "b", 1, pin=True)  # pushes a down to disk: its write waits on the gate, the put does not
    assert time.perf_counter() - t0 < 5 and not gate.is_set()
    assert s.info("a").tier == "disk" and s.pending_writes == 1 and files(tmp_path) == set()
    assert exact(s.get("a")[1], a)  # gpu is full of pins: served from a's bytes in memory
    gate.set()
    s.flush()
    assert s.pending_writes == 0 and files(tmp_path) == {capsule_file_name("default", "a")}
    assert exact(s.get("a")[1], a)  # now read from the file
    assert s.info("a").meta.checksum  # the durable file's checksum is on record


def test_a_crash_before_the_write_is_durable_leaves_no_capsule_file(tmp_path, gate):
    s = small(tmp_path)
    put(s, "a", 0)
    put(s, "b", 1)
    assert s.info("a").tier == "disk"
    s.close(flush=False)  # the crash: the pending write is cancelled, as it dies with a process
    gate.set()
    deadline = time.monotonic() + 30
    while s.pending_writes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".capsulert")) == []
    fresh = CapsuleStore(device="cpu", fingerprint=FP, layout_version=LAYOUT, disk_dir=tmp_path)
    assert fresh.load(tmp_path) == 0


def test_delete_or_promotion_cancels_a_pending_write(tmp_path, gate):
    s = small(tmp_path, gpu=2 * NB)
    for i, n in enumerate("abcd"):
        put(s, n, i)  # a and b go down to disk, pending
    assert s.info("a").tier == s.info("b").tier == "disk" and s.pending_writes == 2
    s.delete("a")
    s.promote("b", "device")  # swaps with c, whose write joins the queue
    gate.set()
    s.flush()
    assert files(tmp_path) == {capsule_file_name("default", n) for n in ("c", "d") if s.info(n).tier == "disk"}
    assert {i.name: i.tier for i in s.list()} == {"b": "device", "c": "disk", "d": "device"}


def test_failed_background_write_keeps_the_capsule_and_is_reported(tmp_path, monkeypatch):
    def full(*a, **k):
        raise CapsuleIOError("cannot write capsule file: No space left on device")

    monkeypatch.setattr(writer_mod, "stage_capsule", full)
    s = small(tmp_path)
    a = put(s, "a", 0)
    put(s, "b", 1, pin=True)
    with pytest.raises(CapsuleIOError, match="No space left"):
        s.flush()
    assert s.stats()["disk_write_errors"] == 1 and exact(s.get("a")[1], a) and files(tmp_path) == set()
    s.flush()  # reported once
    monkeypatch.undo()
    s.demote("a", "disk")  # an explicit demote writes it now, synchronously
    assert files(tmp_path) == {capsule_file_name("default", "a")} and exact(s.get("a")[1], a)


def test_writes_the_caller_asks_for_are_synchronous(tmp_path, gate):
    s = small(tmp_path, gpu=None)
    put(s, "a", 0, tier="disk")
    put(s, "b", 1)
    s.demote("b", "disk")
    assert files(tmp_path) == {capsule_file_name("default", n) for n in "ab"} and s.pending_writes == 0


def test_dropped_capsules_are_logged_and_counted(tmp_path, caplog):
    s = small(tmp_path, disk=NB)
    put(s, "a", 0)
    put(s, "b", 1)  # a goes to disk
    with caplog.at_level(logging.WARNING, logger="capsulert.capsule_store.store"):
        put(s, "c", 2)  # b to disk, a dropped: every tier below gpu is full
    assert sorted(i.name for i in s.list()) == ["b", "c"]
    st = s.stats()
    assert (st["dropped"], st["dropped_bytes"], st["evictions"]) == (1, NB, 1)
    msg = [r.getMessage() for r in caplog.records if "dropped capsule default/a" in r.getMessage()]
    assert len(msg) == 1 and "unpinned" in msg[0] and "pin" in msg[0]


def test_readme_says_unpinned_capsules_may_be_dropped():
    section = README.read_text().split("## Reliability", 1)[1].split("\n## ", 1)[0]
    assert "dropped" in section and '"dropped"' in section and "pin" in section
