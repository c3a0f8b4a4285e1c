"""Stateful fuzz (hypothesis RuleBasedStateMachine) over the engine's capsule verbs and the store's verbs.

One engine on the default model with a disk_dir; the rules open, append, snapshot, restore, restore in
place, fork and close sessions, and delete, pin, unpin, promote, demote, prefetch, set budgets (random, a
few capsules wide, so the gpu -> host -> disk -> dropped cascade and its background disk writes run),
flush, save, load and crash. A crash closes the store without flushing (its background writes are
cancelled, as a dead process's would be), leaves a temp file of a dead writer behind, starts a new
engine on the same disk_dir and re-indexes what is there with load(disk_dir).

Invariants, after every step:
- no untyped exception: a rule may be refused only with a capsulert error, and a refusal changes
  nothing (listing, stats, free slots);
- no acknowledged capsule is lost: the listing is the model minus capsules dropped under budget
  pressure, each drop is counted in stats()["dropped"], and a pinned capsule is never dropped; across a
  crash, every capsule that was durable on disk comes back, and a save directory always loads to exactly
  what was saved;
- listing == files on disk == what restores: every capsule file is a disk-tier capsule, after a flush the
  disk tier is exactly the files, and every restore (and every capsule's bytes) equals, bitwise, what was
  snapshotted.

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
from capsulert.capsule_store.disk import list_capsule_files
from capsulert.capsule_store.owner import host_id
from capsulert.errors import CapsuleRTError
from capsulert.worker.engine import Engine

EXAMPLES = int(os.environ.get("CAPSULERT_FUZZ_EXAMPLES", "20"))
STEPS = int(os.environ.get("CAPSULERT_FUZZ_STEPS", "50"))
NAMES = ["a", "b", "c", "d", "e", "f"]
TIERS = ["gpu", "host", "disk"]
FIGURES: Counter = Counter()
PICK = st.integers(0, 99)  # mostly an existing capsule, sometimes any name (unknown ones are refused)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@dataclass(frozen=True)
class Expect:
    """What a capsule must restore to: its tokens, the next-token logits and its tensors' checksum."""

    tokens: tuple[int, ...]
    logits: torch.Tensor
    checksum: str


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
        return Expect(tuple(session.tokens), session.logits().clone(), checksum)

    def _check_restore(self, name: str) -> None:
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
        disk_tier = {capsule_file_name(i.namespace, i.name) for i in self.store.list() if i.tier == "disk"}
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
        if ok:
            exp = self.model[name]
            assert tuple(s.tokens) == exp.tokens and torch.equal(s.logits(), exp.logits)

    @rule(pick=PICK, n=st.integers(1, 3))
    def fork(self, pick, n):
        name = self._pick(pick)
        ok, branches = self._try(self.engine.fork, name, n)
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

    @rule()
    def load_own_disk_dir(self):
        ok, n = self._try(self.store.load, self.disk)  # refused (ConfigError) while the disk budget is 0
        assert not ok or n == 0, "the live store's own files are all indexed already"

    @rule(flushed=st.booleans(), roll=st.integers(0, 2))
    def crash(self, flushed, roll):
        """The process dies: the store lets go without flushing (unless `flushed` first) and a new
        engine starts on the same disk_dir; load(disk_dir) brings back what was durable. (Only one
        roll in three crashes, so runs also grow long histories.)"""
        if roll:
            return
        FIGURES["operations"] += 1
        if flushed:
            self.store.flush()
        on_disk = {i.name for i in self.store.list() if i.tier == "disk"}
        stray = self.disk / f".{capsule_file_name('default', 'z')}.tmp-{self.dead_pid}@{host_id()}-{'ab' * 8}"
        stray.write_bytes(b"half a capsule")  # a writer killed mid-write
        self.store.close(flush=False)
        for s in self.sessions:
            s.closed = True  # its engine is gone
        self.sessions = []
        self.engine = self._engine()
        ok, n = self._try(self.store.load, self.disk)
        assert ok and not stray.exists()
        back = {i.name for i in self.store.list()}
        assert back <= on_disk and (not flushed or back == on_disk), (back, on_disk)
        self.model = {name: self.model[name] for name in back}
        self.pinned = set()
        self.dropped = self.store.stats()["dropped"]
        FIGURES["crashes_survived"] += 1

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
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    got = {k: FIGURES[k] - before[k] for k in FIGURES}
    got.update(losses=0, runs=EXAMPLES, steps_per_run=STEPS)  # a loss fails the run above
    print(f"\nstateful fuzz: {json.dumps(got, sort_keys=True)}")
    if os.environ.get("CAPSULERT_FUZZ_REPORT"):
        Path(os.environ["CAPSULERT_FUZZ_REPORT"]).write_text(json.dumps(got, indent=2, sort_keys=True))
    assert got["operations"] > EXAMPLES * STEPS // 2 and got["crashes_survived"] > 0
