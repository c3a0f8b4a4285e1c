"""The decode loop's fast paths against their slow paths, bit for bit: a group that steps again samples its
logits block in place with the sampling plan it made once (engine/decoding.py's _Batch), against groups
restacked every step; Engine.generate, which builds no events, against advance with events; the sampler's
skipped greedy pick and its top logprobs in the tokens' transfer; TextStream's kept text before an incomplete
character."""
from __future__ import annotations

import struct

import torch

from capsulert.engine.decoding import DecodeStream, advance
from capsulert.engine.sampler import RowDraw, SamplingPlan, sample_rows, stream_uniform
from capsulert.engine.stops import TextStream
from capsulert.protocol.sampling import SamplingParams

PROMPTS = ["Weather report: ", "The capsule runtime ", "def main():\n", "Once upon a time, "]
PARAMS = [SamplingParams(temperature=0.8, top_p=0.9, seed=11, logprobs=2), SamplingParams(),
          SamplingParams(temperature=1.0, top_k=5, seed=4, stop=(" the", "e ")),
          SamplingParams(logprobs=3, stop=("zq",), ignore_eos=True)]


def _bits(results) -> list:
    """Everything a generate returns, its floats as their bits."""
    b = lambda x: struct.pack("<d", x)  # noqa: E731
    return [(list(r), [b(x) for x in r.logprobs], [[(t, b(v)) for t, v in row] for row in r.top_logprobs],
             r.stop_reason, r.text, r.length) for r in results]


def _advanced(engine, n: int, order) -> tuple[list, list]:
    """The streams' results and events, each step advancing the streams order(step, streams) gives."""
    sessions = [engine.open(prompt=p) for p in PROMPTS]
    streams = [DecodeStream(engine, s, n, p) for s, p in zip(sessions, PARAMS)]
    events: dict[int, list] = {id(st): [] for st in streams}
    step = 0
    while any(not st.done for st in streams):
        for st, ev in advance(engine, order(step, streams)):
            events[id(st)].append((ev.token, struct.pack("<d", ev.logprob), ev.text, ev.index, ev.top_logprobs))
        step += 1
    for s in sessions:
        s.close()
    return _bits([st.result for st in streams]), [events[id(st)] for st in streams]


def test_a_group_sampled_in_place_equals_one_restacked_every_step(engine):
    n = 40
    same, events = _advanced(engine, n, lambda step, sts: sts)  # one group: after the first step in place
    flipped = _advanced(engine, n, lambda step, sts: sts if step % 2 else sts[::-1])  # a new group every step
    # a group split and joined again: its old block holds a stale row of the stream that stepped alone
    split = _advanced(engine, n, lambda step, sts: [sts[1]] if step % 3 == 1 else sts)
    assert flipped == (same, events) and split == (same, events)
    assert {r[3] for r in same} >= {"length", "stop_string"}  # the stops were exercised
    for r, evs in zip(same, events):  # the events add up to the result
        assert [e[0] for e in evs] == r[0] and "".join(e[2] for e in evs) == r[4]
    sessions = [engine.open(prompt=p) for p in PROMPTS]
    assert _bits(engine.generate(sessions, n, PARAMS)) == same  # generate builds no events
    for s in sessions:
        s.close()


def test_draws_without_a_greedy_row_equal_those_beside_one():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)) * 4
    free = [RowDraw(SamplingParams(temperature=t, top_p=p, seed=s), s, 9)
            for t, p, s in ((0.7, 0.9, 1), (1.3, 1.0, 2), (1.0, 0.5, 3))]
    alone = sample_rows(logits, free)  # no greedy row: the greedy pick is skipped
    beside = sample_rows(logits, free + [RowDraw(SamplingParams(), 0, 9)])
    assert alone.tokens == beside.tokens[:3] and alone.logprobs == beside.logprobs[:3]


def test_a_plan_made_once_draws_as_a_fresh_one_each_step():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 3
    params = [SamplingParams(temperature=0.9, top_k=40, seed=5, logprobs=4), SamplingParams(logprobs=2),
              SamplingParams(temperature=1.1, top_p=0.8, seed=6)]
    plan = SamplingPlan(params, [5, 0, 6], 4, 300, logits.device)
    for index in range(10, 20):
        kept = plan.draw(logits, [index] * 3)
        fresh = sample_rows(logits, [RowDraw(p, s, index) for p, s in zip(params, (5, 0, 6))])
        assert kept == fresh


def test_top_logprobs_are_the_raw_distributions_exactly():
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(2)) * 5
    draws = sample_rows(logits, [RowDraw(SamplingParams(logprobs=k), 0, 0) for k in (5, 0, 2)])
    values, ids = torch.topk(torch.log_softmax(logits, dim=-1), 5, dim=-1)
    assert draws.top_logprobs[0] == list(zip(ids[0].tolist(), values[0].tolist()))
    assert draws.top_logprobs[1] == [] and draws.top_logprobs[2] == list(zip(ids[2].tolist(), values[2].tolist()))[:2]
    assert draws.logprobs == torch.log_softmax(logits, -1).gather(1, torch.tensor(draws.tokens)[:, None])[:, 0].tolist()


def test_the_random_stream_is_unchanged():
    # pinned: a session's sampled tokens across versions depend on these bits
    assert stream_uniform(7, 3) == 0.42056992093657886
    assert stream_uniform((1 << 63) - 1, 4095) == 0.551276224818696
    assert stream_uniform(0, 0) == 0.6524484863740322


def test_text_kept_before_an_incomplete_character_changes_no_delta(engine):
    # byte tokens above 0x7f leave characters incomplete: the kept text is used while they are
    ids = engine.tokenize("naïve café – 数据 ✓ " * 4)
    ids += list(range(200, 260)) + engine.tokenize(" done")
    decode, deltas = engine.detokenize, []
    stream = TextStream(decode)
    got = [stream.push(t) for t in ids] + [stream.flush()]
    prefix = read = 0
    for i in range(1, len(ids) + 1):  # the same windows, every text decoded afresh
        before, after = decode(ids[prefix:read]), decode(ids[prefix:i])
        if after.endswith("\ufffd") or len(after) <= len(before):
            deltas.append("")
            continue
        deltas.append(after[len(before):])
        prefix, read = read, i
    deltas.append(decode(ids[prefix:])[len(decode(ids[prefix:read])):] if read < len(ids) else "")
    assert got == deltas and "" in got[:-1]
