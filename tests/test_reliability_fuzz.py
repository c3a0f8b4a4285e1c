"""Stateful fuzz (hypothesis RuleBasedStateMachine) over the engine's capsule verbs and the store's verbs.

One engine on the default model with a disk_dir; the rules open, append, snapshot, restore, restore in
place, fork and close sessions, and delete, pin, unpin, promote, demote, prefetch, set budgets (random, a
few capsules wide, so the gpu -> host -> disk -> dropped cascade and its background disk writes run),
flush, save, load, update the weights (one of three weight sets, named by the caller or not: the same
bytes may come back under a new version, and after a crash other bytes under an old version number),
re-derive stale sessions, rebuild stale capsules, and crash. A crash closes the store without flushing (its
background writes are cancelled, as a dead process's would be), leaves a temp file of a dead writer
behind, sometimes damages one capsule file of the disk tier, and starts a new engine on the same disk_dir
(its configured weights, version 0), whose store indexes what is there at start.

Invariants, after every step:
- no untyped exception: a rule may be refused only with a capsulert error, and a refusal changes
  nothing (listing, stats, free slots);
- no acknowledged capsule is lost: the listing is the model minus capsules dropped under budget
  pressure, each drop is counted in stats()["dropped"], and a pinned capsule is never dropped; across a
  crash, every capsule that was durable on disk comes back, and a save directory always loads to exactly
  what was saved;
- listing == files on disk == what restores: every capsule file is a disk-tier capsule, after a flush the
  disk tier is exactly the files, and every restore (and every capsule's bytes) equals, bitwise, what was
  snapshotted;
- weight versions never mix: a capsule restores only under the weights that made it: a fingerprint the
  engine runs names those very weights (the ground truth: which weight set computed it), across crashes
  whatever the version counter says, and any other capsule is StaleCapsuleError, changing nothing; a session open across an update is refused (StaleSessionError)
  until re-derived, and a re-derived session or a rebuilt capsule equals a cold prefill of its tokens
  under the current weights, bitwise; across a restart a damaged file is set aside with a typed record,
  never indexed, and every other durable capsule comes back.

Default size: 20 runs x 50 steps (a few seconds). CAPSULERT_FUZZ_EXAMPLES / CAPSULERT_FUZZ_STEPS scale it;
CAPSULERT_FUZZ_REPORT=<file> writes the figures (operations, crashes survived, losses) as JSON.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from capsulert.capsule_store import CapsuleStore, capsule_file_name, tensors_checksum
from capsulert.capsule_store.format.disk import list_capsule_files
from capsulert.capsule_store.owner import host_id
from capsulert.errors import CapsuleRTError
from capsulert.engine.engine import Engine

EXAMPLES = int(os.environ.get("CAPSULERT_FUZZ_EXAMPLES", "20"))
STEPS = int(os.environ.get("CAPSULERT_FUZZ_STEPS", "50"))
NAMES = ["a", "b", "c", "d", "e", "f"]
TIERS = ["device", "host", "disk"]
FIGURES: Counter = Counter()
PICK = st.integers(0, 99)  # mostly an existing capsule, sometimes any name (unknown ones are refused)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


WEIGHT_SETS = ("configured", "A", "B")


@dataclass(frozen=True)
class Expect:
    """What a capsule must restore to: its tokens, the next-token logits and its tensors' checksum; the
    fingerprint it was made under (only an engine running that one restores it) and the weight set that
    computed it (an engine whose fingerprint matches must run that set)."""

    tokens: tuple[int, ...]
    logits: torch.Tensor
    checksum: str
    fingerprint: str
    weights: str


class CapsuleMachine(RuleBasedStateMachine):
    model_dir: Path  # set by the test
    dead_pid: int

    def __init__(self):
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="capsulert-fuzz-"))
        self.disk = self.root / "disk"
        self.engine = self._engine()
        self.sessions: list = []
        self.model: dict[str, Expect] = {}  # acknowledged and not deleted
        self.pinned: set[str] = set()
        self.saves: list[tuple[Path, dict[str, Expect]]] = []
        self.dropped = self.engine.store.stats()["dropped"]
        # three weight sets (the configured ones and two nudged copies, made on first use) and the one the
        # engine runs now: the ground truth a capsule's fingerprint is checked against
        self.weight_sets = {"configured": {k: v.clone() for k, v in self.engine.model_weights.items()}}
        self.running = "configured"
        s = self.engine.open()
        s.append(list(range(1, 41)))
        self.unit = s.snapshot("probe", tier="host").nbytes  # a typical capsule's bytes: budgets are multiples
        self.engine.store.delete("probe")
        s.close()

    def _engine(self) -> Engine:
        return Engine.from_config(dict(model=str(self.model_dir), device="cpu", slots=4, max_seq=512,
                                       prefill_chunk=128, disk_dir=str(self.disk)))

    @property
    def store(self) -> CapsuleStore:
        return self.engine.store

    def teardown(self):
        try:
            self.store.flush()
            self._check_files(exact=True)
            for name in sorted(self.model):
                self._check_restore(name)
            for directory, saved in self.saves:  # a save directory is exactly what was saved, forever
                fresh = CapsuleStore(device="cpu", fingerprint=self.engine.fingerprint,
                                     layout_version=self.store.layout_version)
                assert fresh.load(directory) == len(saved)
                for name, exp in saved.items():
                    assert tensors_checksum(fresh.get(name)[1]) == exp.checksum
        finally:
            self.store.close(flush=False)
            shutil.rmtree(self.root, ignore_errors=True)

    # -- plumbing -------------------------------------------------------------------------------------
    def _state(self):
        return ([(i.namespace, i.name, i.tier, i.pinned) for i in self.store.list()], self.store.stats(),
                self.engine.free_slots)

    def _try(self, verb, *args, **kwargs):
        """Run a verb; a refusal must be a capsulert error that changes nothing. Returns (ok, result)."""
        FIGURES["operations"] += 1
        before = self._state()
        try:
            return True, verb(*args, **kwargs)
        except CapsuleRTError:
            FIGURES["refusals"] += 1
            assert self._state() == before, f"a refused {verb.__name__} changed the engine"
            return False, None

    def _pick(self, i: int) -> str:
        names = sorted(self.model)
        return names[i % len(names)] if names and i < 85 else NAMES[i % len(NAMES)]

    def _expect_from(self, session, name: str) -> Expect:
        checksum = tensors_checksum(self.store.get(name)[1])
        return Expect(tuple(session.tokens), session.logits().clone(), checksum, self.engine.fingerprint, self.running)

    def _free_slot(self, keep=None) -> None:
        """Close a session (never `keep`) when every slot is taken."""
        if not self.engine.free_slots:
            victim = next(x for x in self.sessions if x is not keep)
            self.sessions.remove(victim)
            victim.close()

    def _cold_logits(self, tokens, keep=None) -> torch.Tensor:
        """The next-token logits of a cold prefill of `tokens` under the current weights."""
        self._free_slot(keep)
        s = self.engine.open(namespace=None)
        try:
            s.append(list(tokens))
            return s.logits().clone()
        finally:
            s.close()

    def _current(self, name: str) -> bool:
        exp = self.model[name]
        if exp.fingerprint != self.engine.fingerprint:
            return False
        assert exp.weights == self.running, (f"capsule {name} of weights {exp.weights} has the fingerprint of the "
                                             f"running weights {self.running}: it would restore as theirs")
        return True

    def _check_restore(self, name: str) -> None:
        if not self._current(name):  # made under other weights: refused, and nothing changes
            ok, _ = self._try(self.engine.restore, name)
            assert not ok, f"stale capsule {name} restored under {self.engine.fingerprint}"
            FIGURES["stale_refused"] += 1
            return
        ok, r = self._try(self.engine.restore, name)
        if not ok:  # every slot is taken: free one and retry
            self.sessions.pop(0).close()
            r = self.engine.restore(name)
        exp = self.model[name]
        try:
            assert tuple(r.tokens) == exp.tokens
            assert torch.equal(r.logits(), exp.logits), f"restore of {name} is not bitwise what was snapshotted"
            assert tensors_checksum(self.store.get(name)[1]) == exp.checksum
        finally:
            r.close()
        FIGURES["restores_checked"] += 1

    def _check_files(self, exact: bool) -> None:
        # the disk tier's capsules, and the files kept of those promoted out of it (promotion copies)
        disk_tier = {capsule_file_name(i.namespace, i.name) for i in self.store.list() if i.on_disk}
        files = {p.name for p in list_capsule_files(self.disk)}
        assert files <= disk_tier, f"capsule files the index does not hold: {files - disk_tier}"
        if exact:
            assert files == disk_tier, f"disk capsules without a file: {disk_tier - files}"

    # -- sessions ---------------------------------------------------------------------------------------
    @initialize(n=st.integers(1, 60), seed=st.integers(0, 4000), name=st.sampled_from(NAMES), pin=st.booleans())
    def start(self, n, seed, name, pin):
        """Every run starts with a session and a capsule of it (hypothesis' swarm testing may leave a run
        without the rules that make them)."""
        self.open_append(n, seed, name, "host", pin)

    @rule(n=st.integers(1, 60), seed=st.integers(0, 4000), name=st.sampled_from(NAMES + [None]),
          tier=st.sampled_from(TIERS), pin=st.booleans())
    def open_append(self, n, seed, name, tier, pin):
        ok, s = self._try(self.engine.open)
        if ok:
            s.append([(seed + 7 * i) % 4000 + 1 for i in range(n)])
            self.sessions.append(s)
            if name is not None:
                self.snapshot(len(self.sessions) - 1, name, tier, pin)

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, 9), n=st.integers(1, 30), seed=st.integers(0, 4000))
    def append(self, i, n, seed):
        self._try(self.sessions[i % len(self.sessions)].append, [(seed + 3 * k) % 4000 + 1 for k in range(n)])

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, 9))
    def close(self, i):
        FIGURES["operations"] += 1
        self.sessions.pop(i % len(self.sessions)).close()

    # -- capsule verbs of the engine ----------------------------------------------------------------------
    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, 9), name=st.sampled_from(NAMES), tier=st.sampled_from(TIERS), pin=st.booleans())
    def snapshot(self, i, name, tier, pin):
        s = self.sessions[i % len(self.sessions)]
        ok, _ = self._try(s.snapshot, name, tier=tier, pin=pin)
        if ok:
            self.model[name] = self._expect_from(s, name)
            if pin:
                self.pinned.add(name)

    @rule(pick=PICK)
    def restore(self, pick):
        name = self._pick(pick)
        if name in self.model:
            self._check_restore(name)
        else:
            self._try(self.engine.restore, name)

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, 9), pick=PICK)
    def restore_in_place(self, i, pick):
        name = self._pick(pick)
        s = self.sessions[i % len(self.sessions)]
        ok, _ = self._try(s.restore, name)
        assert not ok or self._current(name), f"stale capsule {name} restored in place"
        if ok:
            exp = self.model[name]
            assert tuple(s.tokens) == exp.tokens and torch.equal(s.logits(), exp.logits)

    @rule(pick=PICK, n=st.integers(1, 3))
    def fork(self, pick, n):
        name = self._pick(pick)
        ok, branches = self._try(self.engine.fork, name, n)
        assert not ok or self._current(name), f"stale capsule {name} forked"
        for b in branches or []:
            exp = self.model[name]
            assert tuple(b.tokens) == exp.tokens and torch.equal(b.logits(), exp.logits)
            b.close()

    # -- store verbs ----------------------------------------------------------------------------------------
    @rule(pick=PICK)
    def delete(self, pick):
        name = self._pick(pick)
        ok, _ = self._try(self.store.delete, name)
        if ok:
            del self.model[name]
            self.pinned.discard(name)

    @rule(pick=PICK, flag=st.booleans())
    def pin(self, pick, flag):
        name = self._pick(pick)
        ok, _ = self._try(self.store.pin if flag else self.store.unpin, name)
        if ok:
            (self.pinned.add if flag else self.pinned.discard)(name)

    @rule(pick=PICK, tier=st.sampled_from(TIERS + [None]))
    def demote(self, pick, tier):
        self._try(self.store.demote, self._pick(pick), tier)

    @rule(pick=PICK, tier=st.sampled_from(TIERS), prefetch=st.booleans())
    def promote(self, pick, tier, prefetch):
        self._try(self.store.prefetch if prefetch else self.store.promote, self._pick(pick), tier)

    @rule(tier=st.sampled_from(TIERS), units=st.sampled_from([None, None, 0, 1, 2, 3, 5]))
    def set_budget(self, tier, units):
        self._try(self.store.set_budget, tier, None if units is None else units * self.unit)

    @rule(units=st.lists(st.sampled_from([None, 0, 1, 2]), min_size=3, max_size=3))
    def budgets(self, units):
        """All three budgets at once: tight ones make the cascade run to the end (drops of unpinned)."""
        for tier, u in zip(TIERS, units):
            self._try(self.store.set_budget, tier, None if u is None else u * self.unit)

    @rule(pick=PICK)
    def check_bytes(self, pick):
        name = self._pick(pick)
        if name in self.model:
            FIGURES["operations"] += 1
            assert tensors_checksum(self.store.get(name)[1]) == self.model[name].checksum

    @rule()
    def flush(self):
        FIGURES["operations"] += 1
        self.store.flush()
        self._check_files(exact=True)

    @rule()
    def save(self):
        directory = self.root / f"save-{len(self.saves)}"
        ok, n = self._try(self.store.save, directory)
        if ok:
            assert n == len(self.model)
            self.saves.append((directory, dict(self.model)))

    @precondition(lambda self: self.saves)
    @rule(i=st.integers(0, 99))
    def load(self, i):
        directory, saved = self.saves[i % len(self.saves)]
        ok, n = self._try(self.store.load, directory)
        if ok:  # none of its names was here: all of them are, byte-exact (unpinned, in memory)
            assert n == len(saved)
            self.model.update(saved)

    # -- weights ------------------------------------------------------------------------------------------
    @rule(roll=st.integers(0, 1), which=st.sampled_from(WEIGHT_SETS), named=st.booleans())
    def update_weights(self, roll, which, named):
        """New weights in place, a new version: one of three sets (the running one again, too), named by the
        caller (the same name for the same set, as an orchestrator re-applying an update does) or not."""
        if roll:
            return
        FIGURES["operations"] += 1
        if which not in self.weight_sets:
            g = torch.Generator().manual_seed(WEIGHT_SETS.index(which))
            base = self.weight_sets["configured"]
            self.weight_sets[which] = {k: v + 0.05 * v.abs().mean() * torch.randn(v.shape, generator=g)
                                       for k, v in base.items()}
        version = self.engine.update_weights(self.weight_sets[which], identity=f"set-{which}" if named else None)
        self.running = which
        assert version == self.engine.weights_version and all(s.stale for s in self.sessions if s.tokens)
        FIGURES["weight_updates"] += 1

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, 9))
    def rederive(self, i):
        """A session open across an update is refused until re-derived; then it is a cold prefill."""
        s = self.sessions[i % len(self.sessions)]
        if s.stale:
            ok, _ = self._try(s.logits)
            assert not ok, "a stale session answered"
        FIGURES["operations"] += 1
        s.rederive()
        assert not s.stale and torch.equal(s.logits(), self._cold_logits(s.tokens, keep=s)), \
            "a re-derived session is not a cold prefill under the current weights"
        FIGURES["rederived"] += 1

    @rule(pick=PICK)
    def rebuild(self, pick):
        name = self._pick(pick)
        stale = name in self.model and not self._current(name)
        ok, ref = self._try(self.engine.rebuild, name)
        if not ok:
            return
        assert (ref is not None) == stale, f"rebuild of {name}: {ref} (stale: {stale})"
        if ref is not None:
            tokens = self.model[name].tokens
            checksum = tensors_checksum(self.store.get(name)[1])
            self.model[name] = Expect(tokens, self._cold_logits(tokens), checksum, self.engine.fingerprint,
                                      self.running)
            self._check_restore(name)  # a cold prefill under the current weights, bitwise
            FIGURES["rebuilt"] += 1

    @rule()
    def load_own_disk_dir(self):
        ok, n = self._try(self.store.load, self.disk)  # refused (ConfigError) while the disk budget is 0
        assert not ok or n == 0, "the live store's own files are all indexed already"

    @rule(flushed=st.booleans(), roll=st.integers(0, 2), damage=st.integers(0, 1))
    def crash(self, flushed, roll, damage):
        """The process dies: the store lets go without flushing (unless `flushed` first), one capsule file
        may be damaged meanwhile (one roll of `damage` in two), and a new engine starts on the same
        disk_dir with its configured weights: its store indexes what was durable at start, setting the
        damaged file aside. (Only one roll in three crashes, so runs also grow long histories.)"""
        if roll:
            return
        FIGURES["operations"] += 1
        if damage == 0 and self.model:  # a durable file to damage (refused, harmlessly, without disk room)
            self._try(self.store.demote, sorted(self.model)[0], "disk")
        if flushed:
            self.store.flush()
        on_disk = {i.name for i in self.store.list() if i.on_disk}
        stray = self.disk / f".{capsule_file_name('default', 'z')}.tmp-{self.dead_pid}@{host_id()}-{'ab' * 8}"
        stray.write_bytes(b"half a capsule")  # a writer killed mid-write
        self.store.close(flush=False)
        files = {p.name: p for p in list_capsule_files(self.disk)}
        durable = sorted(n for n in on_disk if capsule_file_name("default", n) in files)  # written in full
        damaged = durable[0] if damage == 0 and durable else None
        if damaged is not None:
            path = files[capsule_file_name("default", damaged)]
            raw = bytearray(path.read_bytes())
            raw[-1] ^= 0x10  # one flipped bit in its last tensor's bytes
            path.write_bytes(bytes(raw))
        for s in self.sessions:
            s.closed = True  # its engine is gone
        self.sessions = []
        self.engine = self._engine()
        assert not stray.exists()
        back = {i.name for i in self.store.list()}
        assert self.store.reindexed == len(back)
        want = on_disk - {damaged}
        assert back <= want and (not flushed or back == want), (back, want)
        quarantined = [Path(q.path).name for q in self.store.quarantined]
        assert quarantined == ([capsule_file_name("default", damaged)] if damaged else []), quarantined
        ok, n = self._try(self.store.load, self.disk)  # everything there is indexed already
        assert ok and n == 0
        self.model = {name: self.model[name] for name in back}
        self.pinned = set()
        self.running = "configured"  # the new process runs its configured weights, version 0
        self.dropped = self.store.stats()["dropped"]
        FIGURES["crashes_survived"] += 1
        FIGURES["crashes_with_disk_capsules"] += bool(durable)
        FIGURES["damaged_files_set_aside"] += bool(damaged)

    @rule(which=st.sampled_from(WEIGHT_SETS), named=st.booleans(), damage=st.integers(0, 1))
    def restart_and_update(self, which, named, damage):
        """An RL job restarting from a checkpoint: the process dies after its writes are durable, and the
        new one takes weights at once, often other ones under the version number the old capsules carry."""
        self.crash(True, 0, 1 + damage)  # flushed, never skipped, not damaged
        self.update_weights(0, which, named)

    # -- invariants -------------------------------------------------------------------------------------------
    @invariant()
    def listing_is_the_model_minus_counted_drops(self):
        listed = {i.name: i for i in self.store.list()}
        assert set(listed) <= set(self.model), f"unknown capsules listed: {set(listed) - set(self.model)}"
        gone = set(self.model) - set(listed)
        assert not gone & self.pinned, f"pinned capsules lost: {gone & self.pinned}"
        dropped = self.store.stats()["dropped"]
        assert dropped - self.dropped == len(gone), f"{len(gone)} capsules gone, {dropped - self.dropped} drops counted"
        for name in gone:
            del self.model[name]
        FIGURES["dropped_under_budget"] += len(gone)
        self.dropped = dropped
        assert {n for n, i in listed.items() if i.pinned} == self.pinned
        self._check_files(exact=False)


def test_stateful_fuzz_of_engine_and_store_verbs(default_model_dir):
    CapsuleMachine.model_dir = default_model_dir
    CapsuleMachine.dead_pid = dead_pid()
    before = Counter(FIGURES)
    run_state_machine_as_test(CapsuleMachine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, database=None, print_blob=True,
        # the same histories on every run, so the suite's verdict is the code's: random histories exercised
        # no crash at all once in a while (one roll in three of a rule crashes), which says nothing of the code
        derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    got = {k: FIGURES[k] - before[k] for k in FIGURES}
    got.update(losses=0, runs=EXAMPLES, steps_per_run=STEPS)  # a loss fails the run above
    print(f"\nstateful fuzz: {json.dumps(got, sort_keys=True)}")
    if os.environ.get("CAPSULERT_FUZZ_REPORT"):
        Path(os.environ["CAPSULERT_FUZZ_REPORT"]).write_text(json.dumps(got, indent=2, sort_keys=True))
    assert got["operations"] > EXAMPLES * STEPS // 2 and got["crashes_survived"] > 0
