"""Prefix reuse through the orchestrator: a namespace's open(prompt) is served from that namespace's cached
grid prefixes (bitwise the cold result), and never from another namespace's."""
import pytest
import pytest_asyncio

from capsulert.orchestrator import Orchestrator
from capsulert.protocol.sampling import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="session")
NOEOS = SamplingParams(ignore_eos=True)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def orch_prefix(ray_session, engine_cfg):
    o = await Orchestrator.start(dict(engine={**engine_cfg, "prefix_cache": True}, call_timeout_s=60,
                                      torch_threads=1))
    yield o
    await o.close()


def _hits(stats) -> int:
    return stats[0]["store"]["prefix"]["hits"]


async def test_namespace_open_reuses_its_own_prefixes_only(orch_prefix, oracle, text):
    prompt = oracle.tokenize(text)[:300]  # grid points every 64 tokens
    acme, other = orch_prefix.namespace("acme"), orch_prefix.namespace("other")
    first = await acme.open(prompt)
    cold = await first.generate(6, NOEOS)
    await first.close()  # keeps its grid checkpoints as anonymous prefix entries of "acme"
    hits = _hits(await orch_prefix.stats())
    again = await acme.open(prompt)
    assert _hits(await orch_prefix.stats()) == hits + 1
    assert await again.generate(6, NOEOS) == cold and again.length == 306
    stranger = await other.open(prompt)
    assert _hits(await orch_prefix.stats()) == hits + 1  # another tenant's prefix never serves this one
    assert await stranger.generate(6, NOEOS) == cold
    await again.close()
    await stranger.close()
