"""Exactness contract v2: canonical grid state and batch-invariant decode and sampling.

Every comparison is bitwise (torch.equal / token lists). Runs on CPU in `make test`; the same tests run on
the GPU with `pytest --device cuda -m "" tests/worker`.
"""
import pytest
import torch

from capsulert.errors import InvalidRequestError
from capsulert.engine.engine import GRID
from capsulert.protocol.sampling import SamplingParams
from tests.worker.test_engine import slot_state
from tests.models import MODELS

CHUNK = GRID  # the grid where canonical state is kept (the make_engine fixture prefills in pieces of 128)
SEEDED = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=7, ignore_eos=True)
GREEDY = SamplingParams(ignore_eos=True)  # these tests need long generations: EOS must not end them


@pytest.fixture
def corpus(engine):
    from capsulert.engine.default_model import CORPUS_PATH

    return engine.tokenize(CORPUS_PATH.read_text()[:40000])


def grid_state(engine, session, G):
    """What a snapshot at grid point G must hold: KV [0, G) and the grid checkpoint."""
    st, s = engine.state, session.slot
    return {"kv_k": st.kv_k[:, s, :G].clone(), "kv_v": st.kv_v[:, s, :G].clone(),
            "ssm": st.ssm_grid[:, s].clone(), "conv": st.conv_grid[:, s].clone()}


def cold_grid_state(engine, tokens, G):
    cold = engine.open()
    cold.append(tokens[:G])
    state = grid_state(engine, cold, G)
    cold.close()
    return state


def assert_equal_dicts(a, b):
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_generate_across_grid_then_restore_append_equals_cold(engine, corpus, sampling):
    prompt = corpus[:CHUNK - 5]
    s = engine.open()
    s.append(prompt)
    s.generate(10, sampling)  # crosses the grid point at CHUNK
    s.snapshot("g")
    r = engine.restore("g")
    got = r.append(corpus[500:503])
    cold = engine.open()
    want = cold.append(s.tokens + corpus[500:503])
    assert torch.equal(got, want)
    assert_equal_dicts(grid_state(engine, s, CHUNK), cold_grid_state(engine, s.tokens, CHUNK))


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_batched_generate_keeps_every_grid_point_canonical(make_engine, corpus):
    engine = make_engine(slots=5)
    sessions = []
    for i, n in enumerate((20, 100, 127, 128)):
        s = engine.open()
        s.append(corpus[i * 300:i * 300 + n])
        sessions.append(s)
    engine.generate(sessions, 3 * CHUNK + 7, [SEEDED, GREEDY, SEEDED, GREEDY])
    for s in sessions:
        G = len(s) // CHUNK * CHUNK
        assert G >= 3 * CHUNK
        assert_equal_dicts(grid_state(engine, s, G), cold_grid_state(engine, s.tokens, G))


# the uninterrupted generate of N tokens, per model and sampling: the same for every split point k, so it is made
# once, in the first such test's own fresh engine (same settings as every other's), and the other split points
# are compared with what it recorded (its tokens, logprobs, last logits and slot state); CPU time. The tests of
# a (model, sampling) run on one xdist worker (tests/conftest.py: TEST_GROUPS), so it is made once per run.
_WHOLE: dict = {}


def whole_run(engine, model_dir, corpus, N, sampling):
    key = (str(model_dir), N, repr(sampling))
    if key not in _WHOLE:
        whole = engine.open()
        whole.append(corpus[:60])
        full = engine.generate([whole], N, [sampling])[0]
        # left open, as before: the session restored next never lands in the slot of the state it must equal
        _WHOLE[key] = (full, whole.logits().clone(), slot_state(engine, whole))
    return _WHOLE[key]


# every split point and sampling mode on the dense model; the MoE on one (CPU time)
@pytest.mark.parametrize("model_dir,k,sampling", [
    pytest.param("dense", k, sampling, id=f"dense-{kid}-{sid}")
    for k, kid in [(37, "off-grid"), (CHUNK, "on-grid"), (2 * CHUNK - 1, "one-short")]
    for sampling, sid in [(GREEDY, "greedy"), (SEEDED, "seeded")]
] + [pytest.param("moe", 37, SEEDED, id="moe-off-grid-seeded")], indirect=["model_dir"])
def test_generate_n_equals_generate_k_snapshot_restore_generate_rest(engine, model_dir, corpus, k, sampling):
    N = 3 * CHUNK + 11  # crosses 3 grid points
    full, whole_logits, whole_state = whole_run(engine, model_dir, corpus, N, sampling)
    split = engine.open()
    split.append(corpus[:60])
    first = engine.generate([split], k, [sampling])[0]
    split.snapshot("k")
    split.close()
    resumed = engine.restore("k")
    rest = engine.generate([resumed], N - k, [sampling])[0]
    assert first.tokens + rest.tokens == full.tokens
    assert first.logprobs + rest.logprobs == full.logprobs
    assert torch.equal(resumed.logits(), whole_logits)
    assert_equal_dicts(slot_state(engine, resumed), whole_state)


def _step_alone_and_in_batch(engine, corpus, batch, position, sampling):
    """One session's one-token decode alone vs among batch-1 partners of other lengths."""
    alone = engine.open()
    alone.append(corpus[:150])
    solo = engine.generate([alone], 2, [sampling])[0]
    solo_state, solo_logits = slot_state(engine, alone), alone.logits()
    alone.close()
    me = engine.open()
    me.append(corpus[:150])
    partners = []
    for j in range(batch - 1):
        p = engine.open()
        p.append(corpus[1000 + 37 * j:1000 + 37 * j + 5 + 61 * j])
        partners.append(p)
    group = partners[:position] + [me] + partners[position:]
    params = [SamplingParams(temperature=0.7, seed=j, ignore_eos=True) for j in range(len(group))]
    params[position] = sampling
    outs = engine.generate(group, 2, params)
    assert outs[position].tokens == solo.tokens and outs[position].logprobs == solo.logprobs
    assert torch.equal(me.logits(), solo_logits)
    assert_equal_dicts(slot_state(engine, me), solo_state)
    for s in group:
        s.close()


# every batch and position on the dense model; the MoE on a few (CPU time)
@pytest.mark.parametrize("model_dir,batch,position", [
    pytest.param("dense", b, p, id=f"dense-{b}-{p}") for b, p in [(2, 1), (3, 0), (4, 3), (5, 2), (8, 7), (9, 4), (16, 15)]
] + [pytest.param("moe", b, p, id=f"moe-{b}-{p}") for b, p in [(3, 0), (16, 15)]], indirect=["model_dir"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_decode_is_batch_invariant(make_engine, corpus, batch, position, sampling):
    engine = make_engine(slots=batch + 1)
    _step_alone_and_in_batch(engine, corpus, batch, position, sampling)


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_batches_above_one_decode_step_run_and_stay_invariant(make_engine, corpus):
    """More sessions than one decode step holds (64): several steps per token, each session as alone."""
    engine = make_engine(slots=70, max_seq=256)
    sessions = []
    for j in range(70):
        s = engine.open()
        s.append(corpus[j * 7:j * 7 + 3 + j % 5])
        sessions.append(s)
    params = [SamplingParams(temperature=0.8, seed=j, ignore_eos=True) if j % 2 else GREEDY for j in range(70)]
    together = engine.generate(sessions, 3, params)
    for s in sessions:
        s.close()
    for j in (0, 1, 63, 64, 69):
        alone = engine.open()
        alone.append(corpus[j * 7:j * 7 + 3 + j % 5])
        assert alone.generate(3, params[j]) == together[j], j
        alone.close()


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_best_of_n_branches_equal_their_solo_runs(engine, corpus):
    s = engine.open()
    s.append(corpus[:200])
    s.snapshot("root")
    s.close()
    params = [SamplingParams(temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(3)]
    branches = engine.fork("root", 3)
    together = engine.generate(branches, 40, params)
    for b in branches:
        b.close()
    for i in range(3):
        alone = engine.restore("root")
        assert alone.generate(40, params[i]) == together[i]
        alone.close()


def test_sampled_logprobs_are_the_raw_model_log_softmax(engine, corpus):
    s = engine.open()
    logits = s.append(corpus[:90])
    out = engine.generate([s], 1, [SamplingParams(temperature=1.3, top_k=5, seed=3)])[0]
    want = torch.log_softmax(logits, -1)[out.tokens[0]]
    assert out.logprobs[0] == pytest.approx(float(want), abs=1e-6)
    assert out.tokens[0] in torch.topk(logits, 5).indices.tolist()


def test_sampling_refusals_are_typed(engine, corpus):
    s = engine.open()
    s.append(corpus[:10])
    for bad in (dict(seed=2**64), dict(seed=-2), dict(top_k=True), dict(temperature=True),
                dict(temperature=float("nan")), dict(top_p=0.0), dict(colour=1)):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)
    with pytest.raises(InvalidRequestError):
        engine.generate([], 3)
    with pytest.raises(InvalidRequestError):
        engine.generate([s, 42], 3)
    with pytest.raises(InvalidRequestError):
        engine.generate([s], True)
    with pytest.raises(InvalidRequestError):
        engine.generate([s], 2, [{"temperature": 1.0}])
    # extreme but valid parameters sample without errors: tiny temperature is greedy, tiny top_p keeps the top
    greedy = s.logits().argmax().item()
    assert s.generate(1, SamplingParams(temperature=1e-40, seed=1)) == [greedy]
    t = engine.open()
    t.append(corpus[:10])
    assert t.generate(1, SamplingParams(temperature=1.0, top_p=1e-300, seed=1)) == [greedy]
