"""Orchestrator results equal the in-process Engine's, token for token and logit for logit."""
import asyncio
import time

import numpy as np
import pytest

from capsulert.protocol.sampling import SamplingParams
from tests.step_records import records_when

SHORT = "The capsule runtime keeps the complete state of a session at a committed boundary. "
pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_open_append_generate_equal_in_process(orch, fresh):
    s = await orch.open(SHORT)
    logits = await s.append(" A user asks", logits=True)
    greedy = await s.generate(6)
    sampled = await s.generate(6, SamplingParams(temperature=0.9, top_k=50, seed=7))
    e = fresh.open()
    e.append(SHORT)
    ref_logits = e.append(" A user asks").numpy()
    assert np.array_equal(logits, ref_logits)
    assert greedy == e.generate(6)
    assert sampled == e.generate(6, SamplingParams(temperature=0.9, top_k=50, seed=7))
    assert await s.tokens() == e.tokens
    await s.close()


async def test_capsule_verbs_equal_in_process(orch, fresh):
    s = await orch.open(SHORT)
    await s.snapshot("parity-c0")
    out = await orch.restore_append_generate("parity-c0", " Then", 5)
    branches = await orch.fork("parity-c0", 3)
    sps = [SamplingParams(temperature=0.8, seed=i) for i in range(3)]
    batched = await orch.generate(branches, 4, sps)
    await s.restore("parity-c0")
    again = await s.append_generate(" Then", 5)

    e = fresh.open()
    e.append(SHORT)
    e.snapshot("parity-c0")
    r = fresh.restore("parity-c0")
    r.append(" Then")
    ref = r.generate(5)
    assert out == ref and again == ref
    fb = fresh.fork("parity-c0", 3)
    assert batched == fresh.generate(fb, 4, sps)
    await asyncio.gather(s.close(), *(b.close() for b in branches))
    await orch.delete("parity-c0")


async def test_32_concurrent_sessions_equal_solo_runs(orch, fresh):
    prompts = [f"Session {i} says: {SHORT[: 20 + 3 * i]}" for i in range(32)]

    async def one(i):
        s = await orch.open(prompts[i])
        toks = await s.generate(3, SamplingParams(temperature=0.7, seed=i) if i % 2 else None)
        full = await s.tokens()
        await s.close()
        return toks, full

    t0 = time.monotonic()
    results = await asyncio.gather(*(one(i) for i in range(32)))
    for i, (toks, full) in enumerate(results):
        e = fresh.open()
        e.append(prompts[i])
        solo = e.generate(3, SamplingParams(temperature=0.7, seed=i) if i % 2 else None)
        assert toks == solo, f"session {i} crossed or lost state"
        assert full == e.tokens
        e.close()
    stats = (await orch.stats())[0]
    assert stats["sessions"] == 0 and stats["free_slots"] == stats["slots"]
    assert stats["recent_steps"] == []  # asked for none
    async def read() -> list[dict]:  # the worker's step records of the crowd, once its last step's is kept
        return (await orch.stats(steps_since=t0))[0]["recent_steps"]
    steps = await records_when(read, lambda rs: sum(r["decode_rows"] for r in rs) == 32 * 3)
    assert sum(r["decode_rows"] for r in steps) == 32 * 3 and max(r["decode_rows"] for r in steps) > 1
    assert sum(r["prefill_tokens"] for r in steps) == sum(len(fresh.tokenize(p)) for p in prompts)
