"""One tier name: "device" is the engine device's memory, on CPU and CUDA alike, in every listing, stat and
restore report; "gpu", its older name, is still taken where a caller names a tier, with a DeprecationWarning."""
import pytest

from capsulert.config.engine import EngineConfig, TierBudgets
from capsulert.errors import ConfigError


def test_the_older_name_is_taken_with_a_warning_and_never_reported(make_engine, text):
    eng = make_engine()
    s = eng.open()
    s.append(text[:100])
    with pytest.warns(DeprecationWarning, match="older name of 'device'"):
        ref = s.snapshot("a", tier="gpu")
    assert ref.tier == "device" and eng.store.info("a").tier == "device"
    assert eng.restore("a").restored_from == "device"
    with pytest.warns(DeprecationWarning):
        eng.store.set_budget("gpu", 10**9)
    assert set(eng.store.stats()["blocks"]) == {"device", "host", "disk"}


def test_a_budget_under_the_older_name_is_the_device_tiers():
    with pytest.warns(DeprecationWarning, match="`gpu` is the older name of `device`"):
        budgets = TierBudgets(gpu=5)
    assert budgets.as_dict() == {"device": 5, "host": None, "disk": None}
    with pytest.warns(DeprecationWarning):
        assert EngineConfig(capsule_budgets={"gpu": 7}).capsule_budgets.device == 7
    with pytest.raises(ValueError, match="once"):
        TierBudgets(gpu=1, device=2)
    with pytest.raises(ConfigError):
        from capsulert.protocol.checks import tier_arg
        tier_arg("vram")
