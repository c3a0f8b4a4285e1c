"""Agent-framework requests through the official openai client: tools (whole and streamed, required,
named, auto, tool results back), response_format json_schema / json_object (whole and streamed; the output
parses and validates), structured_outputs, and unknown fields accepted. The default model has random
weights: whatever is constrained is valid by construction, and every answer equals the in-process
Engine.chat's."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from capsulert.protocol.sampling import SamplingParams

MODEL = "capsulert-default"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city for some days",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
CLOCK = {"type": "function", "function": {"name": "clock", "description": "The time now",
                                          "parameters": {"type": "object", "properties": {},
                                                         "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
CHAT = [{"role": "system", "content": "You answer with tools."}, {"role": "user", "content": "Weather in Oslo?"}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 130},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls or []]


def _streamed(chunks) -> tuple[str, dict[int, dict], list[str]]:
    """(content, tool calls by index as {id, name, arguments}, finish reasons) of a streamed chat reply."""
    content, calls, finish = "", {}, []
    for ch in chunks:
        for c in ch.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or tc.id
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
            if c.finish_reason:
                finish.append(c.finish_reason)
    return content, calls, finish


def test_required_tool_call_whole_and_streamed(acme, oracle):
    args = dict(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                max_tokens=120, temperature=0)
    whole = acme.chat.completions.create(**args)
    choice = whole.choices[0]
    want = oracle.chat(CHAT, 120, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert _calls(choice.message.tool_calls) == _calls([_Openai(c) for c in want.tool_calls])
    name, arguments = _calls(choice.message.tool_calls)[0]
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[name]
    jsonschema.validate(arguments, schema)
    assert choice.message.tool_calls[0].id.startswith("call_") and choice.message.tool_calls[0].type == "function"

    content, calls, finish = _streamed(acme.chat.completions.create(**args, stream=True))
    assert content == "" and finish == ["tool_calls"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == _calls(choice.message.tool_calls)
    assert calls[0]["id"].startswith("call_")


class _Openai:
    """A capsulert ToolCall seen as the openai client's tool call (for comparing)."""
    def __init__(self, call):
        self.function = type("F", (), {"name": call.name, "arguments": call.arguments})


def test_named_tool_choice_is_that_function(acme):
    r = acme.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=80, temperature=0.9, seed=4,
                                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (name, arguments), = _calls(r.choices[0].message.tool_calls)
    assert name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])


def test_a_call_cut_by_max_tokens_is_dropped_whole_and_streamed(acme, oracle):
    one = oracle.chat(CHAT, 120, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    limit = len(one.result) + 4  # parallel calls on (the default): the same first call, then one cut off
    assert oracle.chat(CHAT, limit, tools=TOOLS, tool_choice="required").result.text.endswith("<tool")
    args = dict(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=limit, temperature=0)
    choice = acme.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert _calls(choice.message.tool_calls) == _calls([_Openai(c) for c in one.tool_calls])
    content, calls, finish = _streamed(acme.chat.completions.create(**args, stream=True))
    assert content == "" and finish == ["length"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == _calls(choice.message.tool_calls)


def test_open_schemas_give_a_call(acme):
    """A schema as LangChain's bind_tools sends it (no additionalProperties): closed for decoding."""
    plain = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city", "days"],
        "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "maximum": 9,
                                                                          "minimum": 0}}}}}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = acme.chat.completions.create(model=MODEL, messages=CHAT, tools=[plain], tool_choice=choice,
                                         parallel_tool_calls=False, max_tokens=64, temperature=0)
        (name, arguments), = _calls(r.choices[0].message.tool_calls)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        assert set(arguments) == {"city", "days"}


def test_tool_results_go_back_in(acme, oracle):
    first = acme.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=120, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    convo = CHAT + [first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "12 degrees, rain"}]
    r = acme.chat.completions.create(model=MODEL, messages=convo, tools=TOOLS, max_tokens=8, temperature=0)
    want = oracle.chat(convo, 8, tools=TOOLS)
    assert r.usage.prompt_tokens == want.result.length - len(want.result)
    assert r.choices[0].message.content == want.content and not r.choices[0].message.tool_calls


def test_auto_and_none_return_content(acme, oracle):
    for choice in ("auto", "none"):
        r = acme.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=choice, max_tokens=6,
                                         temperature=0)
        assert r.choices[0].message.content == oracle.chat(CHAT, 6, tools=TOOLS).result.text
        assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls


def test_json_schema_whole_and_streamed(acme, oracle):
    messages = [{"role": "user", "content": "A person as JSON."}]
    for temperature, seed in ((0, None), (1.0, 7)):
        whole = acme.chat.completions.create(model=MODEL, messages=messages, response_format=FORMAT, max_tokens=150,
                                             temperature=temperature, seed=seed)
        text = whole.choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)
        assert whole.choices[0].finish_reason == "stop"
        sampling = SamplingParams(temperature=temperature, seed=seed)
        assert text == oracle.chat(messages, 150, sampling, response_format=FORMAT).content
        content, _, finish = _streamed(acme.chat.completions.create(
            model=MODEL, messages=messages, response_format=FORMAT, max_tokens=150, temperature=temperature,
            seed=seed, stream=True))
        assert content == text and finish == ["stop"]


def test_json_object_and_structured_outputs(acme):
    r = acme.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "{"}], max_tokens=200,
                                     response_format={"type": "json_object"}, temperature=0.8, seed=1)
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    c = acme.completions.create(model=MODEL, prompt="Code: ", max_tokens=20, temperature=0,
                                extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{4}"}})
    assert len(c.choices[0].text) == 8 and c.choices[0].text[3] == "-" and c.choices[0].text[:3].isupper()
    choice = acme.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0,
                                          extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].message.content in ("yes", "no")


def test_unknown_fields_are_accepted(acme):
    for _ in range(2):
        r = acme.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0, store=False,
                                         metadata={"run": "x"}, extra_body={"a_field_of_the_future": {"x": 1}})
        assert len(r.choices[0].message.content) > 0


@pytest.mark.parametrize("args", [
    dict(tool_choice="required"),
    dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
    dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
    dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
    dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}], tool_choice="required"),
])
def test_bad_tool_and_format_requests_are_400(acme, args):
    with pytest.raises(openai.BadRequestError):
        acme.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, **args)


def _deltas(chunks) -> tuple[str, list[list[dict]], list[str]]:
    """(content, each call's deltas in order, finish reasons) of a streamed chat reply."""
    content, calls, finish = "", {}, []
    for ch in chunks:
        for c in ch.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                calls.setdefault(tc.index, []).append({"id": tc.id, "name": tc.function.name,
                                                       "arguments": tc.function.arguments})
            if c.finish_reason:
                finish.append(c.finish_reason)
    return content, [calls[i] for i in sorted(calls)], finish


INCREMENTAL = {"include_usage": False, "tool_arguments": "incremental"}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_incremental_tool_arguments_stream_as_generated(acme):
    """stream_options.tool_arguments "incremental" (the openai client sends the key as it is): the call's
    id and name come in its first delta, its arguments in several pieces that add up to the whole reply's."""
    args = dict(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=NAMED, max_tokens=120, temperature=0)
    whole = acme.chat.completions.create(**args).choices[0].message.tool_calls
    content, calls, finish = _deltas(acme.chat.completions.create(**args, stream=True, stream_options=INCREMENTAL))
    assert content == "" and finish == ["tool_calls"] and len(calls) == len(whole) == 1
    (first, *rest), = calls
    assert first["id"].startswith("call_") and first["name"] == whole[0].function.name == "get_weather"
    assert all(d["id"] is None and d["name"] is None for d in rest) and len(rest) > 2
    arguments = first["arguments"] + "".join(d["arguments"] for d in rest)
    assert json.loads(arguments) == json.loads(whole[0].function.arguments)


def test_incremental_tool_arguments_cut_by_max_tokens_end_partial(acme, oracle):
    """The default drops a call cut by max_tokens; incremental has sent its pieces already: the stream ends
    with finish_reason "length" and the call as far as it was written (documented)."""
    full = list(oracle.chat(CHAT, 120, tools=TOOLS, tool_choice=NAMED).result)

    def arguments_written(k: int) -> str:
        """The call's arguments text in the first k tokens of the reply ("" before they begin)."""
        head = re.search(r'"arguments":\s*', text := oracle.detokenize(full[:k]))
        return "" if head is None else text[head.end():]
    limit = next(k for k in range(1, len(full)) if len(arguments_written(k)) >= 3)
    args = dict(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=NAMED, max_tokens=limit, temperature=0)
    assert acme.chat.completions.create(**args).choices[0].message.tool_calls is None  # the default: dropped
    content, calls, finish = _deltas(acme.chat.completions.create(**args, stream=True, stream_options=INCREMENTAL))
    assert content == "" and finish == ["length"] and len(calls) == 1 and calls[0][0]["name"] == "get_weather"
    partial = "".join(d["arguments"] for d in calls[0])
    assert partial and arguments_written(limit).startswith(partial)
    with pytest.raises(json.JSONDecodeError):
        json.loads(partial)


def test_tool_arguments_is_refused_where_it_cannot_apply(acme):
    with pytest.raises(openai.BadRequestError, match="tool_arguments"):
        acme.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True, stream_options=INCREMENTAL)
    with pytest.raises(openai.BadRequestError, match="tool_arguments"):
        acme.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, stream=True,
                                     stream_options={"tool_arguments": "sometimes"})
