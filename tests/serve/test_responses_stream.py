"""The Responses API's stream of events for a reply's text as it arrives (serve/responses_api.py, ResponseShape),
without a server: content before calls, two calls in one reply, and a reply cut inside its second call, whole
(the default) and with stream_options.tool_arguments "incremental"."""
import json

import pytest

from capsulert.serve.generation import Choice, Chunk
from capsulert.serve.responses_api import ResponsePlan, ResponseShape, StoredResponses
from capsulert.serve.responses_bodies import ResponsesRequest

CALLS = ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "fmt": "24h"}}\n</tool_call>')


def events(text: str, stop_reason: str, incremental: bool, step: int = 3) -> list[dict]:
    """Every event of a stream whose reply is `text`, arriving `step` characters a chunk."""
    options = {"stream_options": {"tool_arguments": "incremental"}} if incremental else {}
    body = ResponsesRequest(model="m", input="hi", stream=True, store=False, **options)
    shape = ResponseShape("resp_1", body, ResponsePlan(None, (), (), True), StoredResponses(), "default")
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    out = b""
    for k, piece in enumerate(pieces):
        final = Choice(0, (), text, (), (), stop_reason) if k == len(pieces) - 1 else None
        out += shape.chunk_event(Chunk(0, piece, (), (), final=final), k == 0, 0)
    got = [json.loads(line[6:]) for line in out.decode().splitlines() if line.startswith("data: ")]
    return got + [shape.tail_chunk(None, None)]


def calls_of(evs: list[dict]) -> list[tuple[str, str, str]]:
    return [(e["item"]["name"], e["item"]["arguments"], e["item"]["status"]) for e in evs
            if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"]


@pytest.mark.parametrize("incremental", [False, True], ids=["whole", "incremental"])
def test_two_calls_after_text(incremental):
    evs = events(CALLS, "eos", incremental)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    calls = calls_of(evs)
    assert [(n, json.loads(a), s) for n, a, s in calls] == [
        ("get_weather", {"city": "Oslo"}, "completed"), ("get_time", {"zone": "CET", "fmt": "24h"}, "completed")]
    deltas = [e for e in evs if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) > 6 if incremental else len(deltas) == 2  # incremental: pieces; whole: one a call
    for item_id in {e["item_id"] for e in deltas}:  # each call's deltas add up to its arguments
        done, = [e for e in evs if e["type"] == "response.function_call_arguments.done" and e["item_id"] == item_id]
        assert "".join(e["delta"] for e in deltas if e["item_id"] == item_id) == done["arguments"]
    kinds = [e["type"] for e in evs]
    # the message closes before the first call; each call's item is done before the next is added
    assert kinds.index("response.output_text.done") < kinds.index("response.function_call_arguments.delta")
    added = [i for i, e in enumerate(evs) if e["type"] == "response.output_item.added"]
    done = [i for i, e in enumerate(evs) if e["type"] == "response.output_item.done"]
    assert all(d < a for d, a in zip(done, added[1:]))
    end = evs[-1]
    assert end["type"] == "response.completed"
    assert [i["type"] for i in end["response"]["output"]] == ["message", "function_call", "function_call"]
    assert end["response"]["output"][0]["content"][0]["text"].strip() == "Sure."


@pytest.mark.parametrize("incremental", [False, True], ids=["whole", "incremental"])
def test_a_reply_cut_inside_its_second_call(incremental):
    cut = CALLS[:CALLS.index('"CET"') + 3]
    evs = events(cut, "length", incremental)
    end = evs[-1]
    assert end["type"] == "response.incomplete"
    assert end["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    calls = calls_of(evs)
    if incremental:  # its pieces went out: the call ends incomplete, as far as it was written
        assert [(n, s) for n, _, s in calls] == [("get_weather", "completed"), ("get_time", "incomplete")]
        assert calls[1][1] == '{"zone": "CE'
    else:  # whole calls: the cut one is dropped
        assert [(n, s) for n, _, s in calls] == [("get_weather", "completed")]
    assert [i["status"] for i in end["response"]["output"]] == ["completed"] * 2 + ["incomplete"] * incremental
