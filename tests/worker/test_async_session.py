"""The one session class in-process: the AsyncEngine hands out the orchestrator's session class, so what the
remote path had works here too (interrupt of a running generate, timeouts then wait(), token reads, text),
a session's capsule verbs use the namespace it was opened in, and every request checks its own arguments
when made, with the same typed error on every path."""
import asyncio

import pytest

from capsulert.errors import (ConfigError, InvalidCapsuleNameError, InvalidRequestError, InvalidTokenError,
                              SessionClosedError, UnknownCapsuleError)
from capsulert.protocol.requests import Append, Fork, Generate, Open, Restore, Snapshot, Turn
from capsulert.protocol.sampling import SamplingParams
from capsulert.sessions.local import AsyncEngine
import typing

from capsulert.orchestrator.namespace import Namespace
from capsulert.orchestrator.orchestrator import Orchestrator
from capsulert.sessions.session import AsyncSession

NOEOS = SamplingParams(ignore_eos=True)
PROMPT = "A robot arm moves toward the table when the operator says stop. "
N = 400


def test_the_remote_session_is_the_one_session_class():
    for verb in (Namespace.open, Namespace.restore, Orchestrator.open, Orchestrator.restore):
        assert typing.get_type_hints(verb)["return"] is AsyncSession


async def _started(s, start_len):
    while len(await s.tokens()) <= start_len:  # answered at once, while the decode runs
        await asyncio.sleep(0.002)


async def test_interrupt_and_timeout_in_process(engine):
    async with AsyncEngine(engine) as aeng:
        s = await aeng.open(PROMPT)
        p = s.length
        task = asyncio.create_task(s.generate(N, NOEOS))
        await _started(s, p)
        assert await s.interrupt()
        produced = await task
        assert s.stop_reason == "interrupted" and 1 <= len(produced) < N
        assert (await s.tokens())[p:] == list(produced)
        assert not await s.interrupt()  # nothing running

        q = s.length
        with pytest.raises(TimeoutError):
            await s.generate(N, NOEOS, timeout=0.05)
        res = await s.wait()  # the timed-out generate, interrupted at its next token boundary
        assert res.stop_reason == "interrupted" and len(res) < N
        assert s.length == q + len(res) and (await s.tokens())[q:] == list(res)
        assert await s.text() == engine.detokenize(await s.tokens())
        await s.close()
        with pytest.raises(SessionClosedError):
            await s.generate(2)


async def test_a_session_keeps_its_namespace(engine):
    async with AsyncEngine(engine) as aeng:
        s = await aeng.open(PROMPT, namespace="acme")
        assert s.namespace == "acme"
        ref = await s.snapshot("ns-c")
        assert ref.namespace == "acme"
        with pytest.raises(UnknownCapsuleError):
            await aeng.restore("ns-c")  # "default" has no such capsule
        r = await aeng.restore("ns-c", "acme")
        assert r.namespace == "acme" and await r.restore("ns-c") == "device"
        await asyncio.gather(s.close(), r.close())


@pytest.mark.parametrize("make, error", [
    (lambda: Snapshot(1, "c", tier="nvme"), ConfigError),
    (lambda: Snapshot(1, "c", mode="partial"), InvalidRequestError),
    (lambda: Snapshot(1, "c", pin="yes"), InvalidRequestError),
    (lambda: Snapshot(1, "../etc"), InvalidCapsuleNameError),
    (lambda: Snapshot(1, "c", namespace="a/b"), InvalidCapsuleNameError),
    (lambda: Restore("c", into="7"), InvalidRequestError),
    (lambda: Fork("c", 0), InvalidRequestError),
    (lambda: Generate(1, -1), InvalidRequestError),
    (lambda: Generate(1, 2, {"temperature": -1}), InvalidRequestError),
    (lambda: Append(1, b"bytes"), InvalidTokenError),
    (lambda: Append(1, []), InvalidTokenError),
    (lambda: Append(1, [1, "2"]), InvalidTokenError),
    (lambda: Open([]), InvalidTokenError),
    (lambda: Turn(1, suffix="", max_new_tokens=2), InvalidTokenError),
    (lambda: Turn(1, max_new_tokens=True), InvalidRequestError),
])
def test_requests_check_themselves_when_made(make, error):
    with pytest.raises(error):
        make()


def test_requests_normalise_what_they_accept():
    import torch

    assert Append(1, (1, 2)).tokens == [1, 2] and Append(1, torch.tensor([3, 4])).tokens == [3, 4]
    assert Generate(1, 2, {"temperature": 0.5}).sampling == SamplingParams(temperature=0.5)
    assert Snapshot(1, "c").tier == Snapshot.tier == "device"


async def test_every_in_process_verb_refuses_bad_input_before_sending(engine):
    async with AsyncEngine(engine) as aeng:
        s = await aeng.open(PROMPT)
        for call, error in [(s.snapshot("c", mode="partial"), InvalidRequestError),
                            (s.snapshot("c", tier="nvme"), ConfigError),
                            (s.generate(-1), InvalidRequestError),
                            (s.append(b"x"), InvalidTokenError),
                            (s.restore("a/b"), InvalidCapsuleNameError)]:
            with pytest.raises(error):
                await call
        assert await s.tokens() == engine.tokenize(PROMPT)  # nothing reached the session
        await s.close()
