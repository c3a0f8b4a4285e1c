"""Hostile grammars and tool calls get typed refusals, fast, and crash nothing: a 20,000-deep schema dict
used to segfault the process inside llguidance, a schema of shared subtrees (2^28 values written out) to
hang, a client's `x-guidance` to override the compact-JSON setting, a tool with non-object parameters to
be forced and then dropped, a tool call nested ~1,200 deep to raise RecursionError (HTTP 500), and a stop
token id outside the vocabulary to be accepted silently."""
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capsulert.chat.tool_calls import parse_reply
from capsulert.errors import InvalidRequestError
from capsulert.protocol.constraint import MAX_GRAMMAR_CHARS, Constraint
from capsulert.protocol.messages import tools_arg
from capsulert.protocol.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]


def test_a_20000_deep_schema_is_refused_without_a_crash():
    script = """
from capsulert.errors import InvalidRequestError
from capsulert.protocol.constraint import Constraint
schema = cur = {}
for _ in range(20000):
    cur["items"] = {}
    cur = cur["items"]
try:
    Constraint(json_schema=schema)
except InvalidRequestError as e:
    print("refused:", e)
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "nests deeper than" in out.stdout, (out.returncode, out.stderr[-500:])


def test_shared_subtrees_x_guidance_and_long_grammars_are_refused_fast():
    node = {"type": "string"}
    for _ in range(28):
        node = {"anyOf": [node, node]}  # 57 levels, 2^28 values written out, 57 objects
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequestError, match="values written out"):
        Constraint(json_schema=node)
    assert time.perf_counter() - t0 < 1.0
    with pytest.raises(InvalidRequestError, match="x-guidance"):
        Constraint(json_schema={"type": "object", "properties": {"a": {"x-guidance": {"whitespace_flexible": True}}}})
    with pytest.raises(InvalidRequestError, match="characters"):
        Constraint(grammar="start: " + " | ".join(f'"choice {i}"' for i in range(MAX_GRAMMAR_CHARS // 10)))
    looped = {"type": "object"}
    looped["properties"] = {"self": looped}
    with pytest.raises(InvalidRequestError, match="contains itself"):
        Constraint(json_schema=looped)


@pytest.mark.parametrize("parameters", [{"type": "string"}, {"type": "integer"}, {"type": "array"},
                                        {"type": "null"}, {"type": ["object", "null"]}])
def test_tools_with_non_object_parameters_are_refused(parameters):
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with pytest.raises(InvalidRequestError, match="object"):
        tools_arg([tool])
    ok = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert tools_arg([ok])[0].function.arguments_schema == {"type": "object"}


def test_a_deeply_nested_tool_call_stays_text_instead_of_raising():
    deep = "[" * 1200 + "]" * 1200
    text = f'<tool_call>\n{{"name": "f", "arguments": {{"a": {deep}}}}}\n</tool_call>'
    content, calls = parse_reply(text)
    assert calls == [] and content == text


def test_stop_token_ids_outside_the_vocabulary_are_refused(engine):
    s = engine.open()
    s.append([5, 6, 7])
    tokens = list(s.tokens)
    for bad in (10**9, engine.model_cfg.vocab_size, -1):
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            s.generate(3, SamplingParams(stop_token_ids=[1, bad]))
        assert s.tokens == tokens
    assert len(s.generate(2, SamplingParams(stop_token_ids=[engine.model_cfg.vocab_size - 1], ignore_eos=True))) == 2


def test_a_grammar_whose_first_mask_is_costly_is_refused_within_the_budget(engine):
    """`(a{1000}){1000}` (15 bytes) took ~2 s for its first mask inside the shared decode step."""
    from capsulert.engine.grammar import MASK_BUDGET_S

    s = engine.open()
    s.append([5, 6, 7])
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequestError, match="first token mask"):
        s.generate(4, SamplingParams(constraint=Constraint(regex="(a{1000}){1000}")))
    assert time.perf_counter() - t0 < MASK_BUDGET_S + 1.0 and s.tokens == [5, 6, 7]
    got = s.generate(4, SamplingParams(constraint=Constraint(regex="[0-9]{4}")))
    assert engine.detokenize(list(got)).isdigit()


def test_a_constraint_is_compiled_once_not_again_in_every_request_that_carries_it(monkeypatch):
    """pydantic runs a model's after-validator again on an instance given as a field: every SamplingParams,
    and every request made from one, compiled its grammar again (0.8 s for a 15k-way choice, on the caller's
    event loop)."""
    import types

    import llguidance

    from capsulert.protocol import constraint as constraint_module
    from capsulert.protocol.checks import sampling_params

    compiled = []

    class Counting:
        grammar_from_regex = staticmethod(llguidance.LLMatcher.grammar_from_regex)

        @staticmethod
        def validate_grammar(grammar, tokenizer):
            compiled.append(grammar)
            return llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    monkeypatch.setattr(constraint_module, "_llguidance", lambda: types.SimpleNamespace(LLMatcher=Counting))
    c = Constraint(regex="[0-9]{4}")
    params = SamplingParams(constraint=c, temperature=0.5)
    assert sampling_params(params) is params and sampling_params(SamplingParams(constraint=c)).constraint is c
    assert len(compiled) == 1
