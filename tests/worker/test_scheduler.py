"""The step scheduler and AsyncEngine: concurrent callers batched exactly, streaming, stops, logprobs,
queue bound, slot waits, prefill interleaved with decode."""
import asyncio
import time

import pytest
import torch

from capsulert.engine.stops import TextStream
from capsulert.errors import (InvalidRequestError, NoFreeSlotError, QueueFullError, SequenceTooLongError,
                              UnknownCapsuleError)
from capsulert.sessions.local import AsyncEngine
from capsulert.protocol.sampling import SamplingParams
from capsulert.protocol.requests import Append, Delete, Generate, Open, Ping, Promote, Request, Restore, Turn
from capsulert.protocol.results import FinalEvent, TokenEvent
from capsulert.scheduler.jobs import Phase
from capsulert.scheduler.step_scheduler import Sink, prefill_steps
from tests.step_records import async_read, records_when

NOEOS = SamplingParams(ignore_eos=True)


@pytest.fixture
def corpus(engine):
    from capsulert.engine.default_model import CORPUS_PATH

    return engine.tokenize(CORPUS_PATH.read_text()[:30000])


async def _agent(aeng, corpus, i, log):
    """One independent caller: open, generate, append, generate, snapshot, restore, generate (7 requests)."""
    params = SamplingParams(temperature=0.9, seed=i, ignore_eos=True) if i % 2 else NOEOS
    prompt = corpus[i * 97:i * 97 + 20 + 13 * i]
    s = await aeng.open(prompt)
    a = await s.generate(5 + i % 7, params)
    await s.append(corpus[5000 + i * 11:5000 + i * 11 + 9])
    b = await s.generate(4 + i % 5, params)
    await s.snapshot(f"agent{i}")
    r = await aeng.restore(f"agent{i}")
    c = await r.generate(3, params)
    await s.close()
    await r.close()
    log[i] = (prompt, params, a, b, c)


def _solo(engine, corpus, i, prompt, params):
    s = engine.open()
    s.append(prompt)
    a = engine.generate([s], 5 + i % 7, [params])[0]
    s.append(corpus[5000 + i * 11:5000 + i * 11 + 9])
    b = engine.generate([s], 4 + i % 5, [params])[0]
    s.snapshot(f"solo{i}")
    r = engine.restore(f"solo{i}")
    c = engine.generate([r], 3, [params])[0]
    s.close()
    r.close()
    return a, b, c


async def test_concurrent_requests_equal_their_solo_runs(make_engine, corpus):
    """16 independent tasks x 7 requests = 112 requests of mixed verbs, batched by the scheduler."""
    async with AsyncEngine(make_engine(slots=32, max_seq=512)) as aeng:
        log = {}
        await asyncio.gather(*(_agent(aeng, corpus, i, log) for i in range(16)))
        assert aeng.scheduler.steps < sum(len(x.tokens) for v in log.values() for x in v[2:])  # shared steps
    solo_engine = make_engine(slots=2, max_seq=512)
    for i, (prompt, params, *got) in log.items():
        want = _solo(solo_engine, corpus, i, prompt, params)
        for g, w in zip(got, want):
            assert g.tokens == w.tokens and g.logprobs == w.logprobs, i
            assert g.stop_reason == w.stop_reason == "length"


async def test_concurrent_prefills_share_forwards_and_equal_their_solo_appends(make_engine, corpus):
    """Four sessions' long appends at once: a step's pieces of every prefilling session run as one batched
    append, so the forwards are fewer than the pieces, and each session's logits are its solo append's."""
    eng = make_engine(slots=8, max_seq=1024)
    prompts = [corpus[i * 11:i * 11 + 40 + 13 * i] for i in range(4)]
    turns = [corpus[300 + i:300 + i + 500 + 30 * i] for i in range(4)]
    want = []
    for p, t in zip(prompts, turns):
        s = eng.open(p)
        want.append(s.append(t))
        s.close()
    async with AsyncEngine(eng, step_prefill_tokens=4 * 128) as aeng:
        sessions = [await aeng.open(p) for p in prompts]
        before = aeng.scheduler.prefill_forwards
        got = await asyncio.gather(*(aeng.submit(Append(s.id, t, logits=True)) for s, t in zip(sessions, turns)))
        forwards = aeng.scheduler.prefill_forwards - before
    pieces = sum(len(prefill_steps(len(p), len(t), 64, 128)) for p, t in zip(prompts, turns))
    assert forwards <= pieces // 2, (forwards, pieces)
    for g, w in zip(got, want):
        assert torch.equal(torch.from_numpy(g.logits), w.cpu())


async def test_stream_is_ordered_complete_and_cancellable(make_engine, corpus):
    async with AsyncEngine(make_engine()) as aeng:
        s = await aeng.open(corpus[:40])
        events = [ev async for ev in s.stream(12, NOEOS)]
        tokens = [e.token for e in events if isinstance(e, TokenEvent)]
        final = events[-1]
        assert isinstance(final, FinalEvent) and final.result.tokens == tokens
        assert [e.index for e in events[:-1]] == list(range(12))
        assert "".join(e.text for e in events[:-1]) == final.result.text == aeng.engine.detokenize(tokens)
        assert final.result.stop_reason == "length" and final.result.length == 52

        t = await aeng.open(corpus[:40])
        got = []
        budget = 2000  # far more than a step loop gets through before the cancel lands, on any device
        async for ev in t.stream(budget, NOEOS):
            got.append(ev.token)
            if len(got) == 3:
                break  # closes the iterator: the generate stops at the next token boundary
        await asyncio.sleep(0.05)
        more = await t.generate(4, NOEOS)  # runs after the cancelled one finished; its tokens are kept
        committed = more.length - 40 - 4
        assert 3 <= committed < budget, f"{committed} tokens committed of {budget}: the cancel did not land"
        ref = aeng.engine.open()
        ref.append(corpus[:40])
        full = ref.generate(committed + 4, NOEOS)
        assert full[:3] == got, f"streamed {got}, one generate {full[:3]}"
        crossed = (40 + committed) // aeng.engine.grid
        assert full[committed:] == more.tokens, (
            f"after {committed} committed tokens (grid points crossed: {crossed}), the next generate gave "
            f"{more.tokens} where one generate gives {full[committed:]}")


def _bytes_text(tokens) -> str:
    """A byte-level decoder where every third token is the lead byte of a 3-byte character (U+20AC) and the
    next two its continuation bytes, when they follow it: outputs end inside a character often."""
    raw = b"".join(b"\xe2" if t % 3 == 0 else b"\x82" if t % 3 == 1 else bytes([97 + t % 26]) for t in tokens)
    return raw.decode("utf-8", errors="replace")


def _ending_inside_a_character(engine, corpus, budget: int | None):
    """(prompt length, greedy tokens) whose last token leaves a character incomplete: with `budget`, the
    tokens that fill a `budget`-token session; without, the shortest such run of at least 4 from a prompt."""
    for p in range(budget - 28 if budget else 40, budget - 8 if budget else 60):
        s = engine.open()
        s.append(corpus[:p])
        free = engine.generate([s], budget - p if budget else 40, [NOEOS])[0].tokens
        s.close()
        for n in ([len(free)] if budget else range(4, len(free) + 1)):
            if free[n - 1] % 3 == 0:
                return p, free[:n]
    raise AssertionError("no greedy run ends inside a character")


@pytest.mark.parametrize("stop", ["length", "max_seq", "interrupted"])
async def test_a_stream_that_ends_inside_a_character_releases_it_with_its_last_token(make_engine, corpus, stop):
    full = 128 if stop == "max_seq" else None  # the smallest max_seq on the grid
    ref = make_engine()
    ref.detokenize = _bytes_text
    p, want = _ending_inside_a_character(ref, corpus, full)
    assert _bytes_text(want).endswith("\ufffd")
    engine = make_engine(max_seq=full or 512)
    engine.detokenize = _bytes_text
    async with AsyncEngine(engine) as aeng:
        s = await aeng.open(corpus[:p])
        events = []
        async for ev in s.stream(1000 if full or stop == "interrupted" else len(want), NOEOS):
            events.append(ev)
            if stop == "interrupted" and len(events) == len(want):
                break
        if stop == "interrupted":  # the cancel lands at a token boundary: the tokens so far are kept
            assert (await s.generate(1, NOEOS)).length - p - 1 >= len(want)
        else:
            final = events.pop()
            assert final.result.stop_reason == stop and final.result.text == _bytes_text(want)
            assert "".join(e.text for e in events) == final.result.text  # the last event released the rest
        assert [e.token for e in events] == want
        if stop == "interrupted":  # held while it may go on: the tokens after the last whole character
            whole = max(n for n in range(len(want) + 1) if n == 0 or not _bytes_text(want[:n]).endswith("\ufffd"))
            assert whole < len(want) and "".join(e.text for e in events) == _bytes_text(want[:whole])


def test_a_stream_holds_the_whole_run_of_replacement_characters_at_its_end():
    """A decoder's text cannot tell a final U+FFFD (a lead byte followed by another) from one a later token
    completes, so the stream holds every token since its last whole character, and releases them with the next
    text or at the end."""
    letter, lead = 5, 0  # 'f' and a lead byte under _bytes_text
    stream = TextStream(_bytes_text)
    assert [stream.push(t) for t in (letter, lead, lead, lead, 8)] == ["f", "", "", "", "\ufffd" * 3 + "i"]
    stream = TextStream(_bytes_text)
    assert [stream.push(t) for t in (letter, lead, lead, lead)] + [stream.flush()] == ["f", "", "", "", "\ufffd" * 3]


async def test_stop_strings_eos_and_stop_ids(make_engine, corpus):
    async with AsyncEngine(make_engine(slots=8)) as aeng:
        s = await aeng.open(corpus[:60])
        free = await s.generate(16, NOEOS)
        text = aeng.engine.detokenize
        # a stop string spanning the boundary between tokens 5 and 6
        left, right = text(free.tokens[:6]), text(free.tokens[:7])
        stop = left[-2:] + right[len(left):len(left) + 2]
        assert len(stop) >= 3
        r = await aeng.open(corpus[:60])
        res = await r.generate(16, SamplingParams(stop=[stop], ignore_eos=True))
        assert res.stop_reason == "stop_string" and res.tokens == free.tokens[:7]
        assert stop not in res.text and res.text == text(free.tokens[:7])[:text(free.tokens[:7]).find(stop)]
        # EOS ids stop by default; ignore_eos opts out; stop_token_ids stop too
        aeng.engine.eos_token_ids = (free.tokens[3],)
        e = await aeng.open(corpus[:60])
        res = await e.generate(16)
        first = free.tokens.index(free.tokens[3])
        assert res.stop_reason == "eos" and res.tokens == free.tokens[:first + 1]
        f = await aeng.open(corpus[:60])
        assert (await f.generate(16, NOEOS)).tokens == free.tokens
        g = await aeng.open(corpus[:60])
        res = await g.generate(16, SamplingParams(stop_token_ids=[free.tokens[9]], ignore_eos=True))
        assert res.stop_reason == "stop_token" and res.tokens[-1] == free.tokens[9]


async def test_a_stream_never_shows_text_a_stop_string_may_start_and_adds_up_to_the_result(make_engine, corpus):
    async with AsyncEngine(make_engine(slots=8)) as aeng:
        free = await (await aeng.open(corpus[:60])).generate(16, NOEOS)
        text = aeng.engine.detokenize
        left, right = text(free.tokens[:6]), text(free.tokens[:7])
        stop = left[-2:] + right[len(left):len(left) + 2]  # spans the boundary between tokens 5 and 6
        never = "\x00never"  # a stop string that does not match: its first character is held until decided
        s = await aeng.open(corpus[:60])
        events = [ev async for ev in s.stream(16, SamplingParams(stop=[stop, never], ignore_eos=True))]
        final = events.pop().result
        assert final.stop_reason == "stop_string" and final.text == right[:right.find(stop)]
        assert "".join(e.text for e in events) == final.text and [e.token for e in events] == free.tokens[:7]
        # at every event, what was shown is a prefix of the final text: the match's start was never shown
        assert all(final.text.startswith("".join(e.text for e in events[:i])) for i in range(len(events)))
        assert not final.text.endswith(stop[:2]) and left.endswith(stop[:2])
        t = await aeng.open(corpus[:60])
        shown = ""
        async for ev in t.stream(16, SamplingParams(stop=[never], ignore_eos=True)):
            if isinstance(ev, FinalEvent):
                assert ev.result.text == shown == text(free.tokens)
            else:
                shown += ev.text
                # up to len(never) - 1 characters held back while a match could still start there (and an
                # incomplete character, until its end arrives)
                so_far = text(free.tokens[:ev.index + 1])
                assert so_far.startswith(shown)
                assert ev.index == 15 or len(so_far.rstrip("\ufffd")) - len(shown) <= len(never) - 1


def _cold_logits(engine, tokens) -> torch.Tensor:
    """The next-token logits of a cold prefill of `tokens`, on a session of its own."""
    ref = engine.open()
    logits = ref.append(tokens)
    ref.close()
    return logits


async def test_logprobs_are_log_softmax_of_the_logits(make_engine, corpus):
    engine = make_engine()
    logits = _cold_logits(engine, corpus[:30])
    async with AsyncEngine(engine) as aeng:
        s = await aeng.open(corpus[:30])
        res = await s.generate(2, SamplingParams(logprobs=3, ignore_eos=True))
    lp = torch.log_softmax(logits, -1)
    assert res.logprobs[0] == pytest.approx(float(lp[res.tokens[0]]), abs=1e-6)
    top = torch.topk(lp, 3)
    assert [t for t, _ in res.top_logprobs[0]] == top.indices.tolist()
    assert [v for _, v in res.top_logprobs[0]] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert len(res.top_logprobs) == 2


async def test_queue_bound(make_engine, corpus):
    async with AsyncEngine(make_engine(slots=1, slot_wait_s=0.5), max_queue=2) as aeng:
        await aeng.open(corpus[:20])
        waiting = [asyncio.ensure_future(aeng.submit(Open())) for _ in range(2)]  # no slot: they queue
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFullError):
            await aeng.submit(Open())
        for w in waiting:  # and give up after slot_wait_s
            with pytest.raises(NoFreeSlotError):
                await w


async def test_a_restore_waiting_for_a_slot_gets_the_one_a_close_frees(make_engine, corpus):
    async with AsyncEngine(make_engine(slots=1, slot_wait_s=5.0)) as aeng:
        s = await aeng.open(corpus[:20])
        await s.snapshot("c")
        waiting = asyncio.ensure_future(aeng.restore("c"))  # no free slot: waits without blocking
        await asyncio.sleep(0.1)
        assert (await s.generate(2, NOEOS)).length == 22  # the loop still serves other work
        t0 = time.monotonic()
        await s.close()
        r = await asyncio.wait_for(waiting, 1.0)  # gets the slot the close freed
        assert time.monotonic() - t0 < 1.0 and r.length == 20


async def test_requests_for_slots_start_first_come_first_served(make_engine, corpus):
    """Issue 29 item 1 at the worker: a fork of 2 waiting for slots used to lose every freed slot to later
    opens of 1 (and fail after slot_wait_s). Now slot-needing requests start in arrival order, and one that
    needs more slots than the engine has is refused at once."""
    from capsulert.errors import ExceedsCapacityError

    async with AsyncEngine(make_engine(slots=2, slot_wait_s=30.0)) as aeng:
        a, b = await aeng.open(corpus[:20]), await aeng.open(corpus[:30])
        await a.snapshot("c")
        t0 = time.monotonic()
        with pytest.raises(ExceedsCapacityError, match="3 slot"):
            await aeng.fork("c", 3)  # could never start: at once, not after slot_wait_s
        assert time.monotonic() - t0 < 2.0
        fork = asyncio.ensure_future(aeng.fork("c", 2))
        await asyncio.sleep(0.05)
        later = asyncio.ensure_future(aeng.open(corpus[:10]))
        await asyncio.sleep(0.05)
        await a.close()  # one slot free: the open behind the fork must not take it
        await asyncio.sleep(0.2)
        assert not fork.done() and not later.done() and aeng.engine.free_slots == 1
        await b.close()
        branches = await asyncio.wait_for(fork, 5.0)
        assert [x.length for x in branches] == [20, 20] and not later.done()
        await branches[0].close()
        assert (await asyncio.wait_for(later, 5.0)).length == 10
        await branches[1].close()


async def test_long_prefill_does_not_stall_decoding(make_engine, corpus):
    async with AsyncEngine(make_engine(max_seq=2048)) as aeng:
        decoder = await aeng.open(corpus[:20])
        times = []

        async def decode():
            async for ev in decoder.stream(60, NOEOS):
                times.append(time.monotonic())

        task = asyncio.ensure_future(decode())
        while not times:
            await asyncio.sleep(0.001)
        long = await aeng.open()
        await long.append(corpus[:1500])  # 12 chunks of 128, one per step
        done = time.monotonic()
        await task
        assert sum(t < done for t in times) >= 10  # tokens kept coming while the prefill ran
        ref = aeng.engine.open()
        ref.append(corpus[:1500])
        assert torch.equal(ref.logits(), aeng.engine.logits(aeng.scheduler.session(long.id)))


async def test_an_in_place_restore_waits_for_the_sessions_running_generate(make_engine, corpus):
    """A restore into a session is one of that session's requests: it runs after the generate submitted
    before it, which therefore equals its solo run."""
    async with AsyncEngine(make_engine()) as aeng:
        s = await aeng.open(corpus[:30])
        await s.snapshot("back")
        running = asyncio.ensure_future(aeng.submit(Generate(s.id, 40, NOEOS)))
        await asyncio.sleep(0.01)
        info = await aeng.submit(Restore("back", into=s.id))
        assert running.done()
        res = await running
        assert info.length == 30 and res.length == 70
        ref = aeng.engine.open()
        ref.append(corpus[:30])
        assert res.tokens == ref.generate(40, NOEOS).tokens


async def test_append_with_logits_and_non_session_requests(make_engine, corpus):
    engine = make_engine()
    want = _cold_logits(engine, corpus[:25])
    async with AsyncEngine(engine) as aeng:
        s = await aeng.open()
        info = await aeng.submit(Append(s.id, corpus[:25], logits=True))
        assert info.length == 25 and torch.equal(torch.from_numpy(info.logits), want.cpu())
        assert (await aeng.submit(Append(s.id, corpus[25:30]))).logits is None
        for request in (Promote("x", "host"), Ping(), "open"):  # the scheduler runs session requests only
            with pytest.raises(InvalidRequestError):
                await aeng.submit(request)


async def test_a_delete_runs_in_arrival_order_with_the_restores(make_engine, corpus):
    """Restores submitted before a delete read the whole capsule; one submitted after finds none."""
    async with AsyncEngine(make_engine(slots=8)) as aeng:
        s = await aeng.open(corpus[:300])
        await s.snapshot("c")
        before = [asyncio.ensure_future(aeng.restore("c")) for _ in range(4)]
        deleted = asyncio.ensure_future(aeng.submit(Delete("c")))
        after = asyncio.ensure_future(aeng.restore("c"))
        assert [r.length for r in await asyncio.gather(*before)] == [300] * 4
        assert await deleted is None
        with pytest.raises(UnknownCapsuleError):
            await after


async def test_a_streaming_turn_equals_append_then_stream(make_engine, corpus):
    params = SamplingParams(temperature=0.8, seed=3, ignore_eos=True, logprobs=2)
    async with AsyncEngine(make_engine()) as aeng:
        a, b = await aeng.open(corpus[:150]), await aeng.open(corpus[:150])
        turn = [ev async for ev in a.stream_turn(corpus[150:420], 12, params)]
        await b.append(corpus[150:420])
        split = [ev async for ev in b.stream(12, params)]
        assert turn[:-1] == split[:-1]  # every TokenEvent: token, logprob, text, index, top-k, all bitwise
        one, two = turn[-1].result, split[-1].result
        assert one == two and one.logprobs == two.logprobs and one.top_logprobs == two.top_logprobs
        assert (one.text, one.stop_reason, one.length) == (two.text, two.stop_reason, two.length) == \
            (two.text, "length", 420 + 12)
        assert a.length == b.length == 432


async def test_a_turn_naming_no_session_or_capsule_opens_closes_and_equals_open_then_turn(make_engine, corpus):
    """Turn(None, None, prompt, ...) is open + turn + close in one request: the same tokens, no session left."""
    params = SamplingParams(temperature=0.8, seed=5, ignore_eos=True)
    async with AsyncEngine(make_engine(slots=2)) as aeng:
        s = await aeng.open()
        want = await s.turn(corpus[:130], 10, params)
        await s.close()
        got = await aeng.submit(Turn(None, None, corpus[:130], 10, params, close=True))
        assert list(got) == list(want) and got.logprobs == want.logprobs and got.length == 140
        assert got.session is None and aeng.scheduler.session_count == 0
        with pytest.raises(SequenceTooLongError):  # a refused prompt leaves no session behind
            await aeng.submit(Turn(None, None, corpus[:1] * 100_000, 1, params, close=True))
        assert aeng.scheduler.session_count == 0


async def test_token_events_carry_the_top_logprobs_of_the_logits(make_engine, corpus):
    engine = make_engine()
    k = 4
    async with AsyncEngine(engine) as aeng:
        s = await aeng.open(corpus[:200])  # its 70 tokens cross the grid point at 256: the re-derivation too
        events = [ev async for ev in s.stream(70, SamplingParams(logprobs=k, ignore_eos=True))]
    tokens, final = [e for e in events[:-1]], events[-1].result
    assert [list(e.top_logprobs) for e in tokens] == final.top_logprobs and len(tokens) == 70
    ref = engine.open()  # the same steps by hand: the decode path's logits, then log_softmax and top-k
    logits = ref.append(corpus[:200])
    for ev in tokens:
        lp = torch.log_softmax(logits.float(), -1)
        top = torch.topk(lp, k)
        ids, values = [t for t, _ in ev.top_logprobs], [v for _, v in ev.top_logprobs]
        # the k best values, each id carrying its own logprob; which of several tied ids fills a place is
        # the top-k kernel's choice (bf16 logits on CUDA tie often), so ids are checked by their values
        assert values == pytest.approx(top.values.tolist(), abs=1e-6) and len(set(ids)) == k
        assert [lp[t].item() for t in ids] == pytest.approx(values, abs=1e-6)
        assert ev.logprob == values[0] == pytest.approx(lp[ev.token].item(), abs=1e-6)  # greedy: a best one
        with engine.lock:
            logits = engine.table.step([ref], [ev.token])[0].clone()
    ref.close()
    async with AsyncEngine(engine) as aeng:  # without logprobs asked for, events carry none
        s = await aeng.open(corpus[:20])
        plain = [ev async for ev in s.stream(3, NOEOS)]
    assert all(ev.top_logprobs == () for ev in plain[:-1])


async def test_restores_report_the_tier_they_read_from(make_engine, corpus, tmp_path):
    async with AsyncEngine(make_engine(slots=4, disk_dir=str(tmp_path / "disk"))) as aeng:
        store = aeng.engine.store

        async def restored_from() -> str:
            r = await aeng.restore("c")
            await r.close()
            return r.restored_from
        s = await aeng.open(corpus[:300])
        await s.snapshot("c")
        assert await restored_from() == "device"
        for tier in ("host", "disk"):
            store.demote("c", tier)
            assert store.info("c").tier == tier
            assert await restored_from() == tier  # read from there, then promoted
            assert store.info("c").tier == "device"
            assert await restored_from() == "device"
        store.demote("c", "host")
        assert await s.restore("c") == "host"  # in place
        store.demote("c", "disk")
        res = await s.turn(corpus[300:310], 2, NOEOS, restore="c")
        assert res.restored_from == "disk"
        store.demote("c", "host")
        branches = await aeng.fork("c", 3)
        assert [b.restored_from for b in branches] == ["host"] * 3  # where the first read found it
        assert (await s.generate(1)).restored_from is None  # nothing restored


async def test_the_step_loop_counts_its_decoded_tokens_and_its_time_per_phase(make_engine, corpus):
    async with AsyncEngine(make_engine()) as aeng:
        sch = aeng.scheduler
        assert sch.decoded_tokens == 0 and sch.busy_s == {"start": 0.0, "prefill": 0.0, "decode": 0.0}
        a, b = await aeng.open(corpus[:30]), await aeng.open(corpus[30:50])
        await asyncio.gather(a.generate(7, NOEOS), b.generate(5, NOEOS))
        assert sch.decoded_tokens == 12 and sch.steps >= 7
        assert all(sch.busy_s[k] > 0 for k in ("start", "prefill", "decode"))


async def test_the_step_loop_keeps_a_record_of_each_step_it_ran(make_engine, corpus):
    async with AsyncEngine(make_engine()) as aeng:
        sch = aeng.scheduler
        t0 = time.monotonic()
        a = await aeng.open(corpus[:40])
        await a.snapshot("c")
        branches = await aeng.fork("c", 2)
        await asyncio.gather(*(b.generate(3, NOEOS) for b in branches))
        records = await records_when(async_read(sch.trace.since, t0), lambda rs: sum(r["decode_rows"] for r in rs) == 6)
        assert [r["at_s"] for r in records] == sorted(r["at_s"] for r in records) and records[0]["at_s"] >= t0
        assert sum(r["started"] for r in records) == sch.started == 5  # open, snapshot, fork, two generates
        assert sum(r["prefill_tokens"] for r in records) == sch.prefill_tokens == 40
        assert sum(r["prefill_forwards"] for r in records) == sch.prefill_forwards
        assert sum(r["decode_rows"] for r in records) == sch.decoded_tokens == 6
        assert max(r["decode_rows"] for r in records) == 2  # the branches decoded in one step
        assert all(r["prefill_ms"] > 0 for r in records if r["prefill_forwards"])
        assert sch.trace.since(time.monotonic()) == []  # nothing ran since


def test_the_step_trace_keeps_the_newest_records_of_steps_that_did_something():
    from capsulert.scheduler.step_trace import StepRecord, StepTrace
    trace = StepTrace(size=3)
    for i in range(5):
        trace.add(StepRecord(float(i), 0.0, 0.0, 1.0, 0, 0, 0, 1))
    trace.add(StepRecord(9.0, 0.1, 0.0, 0.0, 0, 0, 0, 0))  # an idle poll of slot waiters: no step
    assert [r["at_s"] for r in trace.since()] == [2.0, 3.0, 4.0]
    assert [r["at_s"] for r in trace.since(3.0)] == [3.0, 4.0]


async def test_a_session_request_no_starter_runs_is_refused_when_submitted(make_engine):
    async with AsyncEngine(make_engine()) as aeng:
        with pytest.raises(InvalidRequestError, match="does not run Request"):
            aeng.scheduler.submit(Request(), Sink(done=print, error=print))  # refused in the caller's thread
        assert aeng.scheduler.queued == 0


async def test_a_prefill_checks_its_tokens_once_and_never_through_the_public_append(make_engine, corpus,
                                                                                      monkeypatch):
    """The scheduler checks a request's tokens when its prefill begins, then appends them in pieces through
    Engine.append_checked: one check for 12 pieces, Engine.append (which checks again) never called."""
    engine = make_engine(max_seq=2048)
    checks = []
    real_validate = engine.codec.validate
    monkeypatch.setattr(engine.codec, "validate", lambda *a: checks.append(a[1]) or real_validate(*a))
    monkeypatch.setattr(engine, "append", lambda *a: pytest.fail("the scheduler called Engine.append"))
    async with AsyncEngine(engine) as aeng:
        s = await aeng.open()
        info = await aeng.submit(Append(s.id, corpus[:1500], logits=True))  # 12 chunks of 128, one per step
        assert checks == [2048] and info.length == 1500
        monkeypatch.undo()
        assert torch.equal(torch.from_numpy(info.logits), _cold_logits(engine, corpus[:1500]).cpu())
        with pytest.raises(SequenceTooLongError):  # the one check refuses what the public append refuses
            await aeng.submit(Append(s.id, corpus[:600]))
        assert len(aeng.scheduler.session(s.id).tokens) == 1500


def _future_sink(loop, event=None) -> tuple[asyncio.Future, Sink]:
    fut = loop.create_future()
    return fut, Sink(done=lambda v: loop.call_soon_threadsafe(fut.set_result, v),
                     error=lambda e: loop.call_soon_threadsafe(fut.set_exception, e), event=event)


async def test_a_job_goes_through_its_typed_phases_in_order(make_engine, corpus):
    """Seen from another generate's events: a Turn's job prefills (Phase.PREFILL) while that generate keeps
    decoding, then decodes (Phase.DECODE), and has no phase once answered."""
    loop = asyncio.get_running_loop()
    async with AsyncEngine(make_engine(max_seq=2048)) as aeng:
        decoder, long = await aeng.open(corpus[:20]), await aeng.open()
        turn_job, seen = [], []

        def record(ev) -> None:
            if turn_job and turn_job[0].phase is not None:
                seen.append(turn_job[0].phase)
        decoded, sink = _future_sink(loop, record)
        decoding = aeng.scheduler.submit(Generate(decoder.id, 60, NOEOS), sink)
        turned, sink = _future_sink(loop)
        turn_job.append(aeng.scheduler.submit(Turn(long.id, suffix=corpus[:1000], max_new_tokens=8,
                                                   sampling=NOEOS), sink))
        assert (await turned).length == 1008 and len((await decoded).tokens) == 60
        order = [Phase.PREFILL, Phase.DECODE]
        assert seen.count(Phase.PREFILL) >= 5 and Phase.DECODE in seen and seen == sorted(seen, key=order.index)
        assert turn_job[0].phase is None and decoding.phase is None


def test_the_scheduler_takes_its_bounds_from_the_engine_config(make_engine):
    """EngineConfig.scheduler sets the step scheduler's queue bound and prefill budgets; arguments override. Set,
    step_prefill_tokens is the budget with or without decoding sessions; unset, it is one chunk while sessions
    decode and a crowd forward (batched_piece_rows, or the chunk where that is smaller) while none does."""
    from capsulert.scheduler.step_scheduler import StepScheduler

    eng = make_engine(slots=1, scheduler={"max_queue": 3, "step_prefill_tokens": 256})
    for sch, queue in ((StepScheduler(eng), 3), (StepScheduler(eng, max_queue=5), 5)):
        try:
            assert (sch.max_queue, sch.budget, sch.decoding_budget) == (queue, 256, 256)
        finally:
            sch.stop()
    # the engine's chunk is 128; without batched prefill there is no crowd forward to fill
    for cfg, want in (({}, 2048), ({"batched_piece_rows": 512}, 512), ({"batched_piece_rows": 64}, 128),
                      ({"batched_piece_rows": 0}, 128), ({"scheduler": {"batch_prefill": False}}, 128)):
        sch = StepScheduler(make_engine(slots=1, **cfg))
        try:
            assert (sch.budget, sch.decoding_budget) == (want, 128)
        finally:
            sch.stop()


@pytest.mark.parametrize("held,new,want", [
    (0, 300, [(128, 128), (256, 128), (300, 44)]),
    (100, 200, [(192, 128), (300, 108)]),  # from its grid point 64: a chunk past it, counted with the re-run
    (130, 20, [(150, 22)]),
    (191, 1, [(192, 64)]),
], ids=["cold", "off-grid", "short", "to-the-grid"])
def test_prefill_steps_end_a_chunk_past_their_grid_point_and_count_the_rerun(held, new, want):
    assert prefill_steps(held, new, 64, 128) == want


def test_a_replayed_tail_is_not_counted_in_a_prefill_steps_work():
    """The tail the first piece replays in the linear-attention layers (kept rows up to `replayed`) costs no
    row of the rest of the model: the step's work is what runs through it."""
    assert prefill_steps(100, 200, 64, 128, replayed=100) == [(192, 92), (300, 108)]
    assert prefill_steps(100, 200, 64, 128, replayed=80) == [(192, 112), (300, 108)]
    assert prefill_steps(100, 200, 64, 128, replayed=64) == prefill_steps(100, 200, 64, 128)


@pytest.mark.parametrize("decoding_budget", [None, 128])
async def test_the_prefill_budget_while_others_decode_spreads_an_append_over_steps(make_engine, corpus,
                                                                                   decoding_budget):
    """step_prefill_tokens_decoding bounds the prefill a step runs while a generate is running (its tokens
    wait for it): a 512-token append then takes four steps of 128, not one of 512; the same logits."""
    eng = make_engine(slots=4, max_seq=1024, scheduler={"step_prefill_tokens": 512,
                                                        "step_prefill_tokens_decoding": decoding_budget})
    solo = eng.open(corpus[:64])
    want = solo.append(corpus[64:576])
    solo.close()
    async with AsyncEngine(eng) as aeng:
        a, b = await aeng.open(corpus[:40]), await aeng.open(corpus[:64])
        running = asyncio.ensure_future(a.generate(400, NOEOS))
        while aeng.scheduler.decoded_tokens < 2:
            await asyncio.sleep(0.002)
        before = aeng.scheduler.steps
        got = await aeng.submit(Append(b.id, corpus[64:576], logits=True))
        steps = aeng.scheduler.steps - before
        a_running = not running.done()
        running.cancel()
    assert a_running
    assert torch.equal(torch.from_numpy(got.logits), want.cpu())
    if decoding_budget is None:
        assert steps <= 2, steps
    else:
        assert steps >= 4, steps


async def test_requests_submitted_together_start_in_one_step(make_engine, corpus):
    """StepScheduler.together: the loop takes none of a batch's requests before it can take them all (the
    worker submits a Batch so); without it, the loop would start the first alone while the rest come in."""
    loop = asyncio.get_running_loop()
    async with AsyncEngine(make_engine(slots=4)) as aeng:
        sessions = [await aeng.open(corpus[:10]) for _ in range(3)]
        t0 = time.monotonic()
        futures = []
        with aeng.scheduler.together():
            for i, s in enumerate(sessions):
                fut, sink = _future_sink(loop)
                aeng.scheduler.submit(Append(s.id, corpus[20 + i:25 + i]), sink)
                futures.append(fut)
                time.sleep(0.1)  # the loop is free meanwhile: only the block holds it back
        assert [info.length for info in await asyncio.gather(*futures)] == [15] * 3
        steps = await records_when(async_read(aeng.scheduler.trace.since, t0), lambda rs: len(rs) > 0)
        assert [(r["started"], r["prefill_forwards"], r["prefill_tokens"]) for r in steps] == [(3, 1, 15)]


async def _turns_together(eng, prompts, turns, new: int) -> tuple[list[list[int]], list[list[int]], list[dict]]:
    """Each prompt's session given its turn (append + `new` greedy tokens): (the tokens of each turn submitted
    together to a step scheduler, those of its solo run, the scheduler's step records of the turns)."""
    want = []
    for p, t in zip(prompts, turns):
        s = eng.open(p)
        s.append(t)
        want.append(eng.generate([s], new, [NOEOS])[0].tokens)
        s.close()
    loop = asyncio.get_running_loop()
    async with AsyncEngine(eng) as aeng:
        sessions = [await aeng.open(p) for p in prompts]
        t0, futures = time.monotonic(), []
        with aeng.scheduler.together():
            for s, t in zip(sessions, turns):
                fut, sink = _future_sink(loop)
                aeng.scheduler.submit(Turn(s.id, suffix=t, max_new_tokens=new, sampling=NOEOS), sink)
                futures.append(fut)
        got = await asyncio.gather(*futures)
        steps = await records_when(async_read(aeng.scheduler.trace.since, t0),
                                   lambda rs: sum(r["decode_rows"] for r in rs) == new * len(turns))
    return [g.tokens for g in got], want, steps


async def test_a_crowds_turns_arriving_together_run_in_one_forward_and_start_decoding_together(make_engine, corpus):
    """No session decoding, the unset step budget is a crowd forward, not a chunk: six turns of 40 tokens (240
    rows, past the 128-token chunk, which held four of them a step) submitted together are one prefill forward,
    and their first tokens come in one decode step, every later step decoding all six; each turn's tokens are its
    solo run's."""
    prompts = [corpus[100 * i:100 * i + 64] for i in range(6)]
    turns = [corpus[700 + 40 * i:740 + 40 * i] for i in range(6)]
    got, want, steps = await _turns_together(make_engine(slots=7, max_seq=512), prompts, turns, 5)
    assert got == want
    assert [(r["started"], r["prefill_forwards"], r["prefill_tokens"]) for r in steps if r["prefill_forwards"]] == [
        (6, 1, 240)]
    assert [r["decode_rows"] for r in steps] == [6] * 5


async def test_a_long_piece_and_short_turns_arriving_together_run_as_two_forwards(make_engine, corpus):
    """One forward pads its pieces to the longest: a 120-token append beside six 8-token turns would be 7 x 120
    rows for 168 real ones, so the step runs the long piece and the short turns as two forwards (engine/prefill_groups.py);
    each session's tokens are its solo run's."""
    prompts = [corpus[100 * i:100 * i + 64] for i in range(7)]
    turns = [corpus[700:820]] + [corpus[820 + 8 * i:828 + 8 * i] for i in range(6)]
    got, want, steps = await _turns_together(make_engine(slots=8, max_seq=512), prompts, turns, 3)
    assert got == want
    assert [(r["started"], r["prefill_forwards"], r["prefill_tokens"]) for r in steps if r["prefill_forwards"]] == [
        (7, 2, 168)]


@pytest.mark.parametrize("step_budget", [None, 2048])
async def test_a_long_prompt_alone_advances_a_piece_a_step_under_the_unset_budget(make_engine, corpus, step_budget):
    """The unset budget of a step with none decoding is wide (a crowd forward) but one round deep: a lone
    600-token append advances a piece a step (five pieces of the 128-token chunk, five steps), so a request
    arriving meanwhile starts after one forward; a budget set to 2,048 runs the pieces in one step. The same
    logits either way."""
    eng = make_engine(slots=2, max_seq=1024, scheduler={"step_prefill_tokens": step_budget})
    solo = eng.open(corpus[:64])
    want = solo.append(corpus[64:664])
    solo.close()
    async with AsyncEngine(eng) as aeng:
        s = await aeng.open(corpus[:64])
        t0 = time.monotonic()
        got = await aeng.submit(Append(s.id, corpus[64:664], logits=True))
        steps = await records_when(async_read(aeng.scheduler.trace.since, t0),
                                   lambda rs: sum(r["prefill_tokens"] for r in rs) == 600)
    assert torch.equal(torch.from_numpy(got.logits), want.cpu())
    pieces = [r["prefill_forwards"] for r in steps if r["prefill_forwards"]]
    assert len(prefill_steps(64, 600, 64, 128)) == 5 and sum(pieces) == 5
    assert pieces == ([1] * 5 if step_budget is None else [5])


async def test_a_crowds_turns_arriving_while_a_generate_runs_are_prefilled_a_chunk_a_step(make_engine, corpus):
    """While a generate runs its next token waits for the step's prefill: the unset budget is then one chunk
    (128 tokens), so the same six turns take two prefill forwards in two steps, not one of 240 rows."""
    eng = make_engine(slots=8, max_seq=1024)
    loop = asyncio.get_running_loop()
    async with AsyncEngine(eng) as aeng:
        decoder = await aeng.open(corpus[:20])
        sessions = [await aeng.open(corpus[100 * i:100 * i + 64]) for i in range(6)]
        running = asyncio.ensure_future(decoder.generate(600, NOEOS))
        while aeng.scheduler.decoded_tokens < 2:
            await asyncio.sleep(0.002)
        t0, futures = time.monotonic(), []
        with aeng.scheduler.together():
            for i, s in enumerate(sessions):
                fut, sink = _future_sink(loop)
                aeng.scheduler.submit(Turn(s.id, suffix=corpus[700 + 40 * i:740 + 40 * i], max_new_tokens=1,
                                           sampling=NOEOS), sink)
                futures.append(fut)
        await asyncio.gather(*futures)
        steps = await records_when(async_read(aeng.scheduler.trace.since, t0),
                                   lambda rs: sum(r["prefill_tokens"] for r in rs) == 240)
        still_running = not running.done()
        running.cancel()
    assert still_running
    assert [r["prefill_tokens"] for r in steps if r["prefill_forwards"]] == [160, 80]


@pytest.mark.parametrize("streamed", ["all", "one", "none"])
@pytest.mark.parametrize("rederive_rows", [None, 64, 128])
async def test_a_bound_on_rederive_rows_spreads_a_crowds_grid_points_over_steps(make_engine, corpus, rederive_rows,
                                                                                streamed):
    """Five sessions that reach grid point 64 in the same step (one of them speculating; their generates are
    submitted together, so one step starts them all): unbounded, that step re-derives all five; with
    step_rederive_rows the streams past the bound sit the step out and re-derive in later ones (64 rows: one a
    step; 128: two), and every stream's tokens and logprobs stay its solo run's. The bound holds while one of
    the generates streams its tokens; with none streamed (whole results: RL turns, best-of-N), the step
    re-derives all five, the soonest every result is whole."""
    eng = make_engine(slots=6, max_seq=512, scheduler={"step_rederive_rows": rederive_rows})
    prompts = [corpus[100 * i:100 * i + 60] for i in range(5)]
    params = [NOEOS, SamplingParams(temperature=0.9, seed=3, ignore_eos=True), NOEOS,
              SamplingParams(ignore_eos=True, speculate=2), NOEOS]
    want = []
    for p, sp in zip(prompts, params):
        s = eng.open(p)
        want.append(eng.generate([s], 12, [sp])[0])
        s.close()
    async with AsyncEngine(eng) as aeng:
        sessions = [await aeng.open(p) for p in prompts]
        per_step: dict[int, int] = {}
        rederive = eng.table.rederive_grid_points

        def counted(group, *riding):
            per_step[aeng.scheduler.steps] = per_step.get(aeng.scheduler.steps, 0) + len(group)
            return rederive(group, *riding)
        eng.table.rederive_grid_points = counted
        loop, futures = asyncio.get_running_loop(), []
        try:
            events: list[TokenEvent] = []
            with aeng.scheduler.together():  # else a loaded box can start some before the rest arrive
                for i, (s, sp) in enumerate(zip(sessions, params)):
                    streams = streamed == "all" or (streamed == "one" and i == 2)
                    fut, sink = _future_sink(loop, events.append if streams else None)
                    aeng.scheduler.submit(Generate(s.id, 12, sp), sink)
                    futures.append(fut)
            got = await asyncio.gather(*futures)
        finally:
            del eng.table.rederive_grid_points
    for g, w in zip(got, want):
        assert g.tokens == w.tokens and g.logprobs == w.logprobs
    assert len(events) == {"all": 5, "one": 1, "none": 0}[streamed] * 12
    assert sum(per_step.values()) == 5
    most = 5 if rederive_rows is None or streamed == "none" else rederive_rows // 64
    assert max(per_step.values()) == most
    assert len(per_step) == -(-5 // most)


def test_a_crowds_rederivations_are_bounded_to_four_sessions_a_step_by_default(make_engine):
    """The default bound is 256 rows (four sessions a step): unbounded, a crowd in lockstep has an inter-token p99
    of 7.5x its median on an H100 (bench/RESULTS.md); None still asks for unbounded."""
    from capsulert.config.scheduler import SchedulerConfig
    from capsulert.scheduler.step_scheduler import StepScheduler

    assert SchedulerConfig().step_rederive_rows == 256
    for rows, sessions in ((None, 4), ({"step_rederive_rows": None}, None)):
        sch = StepScheduler(make_engine(slots=1, **({"scheduler": rows} if rows else {})))
        try:
            assert sch.rederive_sessions == sessions
        finally:
            sch.stop()


def test_a_rederive_bound_below_one_grid_chunk_is_refused():
    from pydantic import ValidationError

    from capsulert.config.scheduler import SchedulerConfig

    with pytest.raises(ValidationError, match="step_rederive_rows"):
        SchedulerConfig(step_rederive_rows=32)


async def test_a_crowd_whose_tails_replay_shares_one_forward_under_a_small_budget(make_engine, corpus):
    """Four sessions 60 tokens past their grid point, their tails kept: an 8-token turn each is 8 rows of work,
    not 68, so a 64-token step budget runs all four in one forward; each append equals its solo run."""
    eng = make_engine(slots=8, tail_replay=True, scheduler={"step_prefill_tokens": 64})
    contexts, turns = [corpus[50 * i:50 * i + 124] for i in range(4)], [corpus[900 + i:908 + i] for i in range(4)]
    want = []
    for c, t in zip(contexts, turns):
        s = eng.open(c)
        want.append(s.append(t))
        s.close()
    loop = asyncio.get_running_loop()
    async with AsyncEngine(eng) as aeng:
        sessions = [await aeng.open(c) for c in contexts]
        before = aeng.scheduler.prefill_forwards
        futures = []
        with aeng.scheduler.together():  # all four start in one step
            for s, t in zip(sessions, turns):
                fut, sink = _future_sink(loop)
                aeng.scheduler.submit(Append(s.id, t, logits=True), sink)
                futures.append(fut)
        got = await asyncio.gather(*futures)
        assert aeng.scheduler.prefill_forwards - before == 1
    for g, w in zip(got, want):
        assert torch.equal(torch.from_numpy(g.logits), w.cpu())
