"""Weight identities through the orchestrator. A fresh orchestrator on the same disk_dir used to reload a
pinned capsule made under update 1 of the previous one and serve it as its own update 1 (other weights,
other greedy tokens): the version counter restarts at 0 in every process. Now every update has an identity
the orchestrator names, and capsules of other weights are refused as stale."""
import pytest
import torch
from safetensors.torch import load_file

from capsulert.errors import StaleCapsuleError
from capsulert.orchestrator import Orchestrator
from capsulert.protocol.sampling import SamplingParams
from tests.orchestrator.processes import kill_and_wait

pytestmark = pytest.mark.asyncio(loop_scope="session")
PROMPT = "An RL job restarts from its checkpoint and must not serve old state as new. "
NOEOS = SamplingParams(ignore_eos=True)


def nudged(default_model_dir, seed):
    weights = load_file(str(default_model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * v.abs().mean() * torch.randn(v.shape, generator=g) for k, v in weights.items()}


def config(engine_cfg, disk):
    return dict(engine={**engine_cfg, "disk_dir": str(disk)}, call_timeout_s=60, max_restarts=3, torch_threads=1)


async def test_a_fresh_orchestrator_refuses_capsules_of_the_previous_ones_weights(ray_session, engine_cfg,
                                                                                   default_model_dir, tmp_path):
    async with await Orchestrator.start(config(engine_cfg, tmp_path)) as first:
        [v1] = await first.update_weights(nudged(default_model_dir, 1))
        s = await first.open(PROMPT)
        await s.snapshot("pinned", pin=True)
        await s.snapshot("on-disk", tier="disk")
        await s.close()
        before = (await first.health())[0]
        await kill_and_wait(before["pid"])  # a restarted worker takes the same weights, identity included
        after = (await first.health())[0]
        assert after["weights_identity"] == before["weights_identity"] != ""
        r = await first.restore("pinned")  # still current there
        await r.close()

    async with await Orchestrator.start(config(engine_cfg, tmp_path)) as second:
        assert {c["name"] for c in await second.capsules()} == {"pinned", "on-disk"}
        assert await second.update_weights(nudged(default_model_dir, 2)) == [v1]  # the same counter
        for name in ("pinned", "on-disk"):
            with pytest.raises(StaleCapsuleError, match="other weights"):
                await second.restore(name)
