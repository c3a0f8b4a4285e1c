"""The Python chat API: Session.append_chat / chat, Engine.chat and the AsyncEngine forms, rendering the
checkpoint's chat template in-process, constraining by tool_choice and response_format, parsing calls."""
from __future__ import annotations

import json

import pytest

from capsulert.protocol.conversation import ChatPrompt
from capsulert.chat.template import ChatTemplate
from capsulert.errors import InvalidRequestError
from capsulert.sessions.local import AsyncEngine
from capsulert.protocol.sampling import SamplingParams

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
