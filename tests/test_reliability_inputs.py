"""Issue 15 items 4 and 5 (engine side of the token and directory checks): what is not a token sequence
is refused with InvalidTokenError, a directory that cannot serve is refused with CapsuleIOError, and a
refusal leaves the engine exactly as it was. (The orchestrator side is in tests/orchestrator/test_edge.py.)"""
import pytest
import torch

from capsulert.errors import CapsuleIOError, InvalidTokenError


def state(eng, s):
    return list(s.tokens), s.logits().clone(), eng.free_slots, [(i.name, i.tier) for i in eng.store.list()]


def same(a, b):
    return a[0] == b[0] and torch.equal(a[1], b[1]) and a[2:] == b[2:]


NOT_TOKENS = [None, 5, 3.5, object(), True,  # item 4: these raised TypeError
              b"hello", bytearray(b"hi"), memoryview(b"hi"),  # item 5: bytes were taken as token ids,
              {1: 2, 3: 4}, {5, 6, 7}, frozenset({8}), range(3),  # a dict gave its keys, a set any order
              torch.tensor([1.5, 2.0]), torch.tensor([[1, 2]]), torch.tensor([True]),
              [1, 2.0], [1, None], [1, True]]


@pytest.mark.parametrize("bad", NOT_TOKENS, ids=lambda v: type(v).__name__)
def test_append_refuses_what_is_not_a_token_sequence(engine, bad):
    s = engine.open()
    s.append([5, 6, 7])
    before = state(engine, s)
    with pytest.raises(InvalidTokenError):
        s.append(bad)
    assert same(state(engine, s), before)
    s.append((8,))  # a tuple, a list and a 1-D integer tensor are token sequences
    s.append(torch.tensor([9, 10], dtype=torch.int32))
    assert s.tokens == [5, 6, 7, 8, 9, 10]


@pytest.mark.parametrize("text", ["\ud800", "ok then \udfff", "\udbff\udfff"])
def test_lone_surrogates_are_refused(engine, text):
    s = engine.open()
    s.append("fine")
    before = state(engine, s)
    with pytest.raises(InvalidTokenError, match="surrogate"):
        s.append(text)
    with pytest.raises(InvalidTokenError):
        engine.tokenize(text)
    assert same(state(engine, s), before)


def test_directory_errors_are_typed_and_change_nothing(make_engine, tmp_path, text):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    with pytest.raises(CapsuleIOError, match="not a directory"):
        make_engine(disk_dir=str(a_file))
    eng = make_engine()
    s = eng.open()
    s.append(text[:200])
    s.snapshot("c")
    before = state(eng, s)
    with pytest.raises(CapsuleIOError, match="not a directory"):
        eng.store.save(a_file)
    with pytest.raises(CapsuleIOError, match="does not exist"):
        eng.store.load(tmp_path / "missing")
    with pytest.raises(CapsuleIOError, match="not a directory"):
        eng.store.load(a_file)
    assert same(state(eng, s), before) and a_file.read_text() == "not a directory"


@pytest.mark.parametrize("fields", [dict(stop=["\ud800"]), dict(stop=["fine", "x\udfffy"]), dict(top_k=2 ** 70),
                                    dict(top_k=2 ** 31)])
def test_sampling_fields_that_mean_nothing_are_refused(engine, fields):
    """Issue 29 item 7: a stop string with a lone surrogate (never matched: decoded text holds none) and a
    top_k of 2^70 were accepted."""
    from capsulert.errors import InvalidRequestError
    from capsulert.protocol.checks import sampling_params
    from capsulert.protocol.sampling import SamplingParams

    with pytest.raises(InvalidRequestError):
        SamplingParams(**fields)
    with pytest.raises(InvalidRequestError):  # the orchestrator's and the server's path
        sampling_params(fields)


def test_the_largest_top_k_keeps_every_token(engine):
    from capsulert.protocol.sampling import MAX_TOP_K, SamplingParams

    runs = []
    for top_k in (MAX_TOP_K, 0):
        s = engine.open()
        s.append("fine")
        runs.append(s.generate(8, SamplingParams(temperature=1.0, seed=5, top_k=top_k, ignore_eos=True)))
        s.close()
    assert runs[0] == runs[1]
