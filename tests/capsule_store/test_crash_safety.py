"""Crash safety of the disk tier: a writer process SIGKILLed at random points while saving capsules.

The writer (a subprocess) puts capsules into a CapsuleStore's disk tier, one after the other; the
parent kills it with SIGKILL after a seeded random delay, over several rounds, restarting it with the
next names each time. After every kill a fresh store loads the directory: every capsule that loads is
byte-identical to what the writer meant to save, every temp file left by an interrupted write is
removed with a warning naming it and its dead writer, and nothing raises. Kill points are seeded: each round picks a
capsule among the next five and a delay after that capsule's write begins (0 every other round, so
some kills surely land inside a write; 1-12 ms otherwise, which lands anywhere: inside the write,
in the directory fsync, while building the next capsule's tensors).
"""
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from capsulert.capsule_store.capsule import capsule_file_name, tensors_checksum
from capsulert.capsule_store.disk import FILE_SUFFIX, list_capsule_files, write_capsule
from capsulert.capsule_store.store import CapsuleStore
from capsulert.errors import CorruptCapsuleError

REPO = Path(__file__).resolve().parents[2]
N_CAPSULES, ROUNDS, SEED = 50, 10, 1234
FP, LAYOUT = "fp-crash", 1

# shared by the writer subprocess and this test: what capsule i is meant to hold (~770 KB)
MAKE_SRC = textwrap.dedent("""
    import torch
    from capsulert.capsule_store.capsule import CapsuleMeta, tensor_nbytes

    def make(i, seed):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        t = {"kv": torch.randn(128, 1024, generator=g),
             "ssm": torch.randint(-2**15, 2**15, (256, 512), generator=g, dtype=torch.int16).view(torch.bfloat16),
             "pos": torch.tensor([i], dtype=torch.int32)}
        toks = torch.randint(0, 50000, (40 + i,), generator=g).tolist()
        meta = CapsuleMeta.build(name=f"cap-{i:03d}", namespace="crash", tokens=toks, grid_pos=32,
                                 fingerprint=%r, layout_version=%r, prefill_chunk=32,
                                 nbytes=tensor_nbytes(t), created_at=1000.0 + i)
        return meta, t
""" % (FP, LAYOUT))

WRITER_SRC = MAKE_SRC + textwrap.dedent("""
    import sys
    from capsulert.capsule_store.store import CapsuleStore

    directory, start, n, seed, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    made = [make(i, seed) for i in range(start, min(start + 1, n))]  # warm the code paths
    # "put": each capsule is put into the disk tier (a synchronous write); "cascade": into a gpu tier one
    # capsule wide with host disabled, so each put pushes the previous capsule down to disk, written by
    # the store's background writer
    budgets = {"gpu": made[0][0].nbytes, "host": 0} if mode == "cascade" else None
    store = CapsuleStore(device="cpu", fingerprint=%r, layout_version=%r, disk_dir=directory, budgets=budgets)
    print("ready", flush=True)
    for i in range(start, n):
        meta, t = make(i, seed)
        store.put(meta, t, tier="disk" if mode == "put" else "gpu")
    if mode == "cascade":
        store.demote(f"cap-{n - 1:03d}", "disk", "crash")
        store.flush()
""" % (FP, LAYOUT))

_ns = {}
exec(MAKE_SRC, _ns)
make = _ns["make"]


def bits(t):
    return t.contiguous().view(torch.uint8)


def start_writer(directory, start, n=N_CAPSULES, mode="put"):
    proc = subprocess.Popen([sys.executable, "-c", WRITER_SRC, str(directory), str(start), str(n), str(SEED), mode],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.strip() == "ready", f"writer did not start: {line!r}"
    return proc


def partial_files(directory):
    return {p.name for p in Path(directory).iterdir() if ".tmp-" in p.name}


def wait_for_write(directory, i, proc, old, timeout=20.0):
    """Poll until the write of capsule i has begun (a new temp file for it, or its final file, exists);
    `old` are the temp files left by earlier rounds."""
    final = capsule_file_name("crash", f"cap-{i:03d}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        names = os.listdir(directory)
        if final in names or any(n.startswith(f".{final}.tmp-") and n not in old for n in names):
            return
    raise AssertionError(f"the writer never began capsule {i}")


def load_and_check(directory, caplog):
    """Load the directory into a fresh store; check every capsule and the warnings. Returns the count."""
    partial = partial_files(directory)
    caplog.clear()
    store = CapsuleStore(device="cpu", fingerprint=FP, layout_version=LAYOUT)
    with caplog.at_level(logging.WARNING, logger="capsulert.capsule_store.disk"):
        n = store.load(directory)  # must not raise
    warned = {r.getMessage() for r in caplog.records if r.levelno == logging.WARNING}
    for name in partial:  # its writer was SIGKILLed: the temp file is garbage, removed and said so
        assert any(name in msg and "removed" in msg and "is gone" in msg for msg in warned), \
            f"partial file {name} was not removed with a warning"
    assert len(warned) == len(partial)
    assert partial_files(directory) == set()
    infos = store.list()
    assert len(infos) == n == len(list_capsule_files(directory))
    # writes are sequential, so the complete capsules are exactly cap-000 .. cap-(n-1)
    assert [i.name for i in infos] == [f"cap-{i:03d}" for i in range(n)]
    for i in range(n):
        want_meta, want = make(i, SEED)
        meta, got = store.get(f"cap-{i:03d}", "crash")
        assert meta == want_meta.replace(checksum=tensors_checksum(want))
        assert sorted(got) == sorted(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
            assert torch.equal(bits(got[k]), bits(want[k])), (i, k)
    return n


@pytest.mark.parametrize("mode,n,rounds", [("put", N_CAPSULES, ROUNDS), ("cascade", 24, 6)])
def test_sigkill_during_saves(tmp_path, caplog, mode, n, rounds):
    """mode "cascade" (issue 15 item 9): the background writes of a budget cascade are as crash-safe."""
    rng = random.Random(SEED)
    directory = tmp_path / "capsules"
    directory.mkdir()
    mid_write_kills, done, log = 0, 0, []
    for rnd in range(rounds):
        if done >= n:
            break
        before = partial_files(directory)
        proc = start_writer(directory, done, n, mode)
        # a seeded kill point: once the write of capsule done+j has begun, wait `delay` more; every
        # other round kills at once (delay 0), so some kills surely land inside a write
        target = min(done + rng.randrange(5), n - 1)
        delay = rng.uniform(0.001, 0.012) if rnd % 2 == 0 else 0.0
        wait_for_write(directory, target, proc, before)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL or proc.returncode == 0
        hit = bool(partial_files(directory) - before)
        mid_write_kills += hit  # the kill landed between the temp file's creation and its rename
        prev, done = done, load_and_check(directory, caplog)
        log.append(f"round {rnd}: +{done - prev} saved, {'killed mid-write' if hit else 'killed between writes'}")
    # the last writer runs to the end: all n saved and loadable, no partial file left
    proc = start_writer(directory, done, n, mode)
    assert proc.wait(timeout=60) == 0
    proc.stdout.close()
    assert load_and_check(directory, caplog) == n
    assert mid_write_kills >= rounds // 3, "almost no kill landed inside a write; the test has no teeth"
    assert partial_files(directory) == set()
    print("\n".join(log + [f"{mid_write_kills}/{len(log)} kills landed mid-write"]))


def _one(tmp_path, i=0):
    meta, t = make(i, SEED)
    return write_capsule(tmp_path, meta, t)


def test_complete_temp_file_is_not_loaded(tmp_path, caplog):
    """A writer killed after the fsync but before the rename leaves a whole, valid temp file: still ignored."""
    path = _one(tmp_path)
    tmp = tmp_path / f".{capsule_file_name('crash', 'cap-001')}.tmp-{'ab' * 16}"
    meta, t = make(1, SEED)
    os.replace(write_capsule(tmp_path / "sub", meta, t), tmp)
    hidden = tmp_path / f".{path.name}"  # a hidden complete name is not a capsule file either
    hidden.write_bytes(path.read_bytes())
    store = CapsuleStore(device="cpu", fingerprint=FP, layout_version=LAYOUT)
    with caplog.at_level(logging.WARNING):
        assert store.load(tmp_path) == 1
    assert [i.name for i in store.list()] == ["cap-000"]
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 2 and any(tmp.name in m for m in msgs) and any(hidden.name in m for m in msgs)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_complete_file_still_raises(tmp_path, damage):
    """Skipping is only for temp files: a complete-named file that is bad refuses the whole load."""
    _one(tmp_path, 0)
    bad = _one(tmp_path, 1)
    (tmp_path / f".{bad.name}.tmp-{'cd' * 16}").write_bytes(b"partial")
    raw = bytearray(bad.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    else:
        raw[-5] ^= 0x40
    bad.write_bytes(bytes(raw))
    store = CapsuleStore(device="cpu", fingerprint=FP, layout_version=LAYOUT)
    with pytest.raises(CorruptCapsuleError):
        store.load(tmp_path)
    assert store.list() == []  # nothing inserted


def test_file_suffix_is_what_the_store_writes(tmp_path):
    assert _one(tmp_path).name.endswith(FILE_SUFFIX)
