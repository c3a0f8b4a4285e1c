"""Speculative decode is bitwise plain decode: tokens, logprobs, top logprobs, stop reasons and every state
buffer of the slot afterwards, greedy and seeded, alone and batched with plain sessions, across restore and
fork, with stops and max_tokens landing inside a draft, for the oracle drafter at 100% and lower acceptance and
for prompt lookup. Runs on the CPU in `make test` and on the GPU with `pytest --device cuda -m "" tests/worker`.
"""
import asyncio

import pytest
import torch

from capsulert.engine.speculation import ACCEPTANCE_FLOOR, PROBE_EVERY, DraftPacing
from capsulert.engine.drafters import (DraftRequest, Drafter, NgramDrafter, OracleDrafter, make_drafter,
                                       register_drafter, registered_drafters)
from capsulert.engine.drafters.mtp import MtpDrafter
from capsulert.engine.engine import GRID
from capsulert.errors import InvalidRequestError
from capsulert.protocol.constraint import Constraint
from capsulert.protocol.sampling import MAX_SPECULATE, SamplingParams
from capsulert.sessions.local import AsyncEngine
from tests.models import MODELS
from tests.worker.test_engine import assert_state_equal, slot_state

GREEDY = dict(ignore_eos=True, logprobs=3)
SEEDED = dict(temperature=0.9, top_k=50, top_p=0.95, seed=11, ignore_eos=True, logprobs=3)
MODES = [pytest.param(GREEDY, id="greedy"), pytest.param(SEEDED, id="seeded")]


@pytest.fixture
def prompt(engine):
    from capsulert.engine.default_model import CORPUS_PATH

    return engine.tokenize(CORPUS_PATH.read_text()[:3000])[:150]


@pytest.fixture
def headless_engine(default_model_dir, device, tmp_path):
    """The default model saved without its MTP head's weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    from capsulert.engine.engine import Engine

    path = tmp_path / "headless"
    shutil.copytree(default_model_dir, path)
    weights = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.startswith("mtp.")}, str(path / "model.safetensors"))
    engine = Engine.from_config(dict(model=str(path), device=device, slots=2, max_seq=512, prefill_chunk=128))
    assert not engine.runner.has_mtp
    return engine


def run(engine, prompt, n, sampling):
    """One session: prompt, generate n; its result and its slot's state afterwards."""
    s = engine.open()
    s.append(prompt)
    res = engine.generate([s], n, [sampling])[0]
    state = slot_state(engine, s)
    s.close()
    return res, state


# the plain (non-speculating) runs the speculating ones are compared with, by engine settings, prompt, length and
# sampling: many tests compare with the same one (every k and every acceptance level with the same 40-token run),
# so each is made once, in the first such test's own fresh engine, and the later tests' fresh engines (same
# settings) compare with what it recorded; CPU time. The module runs on one xdist worker (tests/conftest.py:
# WHOLE_FILES), so each is made once per run.
_PLAIN: dict = {}


def plain_run(engine, prompt, n, sampling):
    """run() of a plain sampling, made once per engine settings (see _PLAIN)."""
    assert not sampling.speculate
    key = (engine.config.model_dump_json(), tuple(prompt), n, repr(sampling))
    if key not in _PLAIN:
        _PLAIN[key] = run(engine, prompt, n, sampling)
    return _PLAIN[key]


def assert_same_output(got, want):
    assert list(got) == list(want)
    assert got.logprobs == want.logprobs
    assert got.top_logprobs == want.top_logprobs
    assert (got.stop_reason, got.length, got.text) == (want.stop_reason, want.length, want.text)


def plain_and_oracle(engine, prompt, n, mode, corrupt_every=0):
    """The plain run, and the oracle installed with its stream."""
    want, state = plain_run(engine, prompt, n, SamplingParams(**mode))
    engine.drafters.install(OracleDrafter([list(prompt) + list(want)], corrupt_every=corrupt_every))
    return want, state


# ------------------------------------------------------------------------------------------------ alone
@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", range(1, MAX_SPECULATE + 1))
def test_oracle_at_full_acceptance_equals_plain_decode(engine, prompt, mode, k):
    want, want_state = plain_and_oracle(engine, prompt, 40, mode)
    got, state = run(engine, prompt, 40, SamplingParams(**mode, speculate=k, speculate_drafter="oracle"))
    assert_same_output(got, want)
    assert_state_equal(state, want_state)
    assert got.drafted > 0 and got.accepted == got.drafted  # every draft was the plain run's token
    assert want.drafted == want.accepted == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k,every", [(3, 2), (3, 3), (2, 4), (1, 2)])
def test_oracle_at_lower_acceptance_equals_plain_decode(engine, prompt, mode, k, every):
    want, want_state = plain_and_oracle(engine, prompt, 40, mode, corrupt_every=every)
    got, state = run(engine, prompt, 40, SamplingParams(**mode, speculate=k, speculate_drafter="oracle"))
    assert_same_output(got, want)
    assert_state_equal(state, want_state)
    assert 0 < got.accepted < got.drafted  # rejections happened, and were rolled back


@pytest.mark.parametrize("mode", MODES)
def test_drafts_that_never_land_are_tried_one_step_in_probe_every(engine, prompt, mode):
    """Pacing: at 0% acceptance a stream drafts in its first two steps (its running acceptance 1 -> 0.5 ->
    0.25, under the floor) and then in one step of PROBE_EVERY; it commits plain decode's tokens throughout."""
    want, want_state = plain_and_oracle(engine, prompt, 40, mode, corrupt_every=1)
    got, state = run(engine, prompt, 40, SamplingParams(**mode, speculate=3, speculate_drafter="oracle"))
    assert_same_output(got, want)
    assert_state_equal(state, want_state)
    assert got.accepted == 0 and 0 < got.drafted <= 3 * (2 + 40 // PROBE_EVERY)  # 120 drafts without pacing


def test_draft_pacing_backs_off_below_the_floor_and_comes_back_when_drafts_land():
    pacing = DraftPacing()
    assert pacing.drafts_now() and pacing.acceptance == 1.0  # the first drafts are always tried
    pacing.verified(3, 0)
    assert pacing.drafts_now()  # 0.5: still worth it
    pacing.verified(3, 0)
    assert pacing.acceptance < ACCEPTANCE_FLOOR
    assert [pacing.drafts_now() for _ in range(2 * PROBE_EVERY)] == ([False] * (PROBE_EVERY - 1) + [True]) * 2
    pacing.verified(3, 3)  # a probe whose drafts all landed
    assert pacing.acceptance >= ACCEPTANCE_FLOOR and all(pacing.drafts_now() for _ in range(3))


@pytest.mark.parametrize("mode", MODES)
def test_ngram_drafter_equals_plain_decode(engine, mode):
    # 1,500 distinct ids: each token the model picks was seen before with odds of about 1 in 3, so prompt
    # lookup finds continuations (some right, some wrong) whatever the device's model computes
    vocab = engine.runner.model_cfg.vocab_size
    prompt = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:1500].tolist()
    want, want_state = run(engine, prompt, 48, SamplingParams(**mode))
    got, state = run(engine, prompt, 48, SamplingParams(**mode, speculate=3))  # ngram: the default drafter
    assert_same_output(got, want)
    assert_state_equal(state, want_state)
    assert got.drafted > 0


def test_drafts_never_change_the_output(engine, prompt):
    """A drafter proposing garbage (out of the vocabulary too) costs speed only."""
    class Noise(OracleDrafter):
        def propose(self, runner, requests):
            return [[(7 * len(r.tokens) + i) % 50 for i in range(r.k - 1)] + [10 ** 9] for r in requests]

    want, want_state = run(engine, prompt, 30, SamplingParams(**SEEDED))
    noise = Noise()
    engine.drafters.install(noise)
    got, state = run(engine, prompt, 30, SamplingParams(**SEEDED, speculate=3, speculate_drafter="oracle"))
    assert_same_output(got, want)
    assert_state_equal(state, want_state)


# ------------------------------------------------------------------------------------------------ batched
@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_mixed_batch_of_speculating_and_plain_sessions_equals_solo_plain_runs(make_engine, prompt):
    engine = make_engine(slots=5, speculate_slots=2)  # 3 speculating sessions, rollback room for 2 a step
    modes = [GREEDY, SEEDED, {**SEEDED, "seed": 5}, GREEDY, {**SEEDED, "temperature": 0.5}]
    prompts = [prompt[i * 20:i * 20 + 60 + 7 * i] for i in range(5)]
    solo = [run(engine, p, 30, SamplingParams(**m)) for p, m in zip(prompts, modes)]
    engine.drafters.install(OracleDrafter([list(p) + list(r) for p, (r, _) in zip(prompts, solo)], corrupt_every=3))
    spec = [dict(speculate=3, speculate_drafter="oracle"), {}, dict(speculate=2), dict(speculate=1, speculate_drafter="oracle"), {}]
    sessions = []
    for p in prompts:
        s = engine.open()
        s.append(p)
        sessions.append(s)
    got = engine.generate(sessions, 30, [SamplingParams(**m, **x) for m, x in zip(modes, spec)])
    for s, g, (want, want_state) in zip(sessions, got, solo):
        assert_same_output(g, want)
        assert_state_equal(slot_state(engine, s), want_state)
    assert got[0].drafted > 0 and got[3].drafted > 0


def test_speculate_slots_zero_decodes_plainly(make_engine, prompt):
    engine = make_engine(speculate_slots=0)
    want, want_state = plain_and_oracle(engine, prompt, 20, GREEDY)
    got, state = run(engine, prompt, 20, SamplingParams(**GREEDY, speculate=3, speculate_drafter="oracle"))
    assert_same_output(got, want)
    assert_state_equal(state, want_state)
    assert got.drafted == 0


# ------------------------------------------------------------------------------------------------ stops
@pytest.mark.parametrize("mode", MODES)
def test_stop_token_inside_a_draft_stops_where_plain_decode_does(engine, prompt, mode):
    free, _ = plain_run(engine, prompt, 40, SamplingParams(**mode))
    stop_id = free[17]  # stops plain decode at its first occurrence, wherever a draft holds it
    stopped = {**mode, "stop_token_ids": (stop_id,)}
    want, want_state = run(engine, prompt, 40, SamplingParams(**stopped))
    assert want.stop_reason == "stop_token"
    engine.drafters.install(OracleDrafter([list(prompt) + list(free)]))
    for k in (2, 3):
        got, state = run(engine, prompt, 40, SamplingParams(**stopped, speculate=k, speculate_drafter="oracle"))
        assert_same_output(got, want)
        assert_state_equal(state, want_state)


def test_stop_string_and_max_tokens_inside_a_draft(engine, prompt):
    free, _ = plain_run(engine, prompt, 40, SamplingParams(**GREEDY))
    engine.drafters.install(OracleDrafter([list(prompt) + list(free)]))
    stop = engine.detokenize(free[9:12])
    for mode, n in [({**GREEDY, "stop": (stop,)}, 40), (GREEDY, 10), (GREEDY, 11), (GREEDY, 1)]:
        want, want_state = run(engine, prompt, n, SamplingParams(**mode))
        got, state = run(engine, prompt, n, SamplingParams(**mode, speculate=3, speculate_drafter="oracle"))
        assert_same_output(got, want)
        assert_state_equal(state, want_state)


def test_max_seq_inside_a_draft(make_engine, prompt):
    engine = make_engine(max_seq=256)
    want, want_state = plain_and_oracle(engine, prompt, 120, GREEDY)
    assert want.stop_reason == "max_seq"
    got, state = run(engine, prompt, 120, SamplingParams(**GREEDY, speculate=3, speculate_drafter="oracle"))
    assert_same_output(got, want)
    assert_state_equal(state, want_state)


# ---------------------------------------------------------------------------------- grid, restore, fork
@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
@pytest.mark.parametrize("mode", MODES)
def test_crossing_grid_points_keeps_them_canonical(engine, prompt, mode):
    """Decode re-derives a grid point through the prefill path; a speculative step ends on it and does the
    same, so the checkpoint there is a cold prefill's and the continuation plain decode's."""
    p = prompt[:GRID - 2]
    want, want_state = plain_and_oracle(engine, p, 2 * GRID, mode)
    s = engine.open()
    s.append(p)
    got = engine.generate([s], 2 * GRID, [SamplingParams(**mode, speculate=3, speculate_drafter="oracle")])[0]
    assert_same_output(got, want)
    assert_state_equal(slot_state(engine, s), want_state)
    G = len(s) // GRID * GRID
    cold = engine.open()
    cold.append(s.tokens[:G])
    assert torch.equal(engine.state.ssm_grid[:, s.slot], engine.state.ssm_grid[:, cold.slot])
    assert torch.equal(engine.state.conv_grid[:, s.slot], engine.state.conv_grid[:, cold.slot])


@pytest.mark.parametrize("mode", MODES)
def test_across_snapshot_restore_and_fork(engine, prompt, mode):
    """generate(N) plain == speculating generate(k), snapshot, restore or fork, speculating generate(N - k)."""
    want, _ = plain_and_oracle(engine, prompt, 36, mode)
    spec = SamplingParams(**mode, speculate=3, speculate_drafter="oracle")
    s = engine.open()
    s.append(prompt)
    first = engine.generate([s], 13, [spec])[0]
    s.snapshot("mid")
    s.close()
    r = engine.restore("mid")
    rest = engine.generate([r], 23, [spec])[0]
    assert list(first) + list(rest) == list(want)
    assert first.logprobs + rest.logprobs == want.logprobs
    r.close()
    branches = engine.fork("mid", 2)
    outs = engine.generate(branches, 23, [spec, SamplingParams(**mode)])
    assert list(outs[0]) == list(outs[1]) == list(rest)
    assert_state_equal(slot_state(engine, branches[0]), slot_state(engine, branches[1]))


def test_async_engine_passes_speculate_through(engine, prompt):
    want, _ = plain_and_oracle(engine, prompt, 24, SEEDED)

    async def main():
        async with AsyncEngine(engine) as aeng:
            s = await aeng.open(prompt)
            res = await s.generate(24, SamplingParams(**SEEDED, speculate=2, speculate_drafter="oracle"))
            streamed = [ev.token async for ev in (await aeng.open(prompt)).stream(
                24, SamplingParams(**SEEDED, speculate=3, speculate_drafter="oracle")) if hasattr(ev, "token")]
            return res, streamed
    res, streamed = asyncio.run(main())
    assert list(res) == list(want) == streamed
    assert res.logprobs == want.logprobs
    assert res.drafted > 0


# ------------------------------------------------------------------------------------------------ rollback
def test_rollback_covers_every_buffer_a_decode_step_writes(engine, prompt):
    """Every buffer a decode step changes for its slot, but the per-token rows at its own position (the KV,
    and an MTP head's KV), is rolled back; a buffer a later layout adds is in the list unless it is per-token
    or prefill-only."""
    layout = engine.state.layout
    names = engine.runner.rollback.names
    assert set(names) == set(layout.rollback_names())
    assert {"ssm", "conv", "pos", "last_hidden"} <= set(names)
    assert not {"kv_k", "kv_v", "ssm_grid", "conv_grid"} & set(names)
    s = engine.open()
    s.append(prompt[:70])  # off the grid: a step there re-derives nothing
    before = {n: engine.state.slot_view(n, s.slot).clone() for n in layout.shapes()}
    s.generate(1)
    changed = {n for n in layout.shapes() if not torch.equal(before[n], engine.state.slot_view(n, s.slot))}
    assert changed - set(names) == set(layout.block_tensors) >= {"kv_k", "kv_v"}
    P = len(s) - 1  # only the row of the position fed changed in the per-token buffers
    for kv in layout.block_tensors:
        now = engine.state.slot_view(kv, s.slot)
        assert torch.equal(before[kv][:, :P], now[:, :P]) and torch.equal(before[kv][:, P + 1:], now[:, P + 1:])


def test_rollback_does_not_guess_from_shapes(make_engine, prompt):
    """max_seq 256 + a 256-token chunk: the KV holds 512 rows, as many as the default model's conv channels;
    the conv state is rolled back all the same."""
    engine = make_engine(max_seq=256, prefill_chunk=256)
    assert engine.state.layout.conv_dim == engine.state.layout.max_seq
    assert "conv" in engine.runner.rollback.names
    want, want_state = plain_and_oracle(engine, prompt[:128], 16, GREEDY, corrupt_every=2)
    got, state = run(engine, prompt[:128], 16, SamplingParams(**GREEDY, speculate=1, speculate_drafter="oracle"))
    assert_same_output(got, want)
    assert_state_equal(state, want_state)


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("bad", [dict(speculate=MAX_SPECULATE + 1), dict(speculate=-1), dict(speculate=True),
                                 dict(speculate="2"), dict(speculate_drafter=""), dict(speculate_drafter="No Such")])
def test_bad_speculation_fields_are_refused(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)


def test_speculation_with_a_constraint_is_refused():
    with pytest.raises(InvalidRequestError, match="constraint"):
        SamplingParams(speculate=2, constraint=Constraint(regex="[ab]+"))
    SamplingParams(speculate=0, constraint=Constraint(regex="[ab]+"))  # plain decode takes it


@pytest.mark.parametrize("drafter,match", [("nosuch", "unknown speculate_drafter"), ("mtp", "MTP head")])
def test_unknown_or_unservable_drafter_is_refused_before_anything_runs(headless_engine, prompt, drafter, match):
    """An unknown drafter, and the MTP drafter on a checkpoint without the head (no mtp.* weights)."""
    engine = headless_engine
    s = engine.open()
    s.append(prompt[:40])
    tokens = list(s.tokens)
    state = slot_state(engine, s)
    with pytest.raises(InvalidRequestError, match=match):
        engine.generate([s], 5, [SamplingParams(speculate=2, speculate_drafter=drafter)])
    assert s.tokens == tokens
    assert_state_equal(slot_state(engine, s), state)
    s.generate(2)  # the session is intact


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_the_mtp_drafter_speculates_bitwise_plain_decode(engine, prompt):
    """The model's MTP head drafts (ModelRunner.mtp_draft); verification keeps the output plain decode's."""
    plain, spec = engine.open(), engine.open()
    plain.append(prompt[:100])
    spec.append(prompt[:100])
    want = plain.generate(40, SamplingParams(ignore_eos=True))
    got = spec.generate(40, SamplingParams(ignore_eos=True, speculate=3, speculate_drafter="mtp"))
    assert list(got) == list(want) and got.logprobs == want.logprobs
    assert got.drafted > 0
    assert_state_equal(slot_state(engine, spec), slot_state(engine, plain))


# ------------------------------------------------------------------------------------------------ drafters
def test_registry_and_install():
    assert {"ngram", "oracle", "mtp"} <= set(registered_drafters())
    assert isinstance(make_drafter("ngram"), NgramDrafter)
    with pytest.raises(InvalidRequestError):
        make_drafter("nosuch")
    with pytest.raises(ValueError, match="already registered"):
        register_drafter("ngram")(NgramDrafter)

    class Unregistered(Drafter):
        def propose(self, runner, requests):
            return [[] for _ in requests]
    from capsulert.engine.drafters import Drafters
    with pytest.raises(InvalidRequestError):
        Drafters().install(Unregistered())


def test_ngram_proposes_what_followed_the_latest_longest_match():
    d = NgramDrafter()
    assert d.lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], 3) == [7, 8, 5]  # suffix (2, 3): its latest match
    assert d.lookup([4, 5, 6, 4, 5, 6, 1, 2, 5, 6], 2) == [1, 2]  # (5, 6) twice: the later one
    assert d.lookup([1, 2, 3, 4], 3) == []  # no earlier occurrence
    assert d.lookup([1, 2, 1], 5) == [2, 1]  # fewer than k follow
    assert d.lookup([1, 2, 1], 0) == []
    out = d.propose(None, [DraftRequest(0, [3, 4, 3], 1), DraftRequest(1, [5], 2)])
    assert out == [[4], []]


def test_oracle_follows_its_streams_and_corrupts_every_jth_index():
    class Runner:
        class model_cfg:
            vocab_size = 100
    stream = list(range(20, 40))
    assert OracleDrafter([stream]).propose(Runner, [DraftRequest(0, stream[:5], 3)]) == [stream[5:8]]
    got = OracleDrafter([stream], corrupt_every=3).propose(Runner, [DraftRequest(0, stream[:4], 4)])[0]
    # indices 4..7: index 5 ((5 + 1) % 3 == 0) is corrupted
    assert got == [24, 26, 26, 27]
    assert OracleDrafter([stream]).propose(Runner, [DraftRequest(0, [1, 2], 3)]) == [[]]  # not its stream
    with pytest.raises(InvalidRequestError):
        OracleDrafter([stream], corrupt_every=-1)


def test_mtp_drafter_calls_the_runners_head_when_it_has_one():
    calls = []

    class Runner:
        has_mtp = True

        def mtp_draft(self, slots, tokens, k):
            calls.append((slots, tokens, k))
            return torch.tensor([[t + 1 + i for i in range(k)] for t in tokens])
    out = MtpDrafter().propose(Runner(), [DraftRequest(3, [1, 2, 5], 2), DraftRequest(4, [9], 3),
                                         DraftRequest(6, [4], 0)])
    assert out == [[6, 7], [10, 11, 12], []]
    assert calls == [([3, 4], [5, 9], 3)]
    class Headless:
        has_mtp = False
    with pytest.raises(InvalidRequestError, match="MTP head"):
        MtpDrafter().propose(Headless(), [DraftRequest(0, [1], 1)])


# ------------------------------------------------------------------------------------------------ CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_cuda_batch_of_eight_speculating_equals_plain(make_engine, prompt, graphs):
    """On the GPU (graph replay or eager, the padded sampling block): 8 sessions, half speculating with the
    oracle at lower acceptance, half with prompt lookup, each bitwise its plain run."""
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device: run with -m gpu --device cuda on the GPU machine")
    engine = make_engine(device="cuda", slots=8, cuda_graphs=graphs)
    prompts = [prompt[i * 9:i * 9 + 70 + i] for i in range(8)]
    modes = [GREEDY if i % 2 else {**SEEDED, "seed": i} for i in range(8)]
    solo = [run(engine, p, 40, SamplingParams(**m)) for p, m in zip(prompts, modes)]
    engine.drafters.install(OracleDrafter([list(p) + list(r) for p, (r, _) in zip(prompts, solo)], corrupt_every=3))
    sessions = []
    for p in prompts:
        s = engine.open()
        s.append(p)
        sessions.append(s)
    params = [SamplingParams(**m, speculate=3, speculate_drafter="oracle" if i < 4 else "ngram")
              for i, m in enumerate(modes)]
    got = engine.generate(sessions, 40, params)
    for s, g, (want, want_state) in zip(sessions, got, solo):
        assert_same_output(g, want)
        assert_state_equal(slot_state(engine, s), want_state)
