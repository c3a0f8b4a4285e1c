"""The restores a step's starting requests ask for, done together.

A crowd of agents or RL envs sends many Restores (and Turns that restore) at once; restoring them one
request after another pays each capsule's copies and host work in turn. Before the step's requests start,
the ones that restore a capsule and will start now are restored together (Engine.restore_many for those
that make a new session, Engine.restore_into_many for those restoring into their own): every capsule read
and checked first, its bytes in two grouped copies. Each job then starts as it would have, finding its
capsule restored (starters.restore_into_job).

All or nothing, and never a change of what a request gets: a group that fails (a missing or stale
capsule, too few free slots) is left to the per-request path, which gives each job its own typed error or
slot wait, exactly as before; a batch needs at least two restores of one namespace. New sessions are taken
only for requests ahead of every other slot-taking request (first come, first served, as the per-request
path takes them), so a restored request is never held back behind a slot wait; and no restore is taken
ahead of a request that may change a capsule (a delete, a snapshot), so each reads what it would have.
"""
from __future__ import annotations

import time

from capsulert.engine.engine import Engine
from capsulert.errors import CapsuleRTError
from capsulert.protocol.requests import Append, Close, Generate, Open, Restore, Turn
from capsulert.scheduler.jobs import Job
from capsulert.scheduler.session_ids import SessionIds
from capsulert.scheduler.starters import takes_slots

# requests that change no capsule: restores behind them may run first (a Turn without a restore included)
LEAVE_CAPSULES = (Open, Append, Generate, Close, Turn)


def restore_name(job: Job) -> str | None:
    """The capsule the job's request restores as it starts, if any."""
    r = job.request
    if isinstance(r, Restore):
        return r.name
    if isinstance(r, Turn):
        return r.restore
    return None


def restore_together(eng: Engine, sessions: SessionIds, jobs: list[Job], busy: set[int]) -> int:
    """Restore the capsules of `jobs` (the step's waiting jobs, in arrival order) that start now, grouped by
    namespace and by new-session / in-place; each restored job gets `job.restored`. `busy`: sessions with a
    running request (their jobs wait, so they are left out). The number of batches restored."""
    batches = 0
    groups: dict[tuple[str, bool], list[Job]] = {}
    seen: set[int] = set()
    slots_in_order = True  # new sessions are taken only ahead of every other request that takes slots
    for job in jobs:
        name = restore_name(job)
        target = job.request.target
        if name is None and not isinstance(job.request, LEAVE_CAPSULES):
            break  # it may change a capsule (a delete, a snapshot): the restores after it wait for it
        if name is None or job.restored is not None:
            slots_in_order = slots_in_order and not takes_slots(job.request)
            continue
        if target is None and not slots_in_order:
            continue
        if target is not None and (target in busy or target in seen):
            continue  # an earlier request of its session runs first
        if target is not None:
            seen.add(target)
        groups.setdefault((job.request.namespace, target is None), []).append(job)
    for (namespace, new), group in groups.items():
        if new:  # as many as slots are free, in arrival order: the rest wait on the per-request path
            group = group[:eng.free_slots]
        if len(group) < 2:
            continue
        names = [restore_name(j) for j in group]
        t0 = time.perf_counter()
        try:
            if new:
                targets = eng.restore_many(names, namespace, wait_s=0)
                tiers = [s.restored_from for s in targets]
            else:
                targets = [sessions.get(j.request.target) for j in group]
                tiers = eng.restore_into_many(targets, names, namespace)
        except CapsuleRTError:
            continue  # each request meets its own refusal on its own path
        per_job = (time.perf_counter() - t0) / len(group)
        for job, s, tier in zip(group, targets, tiers):
            job.restored = (s, tier, per_job)
        batches += 1
    return batches

