"""Bad input at the API edge: typed capsulert errors, and nothing changed (sessions, slots, capsules)."""
import pytest

from capsulert.errors import (ConfigError, DuplicateCapsuleError, InvalidCapsuleNameError, InvalidRequestError,
                              InvalidTokenError, SessionClosedError, UnknownCapsuleError)
from capsulert.orchestrator import EpisodeDriver, Orchestrator, best_of_n, tree_search

pytestmark = pytest.mark.asyncio(loop_scope="session")
PROMPT = "Typed refusals leave the runtime exactly as it was. "


async def _state(orch, s):
    # every figure of the workers' stats except the step loop's busy seconds: refused requests take time too
    stats = [{k: v for k, v in w.items() if k != "loop_busy_s"} for w in await orch.stats()]
    return await s.tokens(), stats, await orch.capsules()


async def test_bad_input_is_refused_with_typed_errors_and_changes_nothing(orch):
    s = await orch.open(PROMPT)
    await s.snapshot("edge-c0", pin=True)
    before = await _state(orch, s)
    bad = [
        (UnknownCapsuleError, orch.restore("no-such-capsule")),
        (UnknownCapsuleError, orch.fork("no-such-capsule", 2)),
        (UnknownCapsuleError, s.restore("no-such-capsule")),
        (UnknownCapsuleError, orch.restore_append_generate("no-such-capsule", " x", 2)),
        (UnknownCapsuleError, best_of_n(orch, "no-such-capsule", " x", 2, 2)),
        (UnknownCapsuleError, orch.delete("no-such-capsule")),
        (InvalidRequestError, orch.fork("edge-c0", 0)),
        (InvalidRequestError, orch.fork("edge-c0", "2")),
        (InvalidRequestError, orch.fork("edge-c0", True)),
        (InvalidRequestError, best_of_n(orch, "edge-c0", " x", 0, 2)),
        (InvalidRequestError, tree_search(orch, "edge-c0", lambda n: [" a"], lambda n: 0, width=0, depth=1)),
        (InvalidRequestError, s.generate(-1)),
        (InvalidRequestError, s.generate(2.5)),
        (InvalidRequestError, s.append_generate(" x", -3)),
        (InvalidRequestError, orch.restore_append_generate("edge-c0", " x", -1)),
        (InvalidRequestError, s.generate(2, {"temperature": -1.0})),
        (InvalidRequestError, s.generate(2, {"temprature": 1.0})),
        (InvalidTokenError, s.append(3.5)),
        (InvalidTokenError, s.append(None)),  # issue 15 items 4 and 5: not token sequences,
        (InvalidTokenError, s.append(5)),
        (InvalidTokenError, s.append(object())),
        (InvalidTokenError, s.append(b"hello")),
        (InvalidTokenError, s.append({1: 2, 3: 4})),  # a dict's keys ...
        (InvalidTokenError, s.append({5, 6, 7})),  # ... and a set's arbitrary order were taken
        (InvalidTokenError, s.append("\ud800")),  # a lone surrogate: a RayTaskError(TypeError) before
        (InvalidTokenError, s.append_generate("ok \udfff", 2)),
        (InvalidTokenError, orch.open("\ud800")),
        (InvalidTokenError, orch.restore_append_generate("edge-c0", {1, 2}, 2)),
        (InvalidTokenError, s.append([1, "a"])),
        (InvalidTokenError, s.append([])),
        (InvalidTokenError, s.append("")),
        (InvalidTokenError, s.append([10**9])),  # out of the vocabulary: refused by the engine
        (InvalidTokenError, s.append_generate([-1], 2)),
        (InvalidCapsuleNameError, s.snapshot(123)),
        (InvalidCapsuleNameError, s.snapshot("a/b")),
        (InvalidCapsuleNameError, orch.restore("../etc")),
        (ConfigError, s.snapshot("edge-c1", tier="tape")),
        (InvalidRequestError, s.snapshot("edge-c1", pin="yes")),
        (DuplicateCapsuleError, s.snapshot("edge-c0")),
        (ConfigError, orch.promote("edge-c0", "tape")),
        (ConfigError, orch.migrate("edge-c0", 7)),
        (ConfigError, orch.open(PROMPT, worker=5)),
        (ConfigError, Orchestrator.start(dict(num_workers=0))),
        (ConfigError, Orchestrator.start(dict(engine=dict(slots=-1)))),
    ]
    for err, coro in bad:
        with pytest.raises(err):
            await coro
    with pytest.raises(InvalidRequestError):
        EpisodeDriver(orch, "edge-c0", n_envs=0)
    assert await _state(orch, s) == before
    await s.close()
    with pytest.raises(SessionClosedError):
        await s.generate(1)
    with pytest.raises(SessionClosedError):
        await s.append(" more")
    await orch.delete("edge-c0")
    assert "edge-c0" not in [c["name"] for c in await orch.capsules()]
