"""Constrained decoding (engine/grammar.py): the token mask in the sampler, the grammar state per
generate, and batch invariance with constrained and unconstrained sessions sharing decode steps."""
from __future__ import annotations

import json

import llguidance
import pytest
import torch

from capsulert.errors import InvalidRequestError
from capsulert.protocol.constraint import Constraint
from capsulert.engine.grammar import allowed_tokens
from capsulert.engine.sampler import RowDraw, sample_rows
from capsulert.protocol.sampling import SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "n"],
          "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 999}}}
PROMPTS = ["Weather report: ", "The capsule runtime ", "def main():\n", "Once upon a time, ",
           "JSON please: ", "1, 2, 3, ", "Hello there. ", "A list of cities: "]


def _bitmask(rows: list[list[int]], vocab: int) -> torch.Tensor:
    """An int32 bitmask [rows, words] allowing exactly the given tokens per row."""
    words = torch.zeros(len(rows), (vocab + 31) // 32, dtype=torch.int64)
    for r, allowed in enumerate(rows):
        for t in allowed:
            words[r, t // 32] |= 1 << (t % 32)
    return words.to(torch.int32)  # wraps bit 31 into the sign, as llguidance writes it


def test_bitmask_unpacks_row_by_row():
    vocab = 70
    mask = _bitmask([[0, 31, 69], list(range(vocab)), [32]], vocab)
    allowed = allowed_tokens(mask, vocab, torch.device("cpu"))
    assert allowed.shape == (3, vocab)
    assert allowed[0].nonzero().flatten().tolist() == [0, 31, 69]
    assert bool(allowed[1].all()) and allowed[2].nonzero().flatten().tolist() == [32]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_mask_picks_only_allowed_tokens_and_logprobs_stay_raw(temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 5
    rows = [RowDraw(SamplingParams(temperature=temperature, logprobs=3), seed=7, index=i) for i in range(4)]
    choice = [[3, 9], list(range(50)), [49], [0, 1, 2]]
    allowed = allowed_tokens(_bitmask(choice, 50), 50, torch.device("cpu"))
    got = sample_rows(logits, rows, allowed)
    free = sample_rows(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    for r in range(4):
        assert got.tokens[r] in choice[r]
        # logprobs are the raw model's (before the mask): the chosen token's, and the unmasked top-k
        assert got.logprobs[r] == raw[r, got.tokens[r]].item()
        assert got.top_logprobs[r] == free.top_logprobs[r]
    if temperature == 0.0:
        assert got.tokens[0] == max(choice[0], key=lambda t: logits[0, t].item())
    assert got.tokens[1] == free.tokens[1]  # an all-allowed row draws what it draws unmasked


def test_constraint_takes_exactly_one_valid_grammar():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        Constraint(regex="a", grammar="start: \"a\"")
    with pytest.raises(InvalidRequestError, match="exactly one"):
        Constraint()
    with pytest.raises(InvalidRequestError, match="invalid constraint"):
        Constraint(json_schema={"type": "nonsense"})
    with pytest.raises(InvalidRequestError, match="invalid constraint"):
        Constraint(grammar="start: (")
    with pytest.raises(InvalidRequestError):
        SamplingParams(constraint={"regex": "[0-9]+", "json_object": True})


def _replayed(engine, constraint: Constraint, tokens: list[int]):
    """A fresh llguidance matcher fed the generated tokens: every one must be allowed."""
    ll = llguidance.LLTokenizer(engine.tokenizer.to_str(), n_vocab=engine.model_cfg.vocab_size,
                                eos_token=list(engine.eos_token_ids))
    m = llguidance.LLMatcher(ll, constraint.llguidance_grammar, log_level=0)
    for t in tokens:
        assert m.consume_token(t), (t, m.get_error())
    return m


def test_schema_output_is_valid_json_and_ends_with_the_grammar(make_engine):
    eng = make_engine(slots=2, max_seq=1024)
    c = Constraint(json_schema=SCHEMA)
    s = eng.open(prompt="Give me a city: ")
    res = s.generate(120, SamplingParams(constraint=c))
    assert res.stop_reason == "grammar_end"
    value = json.loads(res.text)
    assert value["city"] in ("Paris", "Oslo", "Lima") and 0 <= value["n"] <= 999
    assert _replayed(eng, c, list(res)).is_stopped()


def test_grammar_advances_once_per_committed_token(make_engine):
    eng = make_engine(slots=2, max_seq=1024)
    from capsulert.engine.decoding import DecodeStream, advance

    s = eng.open(prompt="Digits: ")
    st = DecodeStream(eng, s, 40, SamplingParams(constraint=Constraint(regex=r"[0-9]{2}-[a-z]{3}")))
    while not st.done:
        advance(eng, [st])
        assert st.grammar.accepted == len(st.result)
    assert st.result.stop_reason == "grammar_end" and len(st.result.text) == 6 and st.result.text[2] == "-"


def test_regex_that_may_go_on_leaves_eos_to_the_model(make_engine):
    eng = make_engine(slots=2, max_seq=1024)
    s = eng.open(prompt="Count: ")
    res = s.generate(12, SamplingParams(constraint=Constraint(regex=r"[0-9]+")))
    text = res.text
    assert res.stop_reason in ("eos", "length") and text.isdigit()


def _mixed_params() -> list[SamplingParams]:
    schema = Constraint(json_schema=SCHEMA)
    return [SamplingParams(constraint=schema), SamplingParams(),
            SamplingParams(temperature=0.8, seed=11, constraint=Constraint(regex=r"[a-z]{4,9}")),
            SamplingParams(temperature=0.7, seed=5, top_k=40),
            SamplingParams(temperature=1.0, seed=3, top_p=0.9, constraint=schema, logprobs=2),
            SamplingParams(temperature=1.0, seed=4, logprobs=2),
            SamplingParams(constraint=Constraint(json_object=True)),
            SamplingParams(temperature=0.5, seed=9, constraint=Constraint(grammar='start: "yes" | "no" | "maybe"'))]


def test_batch_of_8_mixed_is_bitwise_each_alone(make_engine):
    """Constrained and unconstrained sessions in one decode batch: each one's tokens and logprobs are
    bitwise those it gets alone."""
    eng = make_engine(slots=8, max_seq=1024)
    params = _mixed_params()
    alone = []
    for prompt, p in zip(PROMPTS, params):
        s = eng.open(prompt=prompt)
        alone.append(s.generate(24, p))
        s.close()
    sessions = [eng.open(prompt=prompt) for prompt in PROMPTS]
    together = eng.generate(sessions, 24, params)
    for a, b in zip(alone, together):
        assert list(a) == list(b) and a.stop_reason == b.stop_reason
        assert torch.equal(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
        assert a.top_logprobs == b.top_logprobs
    assert together[0].stop_reason == "grammar_end" and json.loads(together[0].text)["city"]
    assert together[7].text in ("yes", "no", "maybe")
    assert any(r.stop_reason != "grammar_end" for r in together[1::2])  # the free ones ran on


def test_constraint_needs_a_tokenizer(device):
    from capsulert.engine.engine import Engine

    eng = Engine.from_config(model="random:capsulert/configs/models/default.yaml", device=device, slots=1,
                             max_seq=256, prefill_chunk=128)
    s = eng.open(prompt=[1, 2, 3])
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        s.generate(4, SamplingParams(constraint=Constraint(regex="a")))
    assert len(s.tokens) == 3  # refused before any token
