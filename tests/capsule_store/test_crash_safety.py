"""Crash safety of the disk tier: a writer process SIGKILLed at chosen points while saving capsules.

The writer (a process of its own) saves capsules into a CapsuleStore's disk tier; the parent kills it with
SIGKILL, over several rounds, restarting it each time with the capsules not yet on disk. After every
kill a fresh store loads the directory: every capsule that loads is byte-identical to what the writer
meant to save, a capsule once on disk stays there, every temp file left by an interrupted write is
removed with a warning naming it and its dead writer (never loaded, even when it is complete), and
nothing raises. A last, uninterrupted writer then saves the rest: all n capsules load, bitwise correct.

Kill points are seeded: each round picks a target among the next five capsules to save, and the
rounds alternate between two kinds:

- held (even rounds): a hook in the writer process stops the target's file write part way (in turn: a
  cut inside the data, every byte but not yet fsynced nor renamed, an empty temp file, a cut inside
  the header), says so on stdout and waits; the parent kills it then. So these kills land inside a
  write whatever the machine's load, and the test asserts that each of them left its temp file.
- timed (odd rounds): once the write of the target has begun, wait a random 0-12 ms and kill. This
  lands anywhere: inside a write, in the directory fsync, between writes, while building the next
  capsule's tensors, after the writer finished. Whether it landed mid-write is only logged.

A held round's writer is given the capsules up to one past the target (in cascade mode the target's
write is then a background one), a timed round's up to TIMED_AFTER past it, so that no round saves
more than a few and every held round is reached before all n are saved (see TIMED_AFTER).

Modes: "put" puts each capsule into the disk tier (a synchronous write: durable, in order, when put
returns, so what survives a kill is a prefix of the round's capsules). "cascade" (issue 15 item 9)
puts into a gpu tier one capsule wide with host disabled, so each put pushes the previous capsule down
to disk through the store's background writer, and the last capsule is demoted to disk explicitly (a
synchronous write). Queued background writes die with the process, as they only lived in memory (the
same as a crash just before the demotion), and the explicit demote may be durable before them, so what
survives need not be a prefix: the writer is restarted with exactly the missing capsules.
"""
import logging
import multiprocessing
import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from capsulert.capsule_store.format.checksum import tensors_checksum
from capsulert.capsule_store.format.names import capsule_file_name
from capsulert.capsule_store.format.disk import FILE_SUFFIX, list_capsule_files, write_capsule
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
                                 fingerprint=%r, layout_version=%r, grid=32,
                                 nbytes=tensor_nbytes(t), created_at=1000.0 + i)
        return meta, t
""" % (FP, LAYOUT))

# argv: directory, the capsule indices to save (comma-separated, in order), seed, mode, hold ("-" or
# "<index>:<fraction>": stop the file write of that capsule after that fraction of its bytes)
WRITER_SRC = MAKE_SRC + textwrap.dedent("""
    import os, sys, time
    import capsulert.capsule_store.format.staging as staging
    from capsulert.capsule_store.format.names import capsule_file_name
    from capsulert.capsule_store.store import CapsuleStore

    directory, todo, seed, mode, hold = sys.argv[1], [int(s) for s in sys.argv[2].split(",")], int(sys.argv[3]), sys.argv[4], sys.argv[5]
    if hold != "-":  # the kill point of a held round: inside the write of one capsule's temp file
        from safetensors.torch import save as serialize
        hold_i, frac = int(hold.split(":")[0]), float(hold.split(":")[1])
        held_prefix, real_save_file = "." + capsule_file_name("crash", f"cap-{hold_i:03d}") + ".tmp-", staging.save_file

        def save_file(tensors, filename, metadata=None):
            if not os.path.basename(filename).startswith(held_prefix):
                return real_save_file(tensors, filename, metadata=metadata)
            data = serialize(tensors, metadata=metadata)  # the bytes the real write would put there
            cut = int(len(data) * frac)
            with open(filename, "wb") as f:
                f.write(data[:cut])
                f.flush()
                os.fsync(f.fileno())  # so the parent sees exactly `cut` bytes
            print(f"held {cut} {len(data)} {os.path.basename(filename)}", flush=True)
            while True:  # the parent SIGKILLs us here
                time.sleep(60)
        staging.save_file = save_file

    made = [make(todo[0], seed)]  # warm the code paths
    # "put": each capsule is put into the disk tier (a synchronous write); "cascade": into a gpu tier one
    # capsule wide with host disabled, so each put pushes the previous capsule down to disk, written by
    # the store's background writer
    budgets = {"device": made[0][0].nbytes, "host": 0} if mode == "cascade" else None
    store = CapsuleStore(device="cpu", fingerprint=%r, layout_version=%r, disk_dir=directory, budgets=budgets)
    print("ready", flush=True)
    for i in todo:
        meta, t = make(i, seed)
        store.put(meta, t, tier="disk" if mode == "put" else "device")
    if mode == "cascade":
        store.demote(f"cap-{todo[-1]:03d}", "disk", "crash")
        store.flush()
""" % (FP, LAYOUT))

_ns = {}
exec(MAKE_SRC, _ns)
make = _ns["make"]


def bits(t):
    return t.contiguous().view(torch.uint8)


def read_line(proc, timeout=60.0):
    """The writer's next stdout line ('' if it exited), or AssertionError after `timeout` seconds. Its
    stdout is unbuffered here (bufsize=0: readline reads byte by byte), so a line that came right after
    the previous one is never hidden in a buffer while select waits for more."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"the writer said nothing for {timeout:.0f} s"
    return proc.stdout.readline().decode()


# Writers whose kill point does not depend on their speed (a held round's, stopped by the hook, and the last
# one, never killed) are processes forked by multiprocessing's fork server, a fresh interpreter that has
# imported torch and the store once: each is still a process of its own that runs WRITER_SRC and is SIGKILLed,
# without ~2 s of CPU spent importing them again. A timed round's writer is a fresh interpreter, as before:
# where its kill lands depends on how fast it runs (a forked one, its code paths warm, often finishes first)
FORKS = multiprocessing.get_context("forkserver")
FORKS.set_forkserver_preload(["torch", "safetensors.torch", "capsulert.capsule_store.store",
                              "capsulert.capsule_store.format.staging", "capsulert.capsule_store.capsule"])


class Writer:
    """A writer process (WRITER_SRC with `argv`, its stdout a pipe to this process), with the part of
    subprocess.Popen's interface the test uses."""

    def __init__(self, argv: list[str]):
        here, there = FORKS.Pipe(duplex=False)
        code = f"import os, sys\nos.chdir({str(REPO)!r})\nos.dup2(_out.fileno(), 1)\nsys.argv = {argv!r}\n"
        self._proc = FORKS.Process(target=exec, args=(code + WRITER_SRC, {"__name__": "__main__", "_out": there}))
        self._proc.start()
        there.close()
        self.pid = self._proc.pid
        self.stdout = os.fdopen(os.dup(here.fileno()), "rb", buffering=0)
        here.close()

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode  # -N: killed by signal N, as Popen says

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: a writer that has exited (and been reaped) is signalled no more
            os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int:
        self._proc.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired("writer", timeout)
        return self.returncode


def start_writer(directory, todo, mode="put", hold="-", fresh=False):
    argv = [str(directory), ",".join(map(str, todo)), str(SEED), mode, hold]
    if fresh:
        proc = subprocess.Popen([sys.executable, "-c", WRITER_SRC, *argv], cwd=REPO, stdout=subprocess.PIPE, bufsize=0)
    else:
        proc = Writer(["-c", *argv])
    line = read_line(proc)
    assert line.strip() == "ready", f"writer did not start: {line!r}"
    return proc


def partial_files(directory):
    return {p.name for p in Path(directory).iterdir() if ".tmp-" in p.name}


def wait_for_write(directory, i, proc, old, timeout=20.0):
    """Poll until the write of capsule i has begun (a new temp file for it, or its final file, exists);
    `old` are the temp files left by earlier rounds. Returns at once if the writer has exited."""
    final = capsule_file_name("crash", f"cap-{i:03d}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        exited = proc.poll() is not None  # before the listing: an exit after it is seen next time
        names = os.listdir(directory)
        if final in names or any(n.startswith(f".{final}.tmp-") and n not in old for n in names):
            return
        if exited:
            return
    raise AssertionError(f"the writer never began capsule {i}")


def load_and_check(directory, caplog, n):
    """Load the directory into a fresh store; check every capsule bitwise and the warnings about temp
    files. Returns the set of indices of the capsules that loaded."""
    partial = partial_files(directory)
    caplog.clear()
    store = CapsuleStore(device="cpu", fingerprint=FP, layout_version=LAYOUT)
    with caplog.at_level(logging.WARNING, logger="capsulert.capsule_store.format.disk"):
        count = store.load(directory)  # must not raise
    warned = {r.getMessage() for r in caplog.records if r.levelno == logging.WARNING}
    for name in partial:  # its writer was SIGKILLed: the temp file is garbage, removed and said so
        assert any(name in msg and "removed" in msg and "is gone" in msg for msg in warned), \
            f"partial file {name} was not removed with a warning"
    assert len(warned) == len(partial)
    assert partial_files(directory) == set()
    infos = store.list()
    assert len(infos) == count == len(list_capsule_files(directory))
    names = [i.name for i in infos]
    loaded = {int(s[len("cap-"):]) for s in names}
    assert sorted(names) == [f"cap-{i:03d}" for i in sorted(loaded)] and loaded <= set(range(n)), names
    for i in sorted(loaded):
        want_meta, want = make(i, SEED)
        meta, got = store.get(f"cap-{i:03d}", "crash")
        assert meta == want_meta.replace(checksum=tensors_checksum(want))
        assert sorted(got) == sorted(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
            assert torch.equal(bits(got[k]), bits(want[k])), (i, k)
    return loaded


# where a held write stops, in turn: inside the data (a seeded fraction), all bytes written (not yet
# fsynced nor renamed), an empty temp file, inside the header (its first ~80 bytes)
HOLD_CUTS = (None, 1.0, 0.0, 0.0001)
# how many capsules past its target a timed round's writer is given. A held round saves at most 4 (put:
# those before the target) or 5 (cascade: those too, and the one past the target, demoted synchronously),
# a timed one at most 5 + TIMED_AFTER; so before the last held round at most 4*4 + 4*8 = 48 < 50 (put)
# or 2*5 + 2*6 = 22 < 24 (cascade) are saved: every held round has capsules left to hold
TIMED_AFTER = {"put": 3, "cascade": 1}


@pytest.mark.parametrize("mode,n,rounds", [("put", N_CAPSULES, ROUNDS), ("cascade", 24, 6)])
def test_sigkill_during_saves(tmp_path, caplog, mode, n, rounds):
    """mode "cascade" (issue 15 item 9): the background writes of a budget cascade are as crash-safe."""
    rng = random.Random(SEED)
    directory = tmp_path / "capsules"
    directory.mkdir()
    held_rounds, mid_write_kills, saved, log = 0, 0, set(), []
    for rnd in range(rounds):
        todo = [i for i in range(n) if i not in saved]
        if not todo:
            break
        before = partial_files(directory)
        # a seeded kill point: the target is one of the next five capsules to save
        pos = min(rng.randrange(5), len(todo) - 1)
        held = rnd % 2 == 0
        target, todo = todo[pos], todo[:pos + (2 if held else 1 + TIMED_AFTER[mode])]
        if held:
            cut = HOLD_CUTS[held_rounds % len(HOLD_CUTS)]
            cut = rng.uniform(0.05, 0.95) if cut is None else cut
            proc = start_writer(directory, todo, mode, f"{target}:{cut:.6f}")
            line = read_line(proc)
            assert line.startswith("held "), f"the writer never reached the write of capsule {target}: {line!r}"
            nbytes, total, tmp_name = line.split()[1:]
            assert (directory / tmp_name).stat().st_size == int(nbytes) <= int(total)
        else:
            delay = rng.uniform(0.0, 0.012)
            proc = start_writer(directory, todo, mode, fresh=True)
            wait_for_write(directory, target, proc, before)
            time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL or (not held and proc.returncode == 0), proc.returncode
        new_partial = partial_files(directory) - before
        hit = bool(new_partial)  # the kill landed between a temp file's creation and its rename
        if held:
            assert tmp_name in new_partial, f"round {rnd}: the held write of capsule {target} left no temp file"
            held_rounds += 1
        mid_write_kills += hit
        loaded = load_and_check(directory, caplog, n)
        assert saved <= loaded, f"capsules {sorted(saved - loaded)} were on disk and are gone"
        new = loaded - saved
        assert new <= set(todo)
        if held:
            assert target not in new, f"the held capsule {target} loaded though its write never finished"
        if mode == "put":  # synchronous writes, one after the other: the durable ones are a prefix of todo
            assert sorted(new, key=todo.index) == todo[:len(new)], (todo, sorted(new))
        saved = loaded
        how = "killed mid-write" if hit else "killed between writes" if proc.returncode else "writer had finished"
        log.append(f"round {rnd} ({'held' if held else 'timed'}, target {target}): +{len(new)} saved, {how}")
    # the last writer runs to the end: all n saved and loadable, no partial file left
    todo = [i for i in range(n) if i not in saved]
    if todo:
        proc = start_writer(directory, todo, mode)
        assert proc.wait(timeout=60) == 0
        proc.stdout.close()
    assert load_and_check(directory, caplog, n) == set(range(n))
    assert partial_files(directory) == set()
    # the teeth: every held round killed inside a write (asserted above), and half the rounds are held
    assert held_rounds == (rounds + 1) // 2 and mid_write_kills >= held_rounds
    print("\n".join(log + [f"{mid_write_kills}/{len(log)} kills landed mid-write ({held_rounds} held)"]))


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
