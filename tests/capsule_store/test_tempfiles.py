"""Issue 15 item 7: temp files of interrupted writes are cleaned at load, by owner and age, and logged
accurately: a write in progress (its writer alive) is left alone and said to be in progress, never
called interrupted; one whose writer is gone, or that is older than STALE_TEMP_S, is removed."""
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from capsulert.capsule_store import CapsuleMeta, CapsuleStore, capsule_file_name, tensor_nbytes, write_capsule
from capsulert.capsule_store.owner import host_id, writer_tag
from capsulert.capsule_store.format.tempfiles import STALE_TEMP_S, classify, temp_path

FP, LAYOUT = "fp-temp", 1
LOGGER = "capsulert.capsule_store.format.disk"


def dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def temp_file(directory, name, writer, age_s=0.0):
    """A temp file as a writer (`pid@host`, or None for a legacy name) would leave it, `age_s` old."""
    final = capsule_file_name("default", name)
    p = directory / (f".{final}.tmp-{writer}-{'ab' * 8}" if writer else f".{final}.tmp-{'cd' * 16}")
    p.write_bytes(b"half a capsule")
    if age_s:
        t = time.time() - age_s
        os.utime(p, (t, t))
    return p


def one_capsule(directory):
    t = {"x": torch.arange(6, dtype=torch.float32)}
    meta = CapsuleMeta.build(name="whole", tokens=[1, 2], grid_pos=0, fingerprint=FP, layout_version=LAYOUT,
                             grid=8, nbytes=tensor_nbytes(t))
    return write_capsule(directory, meta, t)


def load(directory, caplog):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        n = CapsuleStore(device="cpu", fingerprint=FP, layout_version=LAYOUT).load(directory)
    return n, [(r.levelno, r.getMessage()) for r in caplog.records]


def said(records, path, level, *words):
    return any(lvl == level and path.name in msg and all(w in msg for w in words) for lvl, msg in records)


def test_load_cleans_by_owner_and_age_and_says_which_is_which(tmp_path, caplog):
    one_capsule(tmp_path)
    here, gone = host_id(), dead_pid()
    dead = temp_file(tmp_path, "a", f"{gone}@{here}")
    mine = temp_file(tmp_path, "b", writer_tag())  # this very process is writing it
    hung = temp_file(tmp_path, "c", writer_tag(), age_s=STALE_TEMP_S + 60)  # alive, but for over an hour
    remote = temp_file(tmp_path, "d", "4242@0badc0de")  # another host: cannot tell, young
    remote_old = temp_file(tmp_path, "e", "4242@0badc0de", age_s=STALE_TEMP_S + 60)
    legacy = temp_file(tmp_path, "f", None)
    legacy_old = temp_file(tmp_path, "g", None, age_s=STALE_TEMP_S + 60)
    n, records = load(tmp_path, caplog)
    assert n == 1
    assert {p.name for p in tmp_path.iterdir() if ".tmp-" in p.name} == {mine.name, remote.name, legacy.name}
    assert said(records, dead, logging.WARNING, "removed", f"pid {gone}, is gone")
    assert said(records, mine, logging.INFO, "in progress", f"pid {os.getpid()}")
    assert not any(mine.name in msg for lvl, msg in records if lvl >= logging.WARNING)  # not "interrupted"
    for old in (hung, remote_old, legacy_old):
        assert said(records, old, logging.WARNING, "removed", "older than")
    assert said(records, remote, logging.WARNING, "in progress or interrupted", "host 0badc0de", "never loaded")
    assert said(records, legacy, logging.WARNING, "unknown writer", "never loaded")


def test_a_live_writer_in_another_process_is_reported_in_progress(tmp_path, caplog):
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        busy = temp_file(tmp_path, "a", f"{writer.pid}@{host_id()}")
        _, records = load(tmp_path, caplog)
        assert busy.exists() and said(records, busy, logging.INFO, "in progress", f"pid {writer.pid}")
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    _, records = load(tmp_path, caplog)  # its writer died: now it is an interrupted write
    assert not busy.exists() and said(records, busy, logging.WARNING, "removed", "interrupted")


def test_a_store_sweeps_its_disk_dir_when_it_takes_it(tmp_path):
    dead = temp_file(tmp_path, "a", f"{dead_pid()}@{host_id()}")
    CapsuleStore(device="cpu", fingerprint=FP, layout_version=LAYOUT, disk_dir=tmp_path)
    assert not dead.exists()


def test_temp_names_carry_their_writer(tmp_path):
    p = temp_path(tmp_path / capsule_file_name("default", "x"))
    p.write_bytes(b"")
    t = classify(p, time.time())
    assert (t.pid, t.host) == (os.getpid(), host_id())


@pytest.mark.parametrize("name", [".hidden" + ".capsule.safetensors", "x.capsule.safetensors.bak"])
def test_misnamed_capsule_files_are_ignored_not_removed(tmp_path, caplog, name):
    (tmp_path / name).write_bytes(b"?")
    n, records = load(tmp_path, caplog)
    assert n == 0 and (tmp_path / name).exists()
    assert any(name in msg and lvl == logging.WARNING for lvl, msg in records)
