"""The orchestrator records an update once a worker applied it. A call that failed after the worker swapped
its weights (rebuild_pinned's pinned files written again, say) used to leave the update unrecorded, so a
worker Ray restarted came back with older weights than its peers; a worker that refused it stayed behind.
broadcast_update on a pool of scripted workers (no Ray: what is tested is the bookkeeping)."""
import asyncio

import pytest

from capsulert.errors import NoFreeSlotError
from capsulert.orchestrator.weight_updates import broadcast_update
from capsulert.protocol.requests import Ping, UpdateWeights


class ScriptedPool:
    """Workers that apply an update and then fail ("swap-then-fail"), refuse it ("refuse"), or apply it."""

    def __init__(self, behaviours):
        self.behaviours = behaviours
        self.state = [(0, "") for _ in behaviours]  # (version, identity) per worker
        self.weights = None
        self.stale: list[int] = []

    def alive(self):
        return list(range(len(self.behaviours)))

    def mark_stale(self, w):
        self.stale.append(w)

    async def call(self, w, request):
        await asyncio.sleep(0)
        if isinstance(request, Ping):
            version, identity = self.state[w]
            return {"weights_version": version, "weights_identity": identity}
        assert isinstance(request, UpdateWeights) and request.identity
        if self.behaviours[w] == "refuse":
            raise NoFreeSlotError("every slot is held; the weights are unchanged")
        self.state[w] = (self.state[w][0] + 1, request.identity)
        if self.behaviours[w] == "swap-then-fail":
            raise OSError("cannot write the pinned file again")
        return self.state[w][0]


async def test_an_update_a_worker_applied_before_its_call_failed_is_recorded():
    pool = ScriptedPool(["swap-then-fail"])
    with pytest.raises(OSError):
        await broadcast_update(pool, "/ckpt", rebuild_pinned=True)
    assert pool.weights is not None and pool.weights.identity == pool.state[0][1] and pool.weights.version == 1


async def test_a_worker_that_refused_catches_up_with_its_peers():
    pool = ScriptedPool(["apply", "refuse"])
    with pytest.raises(NoFreeSlotError):
        await broadcast_update(pool, "/ckpt", rebuild_pinned=True)
    assert pool.weights.identity == pool.state[0][1] and pool.stale == [1]


async def test_an_update_no_worker_applied_is_not_recorded_and_every_update_has_its_own_identity():
    pool = ScriptedPool(["refuse", "refuse"])
    with pytest.raises(NoFreeSlotError):
        await broadcast_update(pool, "/ckpt", rebuild_pinned=False)
    assert pool.weights is None and pool.stale == []
    ok = ScriptedPool(["apply", "apply"])
    assert await broadcast_update(ok, "/a", False) == [1, 1]
    first = ok.weights.identity
    assert ok.state[0][1] == ok.state[1][1] == first  # the same weights, the same name on every worker
    assert await broadcast_update(ok, "/a", False) == [2, 2]
    assert ok.weights.identity != first and ok.weights == UpdateWeights("/a", version=2, identity=ok.weights.identity)

