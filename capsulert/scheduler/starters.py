"""The step scheduler's starters: the session half of the worker's dispatch (worker/core.py has the whole table).

STARTERS maps each session request type the scheduler runs to its starter, the one function that runs the
request's immediate part on the loop thread (between decode steps): it answers at once (a capsule copy, a
close) and returns False, or queues the job's typed phases (jobs.py: Prefill, Decode) and returns True.
A simple session verb (protocol.requests.SessionVerb, which applies itself to its session) has no entry:
`starter` gives every one of them the same starter, which applies it and replies the session's SessionInfo.
So adding one needs no code here, nor anywhere in worker/.
"""
from __future__ import annotations

import time
from typing import Callable

from capsulert.engine.engine import Engine
from capsulert.errors import InvalidRequestError
from capsulert.protocol.requests import (
    Append, Close, Delete, Fork, Generate, Open, Rederive, Request, Restore, SessionVerb, Snapshot, Turn)
from capsulert.protocol.results import SessionInfo
from capsulert.scheduler.jobs import Decode, Job, Prefill
from capsulert.scheduler.session_ids import SessionIds

Starter = Callable[[Engine, SessionIds, Job, Request], bool]
# the request types that make new sessions when they name none: they need free slots to start
MAKES_SESSIONS = frozenset({Open, Fork, Restore, Turn})


def takes_slots(r: Request) -> bool:
    """Whether the request needs free slots to start: it makes new sessions (an Open, a Fork, or a Restore /
    Turn that names no session to work on)."""
    return type(r) in MAKES_SESSIONS and r.target is None


def open_session(eng: Engine, sessions: SessionIds, job: Job, r: Open) -> bool:
    job.session, job.opened = sessions.adopt(eng.open(wait_s=0, namespace=r.namespace)), True
    if r.prompt is not None:
        job.steps.append(Prefill(r.prompt))
    return True


def append(eng: Engine, sessions: SessionIds, job: Job, r: Append) -> bool:
    job.steps.append(Prefill(r.tokens))
    job.want_logits = r.logits
    return True


def rederive(eng: Engine, sessions: SessionIds, job: Job, r: Rederive) -> bool:
    job.undo = list(sessions.get(r.session).tokens)  # an update landing mid-way gives it back all of them
    tokens = eng.begin_rederive(sessions.get(r.session))
    if tokens:
        job.steps.append(Prefill(tokens))
    return True


def generate(eng: Engine, sessions: SessionIds, job: Job, r: Generate) -> bool:
    job.steps.append(Decode(r.max_new_tokens, r.sampling))
    return True


def turn(eng: Engine, sessions: SessionIds, job: Job, r: Turn) -> bool:
    if r.restore is not None:
        restore_into_job(eng, sessions, job, r.restore, r.namespace)
    elif job.session is None:  # neither a session nor a capsule: a new session of its own
        job.session, job.opened = sessions.adopt(eng.open(namespace=r.namespace, wait_s=0)), True
    eng.prefix.claim(sessions.get(job.session), r.namespace)  # its prompts are that namespace's
    if r.suffix is not None:
        job.steps.append(Prefill(r.suffix))
    job.steps.append(Decode(r.max_new_tokens, r.sampling))
    job.close_after = r.close
    return True


def snapshot(eng: Engine, sessions: SessionIds, job: Job, r: Snapshot) -> bool:
    s = sessions.get(r.session)
    job.sink.done(eng.snapshot(s, r.name, tier=r.tier, pin=r.pin, mode=r.mode, namespace=r.namespace))
    return False


def restore(eng: Engine, sessions: SessionIds, job: Job, r: Restore) -> bool:
    restore_into_job(eng, sessions, job, r.name, r.namespace)
    job.sink.done(SessionInfo(job.session, len(sessions.get(job.session).tokens), restored_from=job.restored_from))
    return False


def fork(eng: Engine, sessions: SessionIds, job: Job, r: Fork) -> bool:
    restored = eng.restore_sessions(r.name, r.n, r.namespace, wait_s=0)
    job.sink.done([SessionInfo(sessions.adopt(s), len(s.tokens), restored_from=restored.tier)
                   for s in restored.sessions])
    return False


def delete(eng: Engine, sessions: SessionIds, job: Job, r: Delete) -> bool:
    eng.store.delete(r.name, r.namespace)
    job.sink.done(None)
    return False


def close(eng: Engine, sessions: SessionIds, job: Job, r: Close) -> bool:
    s = sessions.pop(r.session)
    if s is not None:
        s.close()
    job.sink.done(None)
    return False


def session_verb(eng: Engine, sessions: SessionIds, job: Job, r: SessionVerb) -> bool:
    """A simple session verb: the request applies itself to its session."""
    s = sessions.get(r.session)
    r.apply(eng, s)
    job.sink.done(SessionInfo(r.session, len(s.tokens)))
    return False


def restore_into_job(eng: Engine, sessions: SessionIds, job: Job, name: str, namespace: str) -> None:
    """Restore capsule `name` into the job's session in place, or into a new one when it has none; the
    tier it was read from and the time it took go to the job's reply (restored already when the step restored
    it with the others: restore_batch.py)."""
    if job.restored is not None:
        session, job.restored_from, job.restore_s = job.restored
        if job.session is None:
            job.session = sessions.adopt(session)
        return
    t0 = time.perf_counter()
    if job.session is None:
        restored = eng.restore_sessions(name, 1, namespace, wait_s=0)
        job.session = sessions.adopt(restored.sessions[0])
        job.restored_from = restored.tier
    else:
        job.restored_from = eng.restore_into(sessions.get(job.session), name, namespace)
    job.restore_s = time.perf_counter() - t0


#: one starter per session request type the scheduler runs (simple verbs excepted: see `starter`)
STARTERS: dict[type, Starter] = {
    Open: open_session, Append: append, Rederive: rederive, Generate: generate, Turn: turn, Snapshot: snapshot,
    Restore: restore, Fork: fork, Delete: delete, Close: close,
}


def starter(request_type: type) -> Starter:
    """The starter of a session request type: its entry of STARTERS, or, for a simple session verb, the one
    starter of them all; InvalidRequestError for any other type."""
    start = STARTERS.get(request_type)
    if start is None and issubclass(request_type, SessionVerb) and request_type is not SessionVerb:
        start = session_verb
    if start is None:
        raise InvalidRequestError(f"the step scheduler does not run {request_type.__name__} requests")
    return start
