"""Interrupt and re-enter: a generate stopped mid-way (task cancellation or sess.interrupt()) leaves the
session at a committed boundary holding the produced tokens; continuing equals never stopping. The tests
hold whether the interrupt lands after one token or after many: they compare prefix + continuation."""
import asyncio

import pytest

pytestmark = pytest.mark.asyncio(loop_scope="session")
PROMPT = "A robot arm moves toward the table when the operator says stop. "
N = 64


async def _started(sess, start_len):
    while len(await sess.tokens()) <= start_len:  # control group: answers while the decode runs
        await asyncio.sleep(0.005)


async def _uninterrupted(orch):
    s = await orch.open(PROMPT)
    full = await s.generate(N)
    await s.close()
    return full


async def test_cancel_then_continue_equals_uninterrupted(orch):
    s = await orch.open(PROMPT)
    p = s.length
    task = asyncio.create_task(s.generate(N))
    await _started(s, p)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    res = await s.wait()
    produced = (await s.tokens())[p:]
    assert 1 <= len(produced) < N, "the cancel should land mid-way"
    assert res.tokens == produced and res.stop_reason == "interrupted"
    await s.snapshot("irq-mid")  # a committed boundary: it can be snapshot ...
    rest = await s.generate(N - len(produced))
    assert produced + rest == await _uninterrupted(orch)
    r = await orch.restore("irq-mid")  # ... and restored and continued exactly
    assert await r.generate(N - len(produced)) == rest
    await asyncio.gather(s.close(), r.close(), orch.delete("irq-mid"))


async def test_interrupt_returns_partial_tokens(orch):
    s = await orch.open(PROMPT)
    p = s.length
    task = asyncio.create_task(s.generate(N))
    await _started(s, p)
    assert await s.interrupt()
    produced = await task
    assert s.stop_reason == "interrupted" and 1 <= len(produced) < N
    assert (await s.tokens())[p:] == produced
    rest = await s.generate(N - len(produced))
    assert s.stop_reason == "length"
    assert produced + rest == await _uninterrupted(orch)
    assert not await s.interrupt()  # nothing running
    await s.close()


async def test_cancel_before_start_stops_at_zero_tokens(orch):
    s = await orch.open(PROMPT)
    blocker = await orch.open(PROMPT)
    busy = asyncio.create_task(blocker.generate(12))  # occupies the worker's engine group
    await _started(blocker, blocker.length)
    task = asyncio.create_task(s.generate(N))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await busy
    res = await s.wait()
    assert res.stop_reason == "interrupted" and len(res.tokens) < N
    assert await s.generate(3) == (await _uninterrupted(orch))[len(res.tokens):len(res.tokens) + 3]
    await asyncio.gather(s.close(), blocker.close())
