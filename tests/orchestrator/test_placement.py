"""Where the router places a capsule it copies for a request (CapsuleRouter.ensure_on), without workers: the
copy itself (migrate) is replaced by a recorder that refuses the tiers a test names."""
import asyncio
from types import SimpleNamespace

import pytest

from capsulert.errors import BudgetExceededError, ConfigError, UnknownCapsuleError
from capsulert.orchestrator.router import CapsuleRouter


def router(refuse: dict):
    """A router whose capsule 'c' lives on worker 0; migrate records (worker, tier) and raises refuse[tier]."""
    r = CapsuleRouter(pool=None, space=SimpleNamespace(where={"c": {0}}), ns="default")
    calls = []

    async def migrate(name, worker, *, tier="device", **kw):
        calls.append((worker, tier))
        if tier in refuse:
            raise refuse[tier]
        r.space.where[name].add(worker)

    r.migrate = migrate
    return r, calls


def full(tier):
    return BudgetExceededError(f"tier {tier!r} cannot hold 4115136 bytes within its budget of 3000000")


def test_a_copy_for_a_restore_goes_a_tier_down_when_capsules_in_use_fill_the_device_tier():
    r, calls = router({"device": full("device")})
    asyncio.run(r.ensure_on("c", 1))
    assert calls == [(1, "device"), (1, "host")] and r.holders("c") == {0, 1}


def test_disabled_tiers_below_are_skipped_and_the_device_tiers_refusal_is_what_the_caller_gets():
    r, calls = router({"device": full("device"), "host": ConfigError("tier 'host' is disabled: its budget is 0"),
                       "disk": full("disk")})
    with pytest.raises(BudgetExceededError, match="'device'"):
        asyncio.run(r.ensure_on("c", 1))
    assert calls == [(1, "device"), (1, "host"), (1, "disk")] and r.holders("c") == {0}


def test_a_holder_or_another_refusal_moves_nothing_more():
    r, calls = router({})
    asyncio.run(r.ensure_on("c", 0))  # already there
    assert calls == []
    r, calls = router({"device": ConfigError("tier 'device' is disabled: its budget is 0")})
    with pytest.raises(ConfigError):
        asyncio.run(r.ensure_on("c", 1))
    assert calls == [(1, "device")]
    r, calls = router({"device": UnknownCapsuleError("no capsule 'c'")})
    with pytest.raises(UnknownCapsuleError):
        asyncio.run(r.ensure_on("c", 1))
    assert calls == [(1, "device")]
