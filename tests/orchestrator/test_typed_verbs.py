"""One typed verb set through every layer: the actor has one entry point (no method names), every caller
(RemoteSession, Namespace, Orchestrator, the schedulers) sends typed requests, a pinned snapshot persists
the same way whatever made it, restore_append_generate is one verb on a namespace and on a session, and
best_of_n / tree_search are served by the worker's batched decode steps, each branch equal to its solo run."""
import asyncio
import inspect
import time

import pytest
import pytest_asyncio

from capsulert.capsule_store.capsule import CapsuleRef
from capsulert.errors import InvalidRequestError, WorkerLost
from capsulert.orchestrator import EpisodeDriver, Orchestrator, Thought, best_of_n, tree_search
from capsulert.worker.actor import WorkerActorBody
from capsulert.worker.core import WorkerCore
from capsulert import protocol as verbs
from capsulert.sessions.local import AsyncEngine
from capsulert.protocol.sampling import SamplingParams
from capsulert.protocol.results import GenerateResult
from capsulert.protocol.requests import ListCapsules, Open, Request, Snapshot, Stats, Turn
from tests.orchestrator.processes import kill_and_wait
from tests.step_records import records_when

pytestmark = pytest.mark.asyncio(loop_scope="session")
PROMPT = "A typed request goes through every layer unchanged, and one handler runs it. "
NOEOS = SamplingParams(ignore_eos=True)


async def _records(orch, since: float, ready) -> list[dict]:
    """Worker 0's step records since `since`, once `ready(records)` holds (a step's record is kept once the
    step is over, which may be after its replies went out)."""
    async def read() -> list[dict]:
        return (await orch.stats(steps_since=since))[0]["recent_steps"]
    return await records_when(read, ready)


def _request_types() -> set[type]:
    """Every verb: the request classes nothing derives from (StoreRequest, ControlRequest are bases)."""
    out, todo = set(), [Request]
    while todo:
        subs = todo.pop().__subclasses__()
        out.update(s for s in subs if not s.__subclasses__())
        todo.extend(subs)
    return out


def _requests(spy) -> list[Request]:
    """Every request the spy saw in order, each Batch's and Streamed's right after their wrapper (a Batch
    carries coalesced calls; a Streamed, a request whose reply comes through the event feed)."""
    out: list[Request] = []

    def add(r: Request) -> None:
        out.append(r)
        for inner in r.requests if isinstance(r, verbs.Batch) else [r.request] if isinstance(r, verbs.Streamed) else []:
            add(inner)
    for _, args in spy.calls:
        add(args[0])
    return out


class HandleSpy:
    """Stands in for a worker's actor handle and records every actor method reached and its arguments."""

    def __init__(self, handle):
        self.handle, self.calls = handle, []

    def __getattr__(self, name):
        return _MethodSpy(self.calls, name, getattr(self.handle, name))


class _MethodSpy:
    def __init__(self, calls, name, method):
        self.calls, self.name, self.method = calls, name, method

    def options(self, **kw):
        return _MethodSpy(self.calls, self.name, self.method.options(**kw))

    def remote(self, *args, **kwargs):
        self.calls.append((self.name, args))
        return self.method.remote(*args, **kwargs)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def orch_tv(ray_session, engine_cfg, tmp_path_factory):
    disk = tmp_path_factory.mktemp("typed-verbs")
    o = await Orchestrator.start(dict(engine={**engine_cfg, "slots": 16, "disk_dir": str(disk)}, call_timeout_s=60,
                                      max_restarts=2, torch_threads=1))
    yield o
    await o.close()


@pytest.fixture
def spy(orch_tv):
    worker = orch_tv.workers[0]
    real = worker.handle
    worker.handle = HandleSpy(real)
    feed = orch_tv.pool.feeds.pop(0, None)  # opened at start: the next stream opens it again, through the spy
    if feed is not None:
        feed.task.cancel()
    yield worker.handle
    worker.handle = real


# ---------------------------------------------------------------------- the entry point
async def test_every_verb_is_a_request_type_with_one_handler_and_the_actor_one_entry_point():
    types = _request_types()
    assert {t.__name__ for t in types} >= {"Open", "Append", "Generate", "Snapshot", "Restore", "Fork", "Close", "Turn",
                                           "Delete", "Promote", "Demote", "ExportCapsule", "ImportCapsule", "Ping"}
    simple = {t for t in types if issubclass(t, verbs.SessionVerb)}  # simple session verbs: routed by their type
    assert set(WorkerCore.HANDLERS) == types - simple  # each request type has exactly one handler, nothing else does
    assert all(WorkerCore.handler(t) is WorkerCore.HANDLERS[verbs.Generate] for t in simple)
    assert all(t.lane in verbs.LANES for t in types)
    public = {n for n, _ in inspect.getmembers(WorkerActorBody, inspect.isfunction) if not n.startswith("_")}
    assert public == {"execute", "stream"}


async def test_rerun_rules_follow_from_the_request_type():
    # memory-only requests naming no existing session run again on a restarted worker; the others do not
    assert Open("x").rerunnable and verbs.Fork("c", 2).rerunnable and verbs.Restore("c").rerunnable
    assert Turn(None, "c", " x", 2, close=True).rerunnable and verbs.ExportCapsule("c").rerunnable
    assert Stats().rerunnable and ListCapsules().rerunnable and verbs.Ping().rerunnable
    assert not verbs.Restore("c", into=7).rerunnable  # its session died with the old process
    assert not Turn(7, "c", " x", 2).rerunnable and not verbs.Generate(7, 2).rerunnable
    assert not Snapshot(7, "c").rerunnable and not verbs.Append(7, [1]).rerunnable
    assert not verbs.Delete("c").rerunnable and not verbs.ImportCapsule(None).rerunnable  # they persist
    assert verbs.Restore("c", into=7).target == 7 and Turn(None, "c").target is None


async def test_method_names_are_refused_at_every_layer(orch_tv, engine_cfg, tmp_path):
    with pytest.raises(InvalidRequestError):
        await orch_tv.call(0, "snapshot")
    core = WorkerCore(engine_cfg, persist_dir=str(tmp_path))
    try:
        for bad in ("open", {"verb": "open"}, Request()):
            with pytest.raises(InvalidRequestError):
                core.execute(bad)
        with pytest.raises(InvalidRequestError):
            next(core.stream(Open(PROMPT)))  # noqa: B018
        with pytest.raises(InvalidRequestError, match="names a session, a call or both"):
            core.execute(verbs.Interrupt(None, None))  # it would name every call not on a session yet
        assert core.execute(verbs.Interrupt(None, "a call")) is False  # by call id alone: no session to report
    finally:
        core.scheduler.stop()


async def test_every_caller_sends_typed_requests_to_the_one_entry_point(orch_tv, spy):
    orch = orch_tv
    acme = orch.namespace("tv-acme")
    s = await acme.open(PROMPT)
    await s.append(" more", logits=True)
    await s.generate(2)
    _ = [ev async for ev in s.stream(2)]
    await s.snapshot("tv-c")
    await s.restore("tv-c")
    await s.turn(" t", 2)
    await acme.restore_append_generate("tv-c", " x", 2)
    branches = await acme.fork("tv-c", 2)
    await acme.generate(branches, 2)
    await best_of_n(acme, "tv-c", " y", 2, 2)
    await tree_search(acme, "tv-c", lambda n: [" a", " b"], lambda n: sum(n.tokens), width=1, depth=2, max_new_tokens=2)
    await acme.capsules()
    await orch.stats()
    await asyncio.gather(s.close(), *(b.close() for b in branches))
    await acme.delete("tv-c")
    assert {name for name, _ in spy.calls} == {"execute", "stream"}
    sent = _requests(spy)
    assert all(isinstance(r, Request) for r in sent)
    assert {type(r).__name__ for r in sent} >= {"Open", "Append", "Generate", "Snapshot", "Restore", "Turn", "Fork",
                                                "Close", "Delete", "ListCapsules", "Stats"}
    assert all(r.namespace == "tv-acme" for r in sent if getattr(r, "namespace", None) not in (None,))


# ---------------------------------------------------------------------- snapshot: one path
async def test_a_pin_persists_the_same_through_every_entry_point(orch_tv, make_engine):
    orch = orch_tv
    acme = orch.namespace("tv-pins")
    via_session, via_namespace, raw = await orch.open(PROMPT), await acme.open(PROMPT), await acme.open(PROMPT)
    refs = [await via_session.snapshot("pin-a", pin=True), await via_namespace.snapshot("pin-b", pin=True),
            # a Snapshot request sent as it is (past the router): the worker's one snapshot path persists it too
            await orch.call(0, Snapshot(raw.sid, "pin-c", pin=True, namespace="tv-pins"))]
    async with AsyncEngine(make_engine()) as aeng:  # in-process: the same reply type
        refs.append(await (await aeng.open(PROMPT)).snapshot("pin-local", pin=True))
    assert all(type(r) is CapsuleRef for r in refs)
    assert [(r.name, r.namespace, r.boundary) for r in refs[:3]] == [
        ("pin-a", "default", via_session.length), ("pin-b", "tv-pins", via_namespace.length),
        ("pin-c", "tv-pins", raw.length)]
    # continuing a live session equals restoring its capsule
    before = [await x.append_generate(" go", 4, NOEOS) for x in (via_session, via_namespace, raw)]

    await kill_and_wait(via_session.pid)  # the worker restarts and reloads what was pinned
    after = [await orch.restore_append_generate("pin-a", " go", 4, NOEOS),  # waits for the restart
             await acme.restore_append_generate("pin-b", " go", 4, NOEOS),
             await orch.call(0, Turn(None, "pin-c", " go", 4, NOEOS, "tv-pins", close=True))]
    assert after == before and [a.logprobs for a in after] == [b.logprobs for b in before]
    assert [(c["name"], c["pinned"]) for c in await orch.capsules()] == [("pin-a", True)]
    assert [(c["name"], c["pinned"]) for c in await acme.capsules()] == [("pin-b", True), ("pin-c", True)]
    assert (await orch.health())[0]["pid"] != via_session.pid
    await asyncio.gather(orch.delete("pin-a"), acme.delete("pin-b"))
    await orch.call(0, verbs.Delete("pin-c", "tv-pins"))


async def test_worker_core_persists_a_pinned_snapshot_for_the_next_process(engine_cfg, tmp_path):
    core = WorkerCore(engine_cfg, persist_dir=str(tmp_path))
    info = core.execute(Open(PROMPT))
    ref = core.execute(Snapshot(info.session, "core-pin", pin=True, namespace="ns"))
    want = core.execute(Turn(None, "core-pin", " go", 4, NOEOS, "ns", close=True))
    core.scheduler.stop()
    assert type(ref) is CapsuleRef and len(list(tmp_path.iterdir())) == 1
    again = WorkerCore(engine_cfg, persist_dir=str(tmp_path))  # the process Ray starts in its place
    try:
        assert again.reloaded == ["core-pin"]
        assert [(r["name"], r["pinned"]) for r in again.execute(ListCapsules("ns"))] == [("core-pin", True)]
        got = again.execute(Turn(None, "core-pin", " go", 4, NOEOS, "ns", close=True))
        assert got == want and got.logprobs == want.logprobs
    finally:
        again.scheduler.stop()


# ---------------------------------------------------------------------- restore_append_generate: one verb
async def test_restore_append_generate_is_one_verb_on_a_namespace_and_a_session(orch_tv, spy):
    orch = orch_tv
    maker = await orch.open(PROMPT)
    await maker.snapshot("rag-c")
    sp = SamplingParams(temperature=0.8, seed=3, ignore_eos=True)
    sessions_before = (await orch.stats())[0]["sessions"]
    from_namespace = await orch.restore_append_generate("rag-c", " next", 6, sp)  # a new session, closed after
    assert (await orch.stats())[0]["sessions"] == sessions_before
    s = await orch.open(" another context entirely")
    from_session = await s.restore_append_generate("rag-c", " next", 6, sp)  # this session, rolled back in place
    kept, from_kept = await orch.restore_branch("rag-c", " next", 6, sp)
    for res in (from_namespace, from_session, from_kept):
        assert type(res) is GenerateResult
        assert (list(res), res.logprobs, res.stop_reason, res.length, res.text) == (
            list(from_session), from_session.logprobs, "length", from_session.length, from_session.text)
    assert s.length == kept.length == from_session.length and await s.tokens() == await kept.tokens()
    turns = [r for r in _requests(spy) if isinstance(r, Turn)]
    assert [(t.session, t.restore, t.close) for t in turns] == [
        (None, "rag-c", True), (s.sid, "rag-c", False), (None, "rag-c", False)]
    await asyncio.gather(maker.close(), s.close(), kept.close())
    await orch.delete("rag-c")


async def test_append_generate_on_a_namespace_is_one_request(orch_tv, spy):
    """A new session, the prompt, a generate and the close in one Turn: what an HTTP completion sends."""
    orch = orch_tv
    sp = SamplingParams(temperature=0.8, seed=4, ignore_eos=True)
    sessions_before = (await orch.stats())[0]["sessions"]
    spy.calls.clear()
    res = await orch.default.append_generate(PROMPT, 5, sp)
    turns = [r for r in _requests(spy) if isinstance(r, Turn)]
    executed = [args[0] for name, args in spy.calls if name == "execute"]  # the feed may open too, as "stream"
    assert [(t.session, t.restore, t.close) for t in turns] == [(None, None, True)] and len(executed) == 1
    assert (await orch.stats())[0]["sessions"] == sessions_before
    s = await orch.open()
    assert list(await s.turn(PROMPT, 5, sp)) == list(res)
    await s.close()


# ---------------------------------------------------------------------- thin schedulers
async def _capsule(orch, name: str) -> str:
    maker = await orch.open(PROMPT)
    await maker.snapshot(name)
    await maker.close()
    return name


async def _counting_steps(orch, work):
    """(what `work` returned, the decode steps the worker ran meanwhile)."""
    before = (await orch.stats())[0]["decode_steps"]
    out = await work
    return out, (await orch.stats())[0]["decode_steps"] - before


async def test_best_of_n_branches_share_decode_steps_and_equal_their_solo_runs(orch_tv, oracle):
    orch, n, new = orch_tv, 6, 12
    base = SamplingParams(temperature=0.9, top_p=0.95, seed=40, ignore_eos=True)
    cands, steps = await _counting_steps(orch, best_of_n(orch, await _capsule(orch, "bon-c"), " Answer:", n, new, base))
    assert new <= steps < n * new // 2  # served by the worker's step scheduler, branches batched
    e = oracle.open()
    e.append(PROMPT)
    e.snapshot("bon-solo")
    e.close()
    try:
        for c in cands:
            r = oracle.restore("bon-solo")
            r.append(" Answer:")
            solo = r.generate(new, base.model_copy(update={"seed": 40 + c.index}))
            r.close()
            assert c.tokens == list(solo) and c.text == solo.text and c.stop_reason == "length", c.index
    finally:
        oracle.store.delete("bon-solo")
    await orch.delete("bon-c")


async def test_a_best_of_n_burst_reaches_the_worker_as_one_batch_and_one_prefill_forward(orch_tv, spy):
    """best_of_n's branches are requests made at the same moment: they travel as one Batch through the event
    feed, so the worker starts all of them in one step, prefills their suffixes in one forward, and decodes
    every branch in every step (sent one call each, the first one or two started alone and the rest trickled
    in while those decoded)."""
    orch, n, new = orch_tv, 8, 3
    c0 = await _capsule(orch, "burst-c")
    suffix = " Answer:"
    spy.calls.clear()
    t0 = time.monotonic()
    cands = await best_of_n(orch, c0, suffix, n, new, SamplingParams(temperature=0.9, seed=3, ignore_eos=True))
    executed = [args[0] for name, args in spy.calls if name == "execute"]
    assert [type(c) for c in executed] == [verbs.Batch]
    assert [type(r.request) for r in executed[0].requests] == [Turn] * n
    steps = await _records(orch, t0, lambda rs: sum(r["decode_rows"] for r in rs) == n * new)
    assert steps[0]["started"] == n and sum(r["started"] for r in steps) == n
    assert [r["prefill_forwards"] for r in steps if r["prefill_forwards"]] == [1]
    assert [r["decode_rows"] for r in steps if r["decode_rows"]] == [n] * new
    assert [len(c.tokens) for c in cands] == [new] * n
    await orch.delete(c0)


async def test_tree_search_children_share_decode_steps(orch_tv):
    orch = orch_tv
    children = [Thought(" First,"), Thought(" So"), Thought(" Then")]
    search = tree_search(orch, await _capsule(orch, "tree-c"), lambda n: children, lambda n: sum(n.tokens) % 97,
                         width=2, depth=2, max_new_tokens=6)
    beam, steps = await _counting_steps(orch, search)
    nodes = 3 + 2 * 3  # the root's children, then the two kept nodes' children
    assert 2 * 6 <= steps < nodes * 6 // 2 and len(beam) == 2
    assert [c["name"] for c in await orch.capsules()] == ["tree-c"]  # node capsules deleted
    await orch.delete("tree-c")


async def test_episode_envs_share_decode_steps(orch_tv):
    orch = orch_tv
    async with EpisodeDriver(orch, await _capsule(orch, "ep-c"), n_envs=4, max_new_tokens=6, sampling=NOEOS) as drv:
        rollout = drv.run(lambda ep, step, action: None if step == 2 else f" obs {ep}.{step}", episodes=4)
        trajs, steps = await _counting_steps(orch, rollout)
    assert [len(t.steps) for t in trajs] == [2] * 4
    assert 2 * 6 <= steps < 4 * 2 * 6 // 2  # each env's turns are its own requests, decoded together
    await orch.delete("ep-c")


async def test_an_env_step_of_a_crowd_is_one_prefill_forward_then_one_decode_step_a_token(orch_tv):
    """The envs' step() calls of one env step reach the worker together and, no env decoding, fill one crowd
    forward: 8 observations of 24+ tokens (past the 128-token chunk, which held only six of them a step and started
    the envs decoding in two groups) are one prefill forward, and every decode step after it decodes all 8."""
    orch = orch_tv
    maker = await orch.open(PROMPT)
    c0, held = "crowd-c", maker.length
    await maker.snapshot(c0)
    await maker.close()
    n = next(k for k in range(24, 100) if 1 <= (held + k) % 64 <= 60)  # no grid point in the 3 decoded tokens
    obs = list(range(300, 300 + n))
    async with EpisodeDriver(orch, c0, n_envs=8, max_new_tokens=3, sampling=NOEOS) as drv:
        await asyncio.gather(*(drv.reset(i) for i in range(8)))
        t0 = time.monotonic()
        actions = await asyncio.gather(*(drv.step(i, obs) for i in range(8)))

        async def read() -> list[dict]:
            return (await orch.stats(steps_since=t0))[0]["recent_steps"]
        steps = await records_when(read, lambda rs: sum(r["decode_rows"] for r in rs) == 8 * 3)
    assert len({tuple(a.tokens) for a in actions}) == 1  # the same start, observation and greedy sampling
    assert [(r["prefill_forwards"], r["prefill_tokens"]) for r in steps if r["prefill_forwards"]] == [(1, 8 * n)]
    assert [r["decode_rows"] for r in steps if r["decode_rows"]] == [8, 8, 8]
    await orch.delete(c0)


# ---------------------------------------------------------------------- coalesced short requests
async def test_concurrent_resets_travel_as_one_batch_and_equal_fresh_restores(orch_tv, spy):
    s = await orch_tv.open(PROMPT)
    await s.snapshot("reset-c0")
    n = s.length
    await s.close()
    envs = [await orch_tv.restore("reset-c0") for _ in range(6)]
    for e in envs:
        await e.generate(3, NOEOS)  # every env leaves C0
    spy.calls.clear()
    tiers = await asyncio.gather(*(e.restore("reset-c0") for e in envs))
    assert [type(args[0]) for _, args in spy.calls] == [verbs.Batch]  # one round trip for six resets
    assert [type(r) for r in spy.calls[0][1][0].requests] == [verbs.Restore] * 6
    assert len(set(tiers)) == 1 and all(e.length == n for e in envs)
    fresh = await orch_tv.restore("reset-c0")
    want = await fresh.generate(5, NOEOS)
    got = await asyncio.gather(*(e.generate(5, NOEOS) for e in envs))
    assert all(g.tokens == want.tokens and g.logprobs == want.logprobs for g in got)
    # a refusal inside a batch is its own caller's error only
    spy.calls.clear()
    bad, good = await asyncio.gather(orch_tv.call(0, verbs.Restore("reset-c0", into=987654321)),
                                     envs[1].restore("reset-c0"), return_exceptions=True)
    assert [type(args[0]) for _, args in spy.calls] == [verbs.Batch]
    assert isinstance(bad, WorkerLost) and good == tiers[1]
    await asyncio.gather(fresh.close(), *(e.close() for e in envs))
    assert [type(args[0]) for _, args in spy.calls[-1:]] == [verbs.Batch]  # the closes travel together too


async def test_a_crowds_appends_travel_as_one_batch_start_in_one_step_and_equal_solo_appends(orch_tv, spy, fresh):
    turns = [f" turn {i}: " + "word " * (3 + 5 * i) for i in range(6)]
    envs = [await orch_tv.open(PROMPT) for _ in turns]
    held = envs[0].length
    spy.calls.clear()
    t0 = time.monotonic()
    logits = await asyncio.gather(*(e.append(t, logits=True) for e, t in zip(envs, turns)))
    calls = [args[0] for name, args in spy.calls if name == "execute"]  # the event feed reopened: a "stream"
    assert [type(c) for c in calls] == [verbs.Batch]  # one round trip for six appends
    sent = calls[0].requests
    assert [type(r) for r in sent] == [verbs.Streamed] * 6 and [type(r.request) for r in sent] == [verbs.Append] * 6
    new = sum(e.length - held for e in envs)
    steps = await _records(orch_tv, t0, lambda rs: sum(r["prefill_tokens"] for r in rs) == new)
    # together: the first step starts all six and prefills them in one forward (the step budget takes the rest)
    assert (steps[0]["started"], steps[0]["prefill_forwards"]) == (6, 1) and sum(r["started"] for r in steps) == 6
    for e, t, got in zip(envs, turns, logits):
        solo = fresh.open()
        solo.append(PROMPT)
        want = solo.append(t).numpy()
        assert e.length == len(solo.tokens) and (got == want).all()
        solo.close()
    # a refusal inside the batch is its own caller's error only
    await envs[0].close()
    n = envs[1].length
    spy.calls.clear()
    closed, ok = await asyncio.gather(orch_tv.call(0, verbs.Append(envs[0].id, [5, 6])), envs[1].append([5, 6]),
                                      return_exceptions=True)
    assert [type(args[0]) for name, args in spy.calls if name == "execute"] == [verbs.Batch]
    assert isinstance(closed, WorkerLost) and ok == envs[1].length == n + 2  # as the session, not on it
    await asyncio.gather(*(e.close() for e in envs[1:]))


async def test_turns_started_together_travel_as_one_batch_without_token_events_and_equal_solo_turns(orch_tv, spy):
    s = await orch_tv.open(PROMPT)
    await s.snapshot("turns-c0")
    await s.close()
    envs = [await orch_tv.restore("turns-c0") for _ in range(4)]
    spy.calls.clear()
    t0 = time.monotonic()
    got = await asyncio.gather(*(e.turn(f" obs {i}", 4, NOEOS) for i, e in enumerate(envs)))
    calls = [args[0] for name, args in spy.calls if name == "execute"]
    assert [type(c) for c in calls] == [verbs.Batch]  # one round trip for four env steps
    assert all(type(r) is verbs.Streamed and type(r.request) is Turn and r.events is False for r in calls[0].requests)
    steps = await _records(orch_tv, t0, lambda rs: sum(r["decode_rows"] for r in rs) == 16)
    assert steps[0]["started"] == 4 and max(r["decode_rows"] for r in steps) == 4  # started and decoded together
    for i, res in enumerate(got):
        alone = await orch_tv.restore("turns-c0")
        want = await alone.turn(f" obs {i}", 4, NOEOS)
        assert (list(res), res.logprobs, res.length) == (list(want), want.logprobs, want.length)
        await alone.close()
    await asyncio.gather(*(e.close() for e in envs))
    await orch_tv.delete("turns-c0")


async def test_an_appends_reply_comes_when_it_is_done_not_when_its_batch_is(orch_tv):
    long, short = await orch_tv.open(PROMPT), await orch_tv.open(PROMPT)
    done: list[str] = []

    async def append(name, s, tokens):
        await s.append(tokens)
        done.append(name)

    # one batch: the long prompt takes several steps' prefill budget, the short one is done in the first step
    await asyncio.gather(append("short", short, [5, 6, 7]), append("long", long, list(range(10, 10 + 900))))
    assert done == ["short", "long"]
    assert long.length == short.length + 897
    await asyncio.gather(long.close(), short.close())


async def test_a_lagging_stream_consumer_gets_the_events_in_fewer_items(engine_cfg, tmp_path):
    core = WorkerCore(engine_cfg, persist_dir=str(tmp_path))
    try:
        sid = core.execute(Open(PROMPT)).session
        items = core.stream(verbs.Generate(sid, 24, NOEOS))
        first = next(items)  # blocks until the first token; then the consumer lags while the worker decodes
        await asyncio.sleep(1.0)
        rest = list(items)
        events = first + [e for item in rest for e in item]
        assert isinstance(events[-1], verbs.FinalEvent) and len(events) == 25
        assert [e.index for e in events[:-1]] == list(range(24))
        assert events[-1].result.tokens == [e.token for e in events[:-1]]
        assert len(rest) < 24 and max(len(i) for i in rest) > 1  # coalesced while nobody was reading
    finally:
        core.scheduler.stop()
