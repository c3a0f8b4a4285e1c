"""The Python chat API: Session.append_chat / chat, Engine.chat and the AsyncEngine forms, rendering the
checkpoint's chat template in-process, constraining by tool_choice and response_format, parsing calls."""
from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel, Field

from capsulert.protocol.conversation import ChatPrompt
from capsulert.chat.template import ChatTemplate
from capsulert.errors import InvalidRequestError
from capsulert.sessions.local import AsyncEngine
from capsulert.protocol.sampling import SamplingParams
from tests.chat.xml_model import xml_model_dir

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                                             "maximum": 7}}}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def eng(default_model_dir):
    from capsulert.engine.engine import Engine

    e = Engine.from_config(dict(model=str(default_model_dir), device="cpu", slots=4, max_seq=1024,
                                prefill_chunk=128))
    yield e
    e.close()


def test_append_chat_appends_the_rendered_template(eng, default_model_dir):
    template = ChatTemplate.for_model(default_model_dir, "<|endoftext|>")
    text = template.render(CHAT, True, tools=[WEATHER])
    s = eng.open()
    s.append_chat(CHAT, tools=[WEATHER])
    assert s.tokens == eng.tokenizer.encode(text, add_special_tokens=False).ids
    assert "<tools>\n" + json.dumps(WEATHER) in text and text.endswith("<|assistant|>\n")
    s.close()


def test_required_tool_choice_is_a_call_by_construction(eng):
    reply = eng.chat(CHAT, 120, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False)
    assert reply.finish_reason == "tool_calls" and reply.result.stop_reason == "grammar_end"
    assert len(reply.tool_calls) == 1 and reply.content is None
    call = reply.tool_calls[0]
    args = json.loads(call.arguments)
    if call.name == "get_weather":
        assert args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7
    else:
        assert call.name == "clock" and args == {}


def test_named_tool_choice_calls_that_function(eng):
    reply = eng.chat(CHAT, 120, SamplingParams(temperature=1.0, seed=5), tools=[WEATHER, CLOCK],
                     tool_choice={"type": "function", "function": {"name": "clock"}})
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("clock", {})]


def test_tool_result_goes_back_and_the_next_turn_renders_it(eng):
    first = eng.chat(CHAT, 120, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    convo = CHAT + [first.message(), {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny"}]
    text = eng.codec.chat.text(ChatPrompt.of(convo, [WEATHER]))
    assert "<|tool|>\n<tool_response>\nsunny\n</tool_response>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": ' + first.tool_calls[0].arguments in text
    second = eng.chat(convo, 8, tools=[WEATHER], tool_choice="none")
    assert second.tool_calls == [] and second.content == second.result.text


def test_auto_parses_whatever_calls_the_model_writes(eng):
    reply = eng.chat(CHAT, 6, tools=[WEATHER])  # random weights: no call in six tokens
    assert reply.tool_calls == [] and reply.content == reply.result.text and reply.finish_reason == "length"


def test_response_format_json_schema(eng):
    schema = WEATHER["function"]["parameters"]
    reply = eng.chat(CHAT, 60, response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    value = json.loads(reply.content)
    assert set(value) == {"city", "days"} and reply.finish_reason == "stop"


@pytest.mark.parametrize("args, match", [
    (dict(tools=[{"type": "function"}]), "invalid tools"),
    (dict(tools=[WEATHER, WEATHER]), "unique"),
    (dict(tool_choice="required"), "needs tools"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "not among"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "cannot be combined"),
    (dict(response_format={"type": "json_schema"}), "response_format"),
])
def test_bad_chat_arguments_are_refused_before_anything_runs(eng, args, match):
    free = eng.free_slots
    with pytest.raises(InvalidRequestError, match=match):
        eng.chat(CHAT, 4, **args)
    assert eng.free_slots == free


def test_bad_messages_are_refused(eng):
    s = eng.open()
    for bad in ([], [{"role": "wizard", "content": "x"}], "hello", [{"content": "x"}]):
        with pytest.raises(InvalidRequestError):
            s.append_chat(bad)
    assert s.tokens == []
    s.close()


async def test_async_forms_equal_the_sync_ones(eng):
    want = eng.chat(CHAT, 60, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    async with AsyncEngine(eng) as aeng:
        got = await aeng.chat(CHAT, 60, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
        s = await aeng.open()
        length = await s.append_chat(CHAT, tools=[WEATHER])
        await s.close()
    assert list(got.result) == list(want.result)
    assert [(c.name, c.arguments) for c in got.tool_calls] == [(c.name, c.arguments) for c in want.tool_calls]
    assert length == want.result.length - len(want.result)  # the prompt Engine.chat appended


class _Stop(BaseModel):
    name: str = Field(max_length=12)
    minutes: int | None = Field(None, ge=0, le=600)


class _Trip(BaseModel):  # a pydantic model's schema, as frameworks send it: $defs, anyOf null, no additionalProperties
    city: str = Field(max_length=12)
    stops: list[_Stop] = Field(max_length=2)


# no additionalProperties anywhere; their leaves bounded (a random-weights model's free string or number never ends)
PLAIN = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                          "days": {"type": "integer", "minimum": 0, "maximum": 99}},
         "required": ["city", "days"]}
OPEN_SCHEMAS = [PLAIN, {"type": "object", "properties": {"where": {"type": "object", "properties": {
    "lat": {"enum": [1.5, 2.5]}}}}}, _Trip.model_json_schema(), {"type": "object"}]


@pytest.mark.parametrize("schema", OPEN_SCHEMAS, ids=["plain", "nested", "pydantic", "bare"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "plan"}}],
                         ids=["required", "named"])
def test_any_object_schema_gives_a_complete_call(eng, schema, choice):
    tool = {"type": "function", "function": {"name": "plan", "parameters": schema}}
    reply = eng.chat(CHAT, 64, tools=[tool], tool_choice=choice, parallel_tool_calls=False)
    assert reply.finish_reason == "tool_calls" and reply.result.stop_reason == "grammar_end"
    assert reply.content is None and [c.name for c in reply.tool_calls] == ["plan"]
    jsonschema.validate(json.loads(reply.tool_calls[0].arguments), schema)


def test_a_schema_that_cannot_be_compiled_is_refused(eng):
    tool = {"type": "function", "function": {"name": "plan", "parameters": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}
    with pytest.raises(InvalidRequestError, match="parameters schema cannot be used for decoding"):
        eng.chat(CHAT, 8, tools=[tool], tool_choice="required")


def test_a_call_cut_by_max_tokens_is_dropped(eng):
    one = eng.chat(CHAT, 120, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    # parallel calls on: greedy, the same first call, then a second one that max_tokens cuts
    reply = eng.chat(CHAT, len(one.result) + 4, tools=[WEATHER], tool_choice="required")
    fragment = reply.result.text.split("</tool_call>", 1)[1].strip()
    assert reply.result.stop_reason == "length" and fragment.startswith("<tool")
    assert reply.finish_reason == "length" and reply.content is None
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [(c.name, c.arguments) for c in one.tool_calls]
    assert "<" not in reply.message()["content"]


def test_openai_arguments_are_honoured(eng):
    want = eng.chat(CHAT, 6, SamplingParams(temperature=0.7, seed=3, top_p=0.9, stop=["zz"], logprobs=2))
    got = eng.chat(CHAT, max_tokens=6, temperature=0.7, seed=3, top_p=0.9, stop="zz", logprobs=True, top_logprobs=2)
    as_dict = eng.chat(CHAT, 6, {"temperature": 0.7, "seed": 3, "top_p": 0.9, "stop": ["zz"], "logprobs": 2})
    assert list(got.result) == list(want.result) == list(as_dict.result) and len(got.result) == 6
    assert got.result.top_logprobs == want.result.top_logprobs and len(got.result.top_logprobs[0]) == 2
    assert list(eng.chat(CHAT, 6, temperature=0.7, seed=-1).result) != []  # -1: a fresh random seed, as vLLM
    first = eng.chat(CHAT, 12).result.text
    cut = eng.chat(CHAT, 12, stop=first[3:5]).result
    assert cut.stop_reason == "stop_string" and cut.text == first[:first.index(first[3:5])]


def test_template_vars_reach_the_template(default_model_dir, tmp_path, eng):
    from capsulert.engine.engine import Engine

    model = tmp_path / "model"
    model.mkdir()
    for f in default_model_dir.iterdir():
        (model / f.name).symlink_to(f)
    # a template that reads a variable of its own (the checkpoint's special tokens are not the caller's to set)
    (model / "chat_template.jinja").write_text("{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with Engine.from_config(dict(model=str(model), device="cpu", slots=1, max_seq=512, prefill_chunk=128)) as e:
        s = e.open()
        s.chat(CHAT, 1, template_vars={"greeting": "HELLO-VAR "})
        rendered = e.codec.chat.text(ChatPrompt.of(CHAT, greeting="HELLO-VAR "))
        assert rendered.startswith("HELLO-VAR ") and s.tokens[:-1] == e.tokenizer.encode(
            rendered, add_special_tokens=False).ids
    with pytest.raises(InvalidRequestError, match=r"template_vars cannot set \['tools'\]"):
        eng.chat(CHAT, 1, template_vars={"tools": None})


@pytest.mark.parametrize("args, match", [
    (dict(temprature=0.7), "unknown chat argument 'temprature'.*template_vars"),
    (dict(n=2), "n: .*one reply"),
    (dict(sampling={"temperature": 0.5}, temperature=0.7), r"give sampling or \['temperature'\]"),
    (dict(top_logprobs=3), "top_logprobs needs logprobs"),
    (dict(temperature=-1.0), "temperature"),
    (dict(max_tokens="10"), "max_tokens"),
    (dict(sampling={"temprature": 1}), "temprature"),
])
def test_arguments_it_cannot_honour_are_refused_by_name(eng, args, match):
    free = eng.free_slots
    with pytest.raises(InvalidRequestError, match=match):
        eng.chat(CHAT, **args)
    assert eng.free_slots == free


@pytest.fixture(scope="module")
def xml_eng(default_model_dir, tmp_path_factory):
    from capsulert.engine.engine import Engine

    model = xml_model_dir(default_model_dir, tmp_path_factory.mktemp("xml-model"))
    e = Engine.from_config(dict(model=str(model), device="cpu", slots=2, max_seq=1024, prefill_chunk=128))
    yield e
    e.close()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "plan"}}])
def test_a_template_that_writes_xml_calls_gets_xml_calls(xml_eng, choice):
    assert xml_eng.codec.chat.call_format == "xml"
    tool = {"type": "function", "function": {"name": "plan", "parameters": _Trip.model_json_schema()}}
    reply = xml_eng.chat(CHAT, 200, tools=[WEATHER, tool] if choice == "required" else [tool], tool_choice=choice,
                         parallel_tool_calls=False)
    assert reply.result.text.startswith("<tool_call>\n<function=") and reply.finish_reason == "tool_calls"
    call, = reply.tool_calls
    schema = (WEATHER["function"] if call.name == "get_weather" else tool["function"])["parameters"]
    jsonschema.validate(json.loads(call.arguments), schema)


async def test_async_chat_writes_forced_calls_in_the_templates_markup(xml_eng):
    """AsyncSession.chat (in process here, through the orchestrator in tests/orchestrator/test_chat_remote.py)
    used to force the JSON call form whatever the template wrote: now it asks its sender for the model's
    call markup, and its reply is Engine.chat's, token for token."""
    tool = {"type": "function", "function": {"name": "plan", "parameters": _Trip.model_json_schema()}}
    args = dict(tools=[tool], tool_choice={"type": "function", "function": {"name": "plan"}})
    want = xml_eng.chat(CHAT, 200, **args)
    async with AsyncEngine(xml_eng) as aeng:
        s = await aeng.open()
        got = await s.chat(CHAT, 200, **args)
        await s.close()
    assert got.result.text.startswith("<tool_call>\n<function=plan>") and got.finish_reason == "tool_calls"
    assert list(got.result) == list(want.result) and [c.arguments for c in got.tool_calls] == \
        [c.arguments for c in want.tool_calls]
