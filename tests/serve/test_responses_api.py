"""POST /v1/responses through the official openai client (whole and streamed, function tools and their
outputs, text.format), previous_response_id served from the earlier response's capsule, GET /v1/models/{id},
and the server's --max-tokens default and cap."""
from __future__ import annotations

import json

import openai
import pytest

from capsulert.protocol.conversation import ChatPrompt
from tests.serve.conftest import AGENT_MAX_SEQ, AGENT_MAX_TOKENS, MODEL

MAX_TOKENS = AGENT_MAX_TOKENS
INSTRUCTIONS = "You answer briefly."
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather of a city",
           "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"enum": ["Oslo", "Lima"]}}}}


@pytest.fixture(scope="module")
def server(agent_server):  # --max-tokens 160 (shared with test_frameworks.py)
    return agent_server


def _messages(*turns: str) -> list[dict]:
    return [{"role": "system", "content": INSTRUCTIONS}] + [{"role": "user", "content": t} for t in turns]


def test_models_list_the_bounds_and_answer_by_id(server):
    card = server.http("GET", "/v1/models").json()["data"][0]
    assert card["id"] == MODEL and card["max_tokens"] == MAX_TOKENS and card["max_model_len"] == AGENT_MAX_SEQ
    assert server.http("GET", f"/v1/models/{MODEL}").json() == card
    missing = server.http("GET", "/v1/models/gpt-9")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_max_tokens_is_the_default_and_the_cap(server, acme):
    r = acme.chat.completions.create(model=MODEL, messages=_messages("Hi"), temperature=0,
                                     extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_TOKENS and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match=f"limit of {MAX_TOKENS}"):
        acme.chat.completions.create(model=MODEL, messages=_messages("Hi"), max_tokens=MAX_TOKENS + 1)


def test_a_response_whole_and_streamed_is_the_chat_reply(acme, oracle):
    args = dict(model=MODEL, input="Hello there", instructions=INSTRUCTIONS, max_output_tokens=8, temperature=0,
                store=False)
    want = oracle.chat(_messages("Hello there"), 8)
    r = acme.responses.create(**args)
    assert r.output_text == want.content and r.usage.output_tokens == len(want.result)
    assert r.usage.input_tokens == want.result.length - len(want.result)
    assert r.status == ("incomplete" if want.finish_reason == "length" else "completed")
    events = list(acme.responses.create(**args, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response." + r.status
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.content
    assert events[-1].response.output_text == want.content
    assert events[-1].response.usage.output_tokens == len(want.result)


def test_previous_response_id_appends_only_the_new_input(acme, oracle):
    first = acme.responses.create(model=MODEL, input="Tell me a story", instructions=INSTRUCTIONS,
                                  max_output_tokens=6, temperature=0)
    second = acme.responses.create(model=MODEL, input="And then?", instructions=INSTRUCTIONS, max_output_tokens=6,
                                   temperature=0, previous_response_id=first.id)
    held = first.usage.input_tokens + first.usage.output_tokens  # the first response's capsule
    assert second.usage.input_tokens_details.cached_tokens == held
    convo = _messages("Tell me a story") + [{"role": "assistant", "content": first.output_text},
                                            {"role": "user", "content": "And then?"}]
    rendered = oracle.tokenizer.encode(oracle.codec.chat.text(ChatPrompt.of(convo)), add_special_tokens=False).ids
    assert second.usage.input_tokens == len(rendered)
    prefilled = second.usage.input_tokens - second.usage.input_tokens_details.cached_tokens
    assert 0 < prefilled < first.usage.input_tokens  # the new user turn, not the conversation
    # the same turn sent whole: the same tokens, the same reply
    whole = acme.responses.create(model=MODEL, instructions=INSTRUCTIONS, max_output_tokens=6, temperature=0,
                                  store=False, input=[{"role": "user", "content": "Tell me a story"},
                                                      *[o.model_dump() for o in first.output],
                                                      {"role": "user", "content": "And then?"}])
    assert whole.usage.input_tokens == second.usage.input_tokens and whole.output_text == second.output_text
    capsules = acme.get("/capsules", cast_to=object)["data"]
    assert not any(c["id"].startswith("capsulert:") for c in capsules)  # the server's own: invisible


def test_function_calls_and_their_outputs(acme):
    r = acme.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
                              parallel_tool_calls=False, max_output_tokens=64, temperature=0)
    call, = r.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments)["city"]
    streamed = list(acme.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], stream=True,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=64, temperature=0, store=False))
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert [(i.type, i.name, i.arguments) for i in done] == [("function_call", call.name, call.arguments)]
    answer = acme.responses.create(model=MODEL, previous_response_id=r.id, tools=[WEATHER], max_output_tokens=4,
                                   temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                          "output": "12 degrees"}])
    assert answer.usage.input_tokens_details.cached_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert answer.output and answer.output[0].type == "message"


INCREMENTAL = {"stream_options": {"tool_arguments": "incremental"}}
NAMED = {"type": "function", "name": "get_weather"}


def _call_events(events) -> tuple[list, list[str], list]:
    """(the function_call items added, their arguments deltas in order, the items done) of a stream."""
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    return added, deltas, done


def test_incremental_function_call_arguments_stream_as_generated(acme):
    """stream_options.tool_arguments "incremental": the call's item is added before its arguments, which come
    in several deltas adding up to the item's arguments, the same object as the whole response's call."""
    args = dict(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], tool_choice=NAMED, max_output_tokens=64,
                temperature=0, store=False)
    whole, = acme.responses.create(**args).output
    events = list(acme.responses.create(**args, stream=True, extra_body=INCREMENTAL))
    added, deltas, done = _call_events(events)
    assert [(i.name, i.arguments, i.status) for i in added] == [("get_weather", "", "in_progress")]
    assert len(deltas) > 2 and [(i.call_id, i.status) for i in done] == [(added[0].call_id, "completed")]
    assert "".join(deltas) == done[0].arguments
    assert json.loads(done[0].arguments) == json.loads(whole.arguments)
    arguments_done, = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments_done.arguments == done[0].arguments and events[-1].type == "response.completed"
    with pytest.raises(openai.BadRequestError, match="stream_options needs stream"):
        acme.responses.create(**args, extra_body=INCREMENTAL)


def test_an_incremental_call_cut_by_max_output_tokens_ends_incomplete(acme):
    """A response cut inside a call whose arguments went out already ends `incomplete` with that call's item
    `incomplete` (the default drops the call); the stored conversation goes on without it."""
    args = dict(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], tool_choice=NAMED, temperature=0)
    n = acme.responses.create(**args, max_output_tokens=64, store=False).usage.output_tokens
    for limit in range(n - 1, 0, -1):  # the last limit that still cuts the arguments (not only the block's end)
        events = list(acme.responses.create(**args, max_output_tokens=limit, stream=True, extra_body=INCREMENTAL))
        added, deltas, done = _call_events(events)
        if deltas and done[0].arguments.rstrip()[-1:] != "}":
            break
    assert len(added) == len(done) == 1 and done[0].status == "incomplete" and "".join(deltas) == done[0].arguments
    with pytest.raises(json.JSONDecodeError):
        json.loads(done[0].arguments)
    end = events[-1]
    assert end.type == "response.incomplete" and end.response.output[-1].status == "incomplete"
    assert acme.responses.create(**args, max_output_tokens=limit, store=False).output == []  # the default
    follow = acme.responses.create(model=MODEL, previous_response_id=end.response.id, input="Thanks.",
                                   tools=[WEATHER], max_output_tokens=2, temperature=0)
    fresh = acme.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=2, temperature=0,
                                  input=[{"role": "user", "content": "Weather in Oslo?"},
                                         {"role": "user", "content": "Thanks."}])
    assert follow.usage.input_tokens == fresh.usage.input_tokens


def test_text_format_json_schema(acme):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = acme.responses.create(model=MODEL, input="JSON please", max_output_tokens=20, temperature=0,
                              text={"format": {"type": "json_schema", "name": "r", "schema": schema}})
    assert isinstance(json.loads(r.output_text)["ok"], bool)


def test_unknown_or_foreign_previous_responses_are_404(acme, globex):
    mine = acme.responses.create(model=MODEL, input="Hi", max_output_tokens=2, temperature=0)
    for client, rid in ((acme, "resp_nope"), (globex, mine.id)):
        with pytest.raises(openai.NotFoundError, match="no stored response"):
            client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, previous_response_id=rid)
    with pytest.raises(openai.BadRequestError):
        acme.responses.create(model=MODEL, input=[], max_output_tokens=2)


def test_seed_minus_one_is_no_seed(acme):  # as vLLM reads it
    r = acme.chat.completions.create(model=MODEL, messages=_messages("Hi"), max_tokens=3, seed=-1)
    assert r.usage.completion_tokens > 0


async def test_a_previous_response_whose_capsule_is_gone_is_prefilled_whole(default_model_dir, monkeypatch):
    """The capsule evicted (its budget spent, as any unpinned capsule's): the turn is planned again without it."""
    from array import array
    from types import SimpleNamespace

    from capsulert.chat.prompt import ChatRenderer
    from capsulert.errors import UnknownCapsuleError
    from capsulert.serve import app
    from capsulert.serve.plans import Limits
    from capsulert.serve.responses_api import StoredResponse, StoredResponses
    from capsulert.serve.responses_bodies import MessageItem, ResponsesRequest
    from capsulert.serve.token_text import TokenText

    tokens = TokenText.load(default_model_dir, 0)
    chat = ChatRenderer(default_model_dir, tokens.tokenizer)
    stored = StoredResponses()
    earlier = [MessageItem(role="user", content="Hi"), MessageItem(role="assistant", content="Hello")]
    prompt = chat.encode(ChatPrompt.of([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
                                       add_generation_prompt=False))
    stored.put("resp_1", StoredResponse("acme", tuple(earlier), array("I", prompt), "capsulert:response:resp_1"))
    state = SimpleNamespace(responses=stored, limits=Limits(MODEL, 2048, 1, 160), tokens=tokens, chat=chat)
    plans = []

    async def respond(state, route, ns, plan, shape, stream, include_usage, t0):
        plans.append(plan)
        if plan.capsule is not None:
            raise UnknownCapsuleError("evicted")
        return "answered"
    monkeypatch.setattr(app, "_respond", respond)
    body = ResponsesRequest(model=MODEL, input="More?", previous_response_id="resp_1")
    assert await app._respond_response(state, SimpleNamespace(ns="acme"), body) == "answered"
    restored, whole = plans
    assert restored.capsule == "capsulert:response:resp_1" and whole.capsule is None
    assert list(whole.prompts[0]) == prompt + list(restored.prompts[0])  # the whole conversation, prefilled
