"""truncate(n) on the orchestrator's sessions: the worker rolls the session back to its first n tokens,
bitwise the state a cold prefill of them computes in-process (the same next-token logits and the same greedy
continuation with the same logprobs); a refused n leaves the session unchanged."""
import numpy as np
import pytest

from capsulert.errors import InvalidRequestError
from capsulert.protocol.sampling import SamplingParams

SHORT = "The capsule runtime keeps the complete state of a session at a committed boundary. "
NOEOS = SamplingParams(ignore_eos=True, logprobs=3)
pytestmark = pytest.mark.asyncio(loop_scope="session")


def _same_result(a, b) -> bool:
    return list(a) == list(b) and a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs


async def test_remote_truncate_equals_a_cold_prefill(orch, fresh):
    s = await orch.open(SHORT * 6)
    await s.generate(50, NOEOS)  # 151 prompt tokens: the decoded ones cross grid point 192
    full = await s.tokens()
    probe = fresh.tokenize(" A user asks")
    for n in (len(full) - 3, 170, 130, 64, 5):  # in the decoded tokens, the prompt, on the grid
        assert await s.truncate(n) == n == s.length
        assert await s.tokens() == full[:n]
        got = await s.append(probe, logits=True)  # the state at n, read through an append
        cold = fresh.open(namespace=None)
        want = cold.append(full[:n] + probe).numpy()
        assert np.array_equal(got, want), n
        assert _same_result(await s.generate(8, NOEOS), cold.generate(8, NOEOS))
        cold.close()
        await s.truncate(n)
    await s.close()


async def test_remote_truncate_refusals_leave_the_session_unchanged(orch, fresh):
    s = await orch.open(SHORT)
    length = s.length
    for bad in (length + 1, -1, 1.5):
        with pytest.raises(InvalidRequestError):
            await s.truncate(bad)
    assert await s.truncate(length) == length  # a no-op
    assert s.length == length
    cold = fresh.open(namespace=None)
    cold.append(SHORT)
    assert await s.tokens() == cold.tokens
    assert _same_result(await s.generate(6, NOEOS), cold.generate(6, NOEOS))
    await s.close()
