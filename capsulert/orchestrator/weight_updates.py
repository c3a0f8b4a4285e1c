"""An update_weights broadcast to every worker, and the record of it a restarted worker is given again.

The orchestrator names each update with an identity of its own (the same on every worker, so their capsules
are each other's; a new one per update, so capsules of any earlier weights, this orchestrator's or an
earlier one's on the same disk_dir, are stale). It records the update as soon as one worker applied it, even
when the call failed after the weights were swapped (a pinned file that could not be written again): a
worker Ray restarts, or one whose call failed before it applied the update, then gets it on its next call,
so no worker serves older weights than its peers.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

from capsulert.protocol.requests import Ping, UpdateWeights

log = logging.getLogger(__name__)


async def broadcast_update(pool, payload: Any, rebuild_pinned: bool) -> list[int]:
    """Send the update to every live worker of `pool` (a WorkerPool); each one's new weights version. The
    first worker's error is raised after the update is recorded wherever one worker applied it."""
    identity = "orc-" + secrets.token_hex(12)
    workers = pool.alive()
    outcomes = await asyncio.gather(
        *(pool.call(w, UpdateWeights(payload, rebuild_pinned, identity=identity)) for w in workers),
        return_exceptions=True)
    applied = {w: v for w, v in zip(workers, outcomes) if not isinstance(v, BaseException)}
    failed = {w: e for w, e in zip(workers, outcomes) if isinstance(e, BaseException)}
    for w in failed:  # a call that failed may have swapped the weights first: ask the worker
        try:
            pong = await pool.call(w, Ping())
        except Exception as e:  # noqa: BLE001 - gone or restarting: its next call resyncs it anyway
            log.info("worker %d did not answer after its update failed (%s)", w, e)
            continue
        if pong.get("weights_identity") == identity:
            applied[w] = pong["weights_version"]
    if applied:
        pool.weights = UpdateWeights(payload, version=max(applied.values()), identity=identity)
        for w in failed:
            if w not in applied:  # refused it: catch up with its peers before its next call
                pool.mark_stale(w)
    if failed:
        raise next(iter(failed.values()))
    return [applied[w] for w in workers]
