"""Many sessions' appends in one forward (Engine.append_many): each session's next-token logits, every state
buffer of its slot (grid checkpoint and tail included) and its later tokens are bitwise what its own append
gives, at mixed lengths, on and off the grid, across pieces longer than a chunk, after decoded tails, after a
restore and with prefix-cache hits. Runs on the CPU in `make test`; on the GPU with `--device cuda -m ""`."""
import pytest
import torch

from capsulert.capsule_store import tensors_checksum
from capsulert.engine.engine import GRID
from capsulert.errors import InvalidRequestError, SequenceTooLongError
from capsulert.protocol.sampling import SamplingParams
from tests.models import MODELS

SEEDED = SamplingParams(temperature=0.9, top_k=50, seed=11, ignore_eos=True)


@pytest.fixture
def corpus(default_model_dir):
    from capsulert.engine.default_model import CORPUS_PATH
    from capsulert.engine.loader import load_tokenizer

    return load_tokenizer(default_model_dir).encode(CORPUS_PATH.read_text()[:20000]).ids


def slot_bytes(engine, s):
    """Every buffer of the slot a later step reads: KV up to its length, live and grid state, last hidden
    state, position, and the tail rows an append replays."""
    st, slot, n = engine.state, s.slot, len(s.tokens)
    out = {k: getattr(st, k)[:, slot].clone() for k in ("ssm", "conv", "ssm_grid", "conv_grid")}
    out.update(kv_k=st.kv_k[:, slot, :n].clone(), kv_v=st.kv_v[:, slot, :n].clone(),
               last_hidden=st.last_hidden[slot].clone(), pos=st.pos[slot].clone())
    if st.layout.mtp_layers:  # the MTP head's rows and its seed at the grid point
        out.update(mtp_k=st.mtp_k[:, slot, :n].clone(), mtp_v=st.mtp_v[:, slot, :n].clone(),
                   grid_hidden=st.grid_hidden[slot].clone())
    t = engine.table.replayable_end(s) - n // GRID * GRID
    if t:
        out.update(tail_in=st.tail_in[:, slot, :t].clone(), tail_gates=st.tail_gates[:, slot, :t].clone())
        if st.keeps_tail_seed:  # the MTP head's seed where the tail ends
            out.update(tail_hidden=st.tail_hidden[slot].clone())
    return out


def assert_same(engine, a, b):
    assert (a.tokens, a.decoded_from, a.tail_end) == (b.tokens, b.decoded_from, b.tail_end)
    x, y = slot_bytes(engine, a), slot_bytes(engine, b)
    assert x.keys() == y.keys()
    for k in x:
        assert torch.equal(x[k], y[k]), k


# (context, how it was made, the turn appended): on and off the grid, a decoded tail, a piece past a chunk
CASES = [(0, "append", 40), (64, "append", 32), (100, "append", 28), (150, "append", 300), (130, "decode", 50),
         (200, "append", 1), (0, "append", 200)]
AFTER = (900, 917)  # the corpus span of the second append, after the generate


def open_case(eng, corpus, i):
    """A session holding case i's context, made as the case says; and the turn to append to it."""
    ctx, how, n = CASES[i]
    prompt, turn = corpus[i * 7:i * 7 + ctx], corpus[500 + i:500 + i + n]
    s = eng.open()
    if how == "decode":
        s.append(prompt[:ctx - 20])
        eng.generate([s], 20, [SamplingParams(ignore_eos=True)])
    elif prompt:
        s.append(prompt)
    return s, turn


def record(engine, s):
    return (s.tokens[:], s.decoded_from, s.tail_end), slot_bytes(engine, s)


def assert_recorded(engine, want, b):
    (tokens, decoded_from, tail_end), x = want
    assert (tokens, decoded_from, tail_end) == (b.tokens, b.decoded_from, b.tail_end)
    y = slot_bytes(engine, b)
    assert x.keys() == y.keys()
    for k in x:
        assert torch.equal(x[k], y[k]), k


# each case's session run alone, per model: its own appends (ModelRunner.prefill) and batched generate never go
# through runner.batch_rows, which only switches how append_many runs several slots' pieces, so both rows modes
# are compared with the same solo run; it is made once per model (on an engine of the same settings, on its own
# slots, as the original same-engine run made it) instead of once per mode (CPU time: the generate is most of it)
_SOLO: dict[str, dict] = {}


def solo_reference(make_engine, model_dir, corpus) -> dict:
    key = str(model_dir)
    if key not in _SOLO:
        eng = make_engine(slots=2 * len(CASES), max_seq=1024)
        solo, turns = zip(*(open_case(eng, corpus, i) for i in range(len(CASES))))
        ref = {"appended": [s.append(t).clone() for s, t in zip(solo, turns)]}
        ref["after_append"] = [record(eng, s) for s in solo]
        ref["generated"] = [list(r) for r in eng.generate(list(solo), 70, [SEEDED] * len(solo))]
        ref["appended_again"] = [s.append(corpus[AFTER[0]:AFTER[1]]).clone() for s in solo]
        ref["after_again"] = [record(eng, s) for s in solo]
        eng.close()
        _SOLO[key] = ref
    return _SOLO[key]


@pytest.mark.parametrize("rows", ["batched", "one by one"])
@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_a_batched_append_is_bitwise_each_sessions_own(make_engine, model_dir, corpus, rows):
    ref = solo_reference(make_engine, model_dir, corpus)
    eng = make_engine(slots=2 * len(CASES), max_seq=1024)
    eng.runner.batch_rows = rows == "batched"
    # a live session the batched forwards must leave alone (the solo sessions were that in one engine)
    bystander = eng.open()
    bystander.append(corpus[3000:3150])
    untouched = record(eng, bystander)
    batch, turns = zip(*(open_case(eng, corpus, i) for i in range(len(CASES))))
    batch = list(batch)
    got = eng.append_many(batch, list(turns))
    for w, g in zip(ref["appended"], got):
        assert torch.equal(w, g)
    for want, b in zip(ref["after_append"], batch):
        assert_recorded(eng, want, b)
    # and everything after: a generate (crossing grid points) and another batched append
    assert ref["generated"] == [list(r) for r in eng.generate(batch, 70, [SEEDED] * len(batch))]
    got = eng.append_many(batch, [corpus[AFTER[0]:AFTER[1]]] * len(batch))
    assert all(torch.equal(w, g) for w, g in zip(ref["appended_again"], got))
    for want, b in zip(ref["after_again"], batch):
        assert_recorded(eng, want, b)
    assert_recorded(eng, untouched, bystander)


@pytest.mark.parametrize("rows", ["batched", "one by one"])
def test_a_batched_append_after_a_restore_and_from_the_prefix_cache(make_engine, corpus, rows):
    """And where the runner runs the rows one slot after another (the comparison path)."""
    eng = make_engine(slots=6, prefix_cache=True)
    eng.runner.batch_rows = rows == "batched"
    maker = eng.open()
    maker.append(corpus[:230])
    maker.snapshot("ctx")
    maker.close()  # its last grid checkpoint stays in the prefix cache
    a, b = eng.restore("ctx"), eng.restore("ctx")
    c, d = eng.open(), eng.open()
    want = [a.append(corpus[230:260]), c.append(corpus[:300])]  # c: a prefix-cache hit at 192
    got = eng.append_many([b, d], [corpus[230:260], corpus[:300]])
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    assert_same(eng, a, b)
    assert_same(eng, c, d)


def test_a_bad_piece_refuses_the_whole_call_and_changes_no_session(engine, corpus):
    a, b = engine.open(), engine.open()
    a.append(corpus[:50])
    before = slot_bytes(engine, a)
    with pytest.raises(SequenceTooLongError):
        engine.append_many([a, b], [corpus[:10], corpus[:1] * 5000])
    assert a.tokens == corpus[:50] and b.tokens == [] and all(
        torch.equal(v, slot_bytes(engine, a)[k]) for k, v in before.items())
    with pytest.raises(InvalidRequestError, match="twice"):
        engine.append_many([a, a], [corpus[:3], corpus[:3]])
    with pytest.raises(InvalidRequestError, match="one piece"):
        engine.append_many([a, b], [corpus[:3]])


def capsule_checksum(engine, name):
    with engine.store.reading(name) as (_, tensors):
        return tensors_checksum(tensors)


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_a_reused_slot_gives_a_capsule_nothing_of_its_previous_session(make_engine, corpus):
    """A session short of its first grid point, appended beside one that crosses a grid point (the forward then
    keeps a grid checkpoint for every row), in a slot a longer session held before: its capsule is bitwise the
    one a fresh engine makes, byte for byte of every tensor (no hidden state of the previous occupant)."""
    eng, fresh = make_engine(slots=2), make_engine(slots=2)
    for s in [eng.open(), eng.open()]:
        s.append(corpus[1000:1100])
        s.close()
    short, crossing = eng.open(), eng.open()
    crossing.append(corpus[200:250])
    eng.append_many([short, crossing], [corpus[:40], corpus[250:290]])  # short's first piece
    eng.snapshot(short, "short")
    ref = fresh.open()
    ref.append(corpus[:40])
    fresh.snapshot(ref, "short")
    assert capsule_checksum(eng, "short") == capsule_checksum(fresh, "short")


def test_an_opened_session_holds_no_hidden_state_of_the_slots_previous_one(make_engine, corpus):
    eng = make_engine(slots=1)
    s = eng.open()
    s.append(corpus[:100])
    s.close()
    t = eng.open()
    assert not eng.state.last_hidden[t.slot].any() and not eng.state.grid_hidden[t.slot].any()


def test_a_batched_row_without_an_inner_grid_point_keeps_its_slots_grid_hidden_state(make_engine, corpus):
    """Whatever the slot's last hidden state holds: a row crossing no grid point, in a forward where another
    row does, leaves the slot's grid checkpoint (grid_hidden) as it was."""
    eng = make_engine(slots=2)
    short, crossing = eng.open(), eng.open()
    crossing.append(corpus[200:250])
    eng.state.last_hidden[short.slot] = 1.0  # not what any checkpoint holds
    kept = eng.state.grid_hidden[short.slot].clone()
    eng.append_many([short, crossing], [corpus[:40], corpus[250:290]])
    assert torch.equal(eng.state.grid_hidden[short.slot], kept)


def test_a_batched_append_replays_each_sessions_kept_tail_and_runs_only_its_new_tokens(make_engine, corpus):
    """Sessions whose prefilled tokens end past a grid point, with their tail rows kept:
    one batched append runs only the new tokens through the model and replays each tail in the
    linear-attention layers, beside a session on the grid; each ends bitwise where its own append leaves it.
    A row whose piece crosses a grid point and one that crosses none share the forward. The eager forward's
    inputs (batched_piece_rows=0: on CUDA a captured graph of the batch's shape takes the same ones,
    tests/worker/test_graphs.py)."""
    eng = make_engine(slots=6, tail_replay=True, batched_piece_rows=0)
    contexts, turns = [corpus[:100], corpus[200:330], corpus[400:464]], [corpus[600:610], corpus[700:770], corpus[800:805]]
    batched = [eng.open(c) for c in contexts]
    calls = []
    forward = eng.runner.model.forward

    def spy(*args, **kw):
        calls.append(kw)
        return forward(*args, **kw)
    eng.runner.model.forward = spy
    try:
        got = eng.append_many(batched, turns)
    finally:
        del eng.runner.model.forward
    [kw] = calls
    assert kw["replay"].tolist() == [36, 2, 0] and kw["valid"].tolist() == [10, 70, 5]
    assert kw["grid_at"].tolist() == [0, 62, 0]  # the second crosses 192, 62 of its new tokens in
    for s, c, t, logits in zip(batched, contexts, turns, got):
        alone = eng.open(c)
        assert torch.equal(alone.append(t), logits)
        assert_same(eng, s, alone)
        alone.close()


def test_a_long_piece_beside_short_ones_runs_as_two_forwards_bitwise_each_sessions_own(make_engine, corpus):
    """A forward pads its pieces to the longest: one 120-token piece beside six 8-token turns would be 7 x 120 rows
    for 168 real ones, so the round runs as two forwards (engine/prefill_groups.py), one of six equal turns as
    one; each session's logits and slot bytes are its own append's."""
    eng = make_engine(slots=14, max_seq=512)
    turns = [corpus[700:820]] + [corpus[820 + 8 * i:828 + 8 * i] for i in range(6)]
    solo = [eng.open(corpus[100 * i:100 * i + 64]) for i in range(7)]
    want = [s.append(t).clone() for s, t in zip(solo, turns)]
    batch = [eng.open(corpus[100 * i:100 * i + 64]) for i in range(7)]
    before = eng.prefill_forwards
    got = eng.append_many(batch, turns)
    assert eng.prefill_forwards - before == 2
    for w, g, a, b in zip(want, got, solo, batch):
        assert torch.equal(w, g)
        assert_same(eng, a, b)
    before = eng.prefill_forwards
    eng.append_many(batch[1:], turns[1:])
    assert eng.prefill_forwards - before == 1
