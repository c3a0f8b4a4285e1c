"""update_weights through the orchestrator: every worker takes the new weights in place, capsules made
before are refused as stale until rebuilt, and results equal an in-process engine with the new weights."""
import pytest
import torch
from safetensors.torch import load_file

from capsulert.errors import StaleCapsuleError, WeightUpdateError
from capsulert.protocol.sampling import SamplingParams
from tests.orchestrator.processes import kill_and_wait

pytestmark = pytest.mark.asyncio(loop_scope="session")
PROMPT = "The policy reads the board and chooses a move. "
NOEOS = SamplingParams(ignore_eos=True)


async def test_update_weights_on_every_worker_and_rebuild(orch, engine_cfg, default_model_dir):
    from capsulert.engine.engine import Engine

    fresh = Engine.from_config(engine_cfg)  # its own engine: the shared oracle keeps the original weights
    s = await orch.open(PROMPT)
    await s.snapshot("c0", pin=True)
    await s.snapshot("c1")
    await s.close()
    weights = load_file(str(default_model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    new = {k: v + 0.05 * v.abs().mean() * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    with pytest.raises(WeightUpdateError):  # refused on the worker, nothing changed
        await orch.update_weights({k: v for k, v in new.items() if "layers.0." not in k})
    assert await orch.update_weights(new, rebuild_pinned=True) == [1] * len(orch.workers)
    with pytest.raises(StaleCapsuleError):
        await orch.restore("c1")
    await orch.rebuild("c1")
    fresh.update_weights(new)
    for name in ("c0", "c1"):  # c0 was rebuilt with the update, c1 on demand
        r = await orch.restore(name)
        got = await r.generate(8, NOEOS)
        ref = fresh.open()
        ref.append(PROMPT)
        assert got == ref.generate(8, NOEOS) and got.weights_version == 1
        await r.close()


async def test_a_restarted_worker_takes_the_last_update_again(orch, engine_cfg, default_model_dir):
    from capsulert.engine.engine import Engine
    from capsulert.protocol.requests import Close, Generate, Open

    async def generate_on_worker0():
        info = await orch.call(0, Open(PROMPT))
        try:
            return await orch.call(0, Generate(info.session, 6, NOEOS))
        finally:
            await orch.call(0, Close(info.session))

    weights = load_file(str(default_model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(11)
    new = {k: v + 0.05 * v.abs().mean() * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    before = (await orch.health())[0]
    versions = await orch.update_weights(new)
    assert versions == [before["weights_version"] + 1] * len(orch.workers)
    want = await generate_on_worker0()

    await kill_and_wait(before["pid"])  # Ray starts a new process with the configured weights
    got = await generate_on_worker0()  # waits for the restart
    after = (await orch.health())[0]
    assert after["pid"] != before["pid"] and after["weights_version"] == versions[0]
    assert got == want and got.logprobs == want.logprobs and got.weights_version == versions[0]
    fresh = Engine.from_config(engine_cfg)  # the update's weights, not the configured ones
    fresh.update_weights(new)
    ref = fresh.open()
    ref.append(PROMPT)
    assert got == ref.generate(6, NOEOS)


async def test_a_version_must_move_forward(engine_cfg):
    from capsulert.engine.engine import Engine

    eng = Engine.from_config(engine_cfg)
    weights = {k: v.clone() for k, v in eng.model_weights.items()}
    assert eng.update_weights(weights, version=3) == 3 and eng.fingerprint.endswith("3")
    for bad in (3, 2, "4", True):
        with pytest.raises(WeightUpdateError, match="version"):
            eng.update_weights(weights, version=bad)
    assert eng.weights_version == 3


async def test_a_remote_session_open_across_an_update_is_refused_until_rederived(orch, engine_cfg, default_model_dir):
    """Issue 29 item 2 through the orchestrator: the typed refusal crosses Ray, and rederive runs as a
    session request on the worker, bitwise a cold prefill under the new weights."""
    from capsulert.errors import StaleSessionError
    from capsulert.engine.engine import Engine

    s = await orch.open(PROMPT)
    await s.generate(6, NOEOS)
    weights = load_file(str(default_model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(21)
    new = {k: v + 0.05 * v.abs().mean() * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    [version] = await orch.update_weights(new)
    with pytest.raises(StaleSessionError):
        await s.generate(4, NOEOS)
    with pytest.raises(StaleSessionError):
        await s.snapshot("mixed")
    assert [c["name"] for c in await orch.capsules() if c["name"] == "mixed"] == []
    tokens = await s.tokens()
    assert await s.rederive() == len(tokens)
    got = await s.generate(8, NOEOS)
    await s.close()
    fresh = Engine.from_config(engine_cfg)
    fresh.update_weights(new)
    ref = fresh.open()
    ref.append(tokens)
    assert got == ref.generate(8, NOEOS) and got.weights_version == version
