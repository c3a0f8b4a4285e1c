"""Stateful property test of the exactness contract (hypothesis RuleBasedStateMachine).

Interleaves open, append, generate with random partners, snapshot, restore, fork, rollback and demotion to
disk. After every step each touched session is checked bitwise against an independent replay of its own
history on a second engine, alone: after an append, a cold prefill of its tokens; after a decode, the same
appends and generates run solo. A session restored from a capsule inherits the capsule's history.
"""
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from capsulert.protocol.sampling import SamplingParams

MAX_SEQ = 1024
SLOTS = 6


class ExactnessMachine(RuleBasedStateMachine):
    engine = None  # set by the test: (engine under test, replay engine, corpus)
    replay_engine = None
    corpus: list[int] = []

    def __init__(self):
        super().__init__()
        for s in list(self.engine.table.sessions()):
            s.close()
        for info in self.engine.store.list():
            self.engine.store.delete(info.name, info.namespace)
        self.sessions = []  # [session, history]; history = list of ("append", tokens) / ("generate", n, params)
        self.capsules = {}  # name -> history
        self.counter = 0

    # ------------------------------------------------------------------ helpers
    def _replay(self, history):
        s = self.replay_engine.open()
        try:
            for op in history:
                if op[0] == "append":
                    s.append(op[1])
                else:
                    s.generate(op[1], op[2])
            return list(s.tokens), s.logits()
        finally:
            s.close()

    def _check(self, session, history, cold: bool):
        tokens, logits = self._replay([("append", list(session.tokens))] if cold else history)
        assert session.tokens == tokens
        assert torch.equal(session.logits(), logits)

    def _room(self, session, n):
        return len(session.tokens) + n <= MAX_SEQ - 8

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: len(self.sessions) < SLOTS - 1)
    @rule(start=st.integers(0, 3000), n=st.integers(1, 200))
    def open_and_append(self, start, n):
        s = self.engine.open()
        toks = self.corpus[start:start + n]
        s.append(toks)
        self.sessions.append([s, [("append", toks)]])
        self._check(s, None, cold=True)

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, 10), start=st.integers(0, 3000), n=st.integers(1, 150))
    def append(self, i, start, n):
        s, hist = self.sessions[i % len(self.sessions)]
        toks = self.corpus[start:start + n]
        if not self._room(s, n):
            return
        s.append(toks)
        hist.append(("append", toks))
        self._check(s, hist, cold=True)

    @precondition(lambda self: self.sessions)
    @rule(picks=st.lists(st.integers(0, 10), min_size=1, max_size=4, unique=True), n=st.integers(1, 70),
          seeds=st.lists(st.one_of(st.none(), st.integers(0, 2**40)), min_size=4, max_size=4))
    def generate(self, picks, n, seeds):
        chosen = {p % len(self.sessions) for p in picks}
        group = [self.sessions[i] for i in sorted(chosen) if self._room(self.sessions[i][0], n)]
        if not group:
            return
        params = [None if seed is None else SamplingParams(temperature=0.9, top_p=0.9, seed=seed)
                  for seed in seeds[:len(group)]]
        self.engine.generate([s for s, _ in group], n, params)
        for (s, hist), p in zip(group, params):
            hist.append(("generate", n, p))
            self._check(s, hist, cold=False)

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, 10), to_disk=st.booleans())
    def snapshot(self, i, to_disk):
        s, hist = self.sessions[i % len(self.sessions)]
        name = f"c{self.counter}"
        self.counter += 1
        s.snapshot(name)
        if to_disk:
            self.engine.store.demote(name, "disk")
        self.capsules[name] = list(hist)

    @precondition(lambda self: self.capsules and len(self.sessions) < SLOTS - 2)
    @rule(k=st.integers(0, 100), n=st.integers(1, 2))
    def restore_or_fork(self, k, n):
        name = sorted(self.capsules)[k % len(self.capsules)]
        new = [self.engine.restore(name)] if n == 1 else self.engine.fork(name, n)
        for s in new:
            self.sessions.append([s, list(self.capsules[name])])
            self._check(s, self.capsules[name], cold=False)

    @precondition(lambda self: self.capsules and self.sessions)
    @rule(i=st.integers(0, 10), k=st.integers(0, 100))
    def rollback(self, i, k):
        entry = self.sessions[i % len(self.sessions)]
        name = sorted(self.capsules)[k % len(self.capsules)]
        entry[0].restore(name)
        entry[1] = list(self.capsules[name])
        self._check(entry[0], entry[1], cold=False)

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, 10))
    def close(self, i):
        s, _ = self.sessions.pop(i % len(self.sessions))
        s.close()

    steps_run = 0

    @invariant()
    def count(self):
        type(self).steps_run += 1


@pytest.mark.slow
def test_exactness_state_machine(make_engine, tmp_path):
    engine = make_engine(slots=SLOTS, max_seq=MAX_SEQ, disk_dir=str(tmp_path / "disk"))
    replay = make_engine(slots=1, max_seq=MAX_SEQ)
    from capsulert.engine.default_model import CORPUS_PATH

    ExactnessMachine.engine = engine
    ExactnessMachine.replay_engine = replay
    ExactnessMachine.corpus = engine.tokenize(CORPUS_PATH.read_text()[:20000])
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(ExactnessMachine, settings=settings(
        max_examples=6, stateful_step_count=14, deadline=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))
    assert ExactnessMachine.steps_run > 30  # the machine really ran steps
