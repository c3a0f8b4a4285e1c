"""The tool-call parser (capsulert/chat/tool_calls.py): whole replies and streams of any split agree."""
from __future__ import annotations

import json

import pytest

from capsulert.chat.tool_calls import ToolCall, ToolCallStream, parse_reply, split_reply

JSON_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
              '</tool_call>\n<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>')
XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, CA\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def _calls(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_json_markup_whole():
    content, calls = parse_reply(JSON_CALLS)
    assert content == "Let me check."
    assert _calls(calls) == [("get_weather", {"city": "Paris", "days": 2}), ("clock", {})]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    assert calls[0].to_openai()["function"]["name"] == "get_weather"


def test_xml_markup_whole():
    content, calls = parse_reply(XML_CALL)
    assert content is None and _calls(calls) == [("get_weather", {"city": "San Francisco, CA", "days": 3})]


@pytest.mark.parametrize("text", [
    "no calls here", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\n{\"name\": 1}\n</tool_call>",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": [1]}\n</tool_call>", "an unclosed <tool_call>\n{\"name\": \"f\"",
])
def test_text_that_is_no_call_stays_content(text):
    assert parse_reply(text) == (text, [])


def test_arguments_given_as_a_json_text_are_read():
    _, calls = parse_reply('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert _calls(calls) == [("f", {"a": 1})]


@pytest.mark.parametrize("step", [1, 2, 3, 5, 11, 1000])
def test_a_stream_of_any_split_says_what_the_whole_says(step):
    for text in (JSON_CALLS, XML_CALL, "plain <tool_ text that only looks like <tool", "a <tool_call> never closed"):
        stream, pieces = ToolCallStream(), []
        for i in range(0, len(text), step):
            pieces += stream.push(text[i:i + step])
        pieces += stream.finish()
        calls = [p for p in pieces if isinstance(p, ToolCall)]
        content = "".join(p for p in pieces if isinstance(p, str))
        whole_content, whole_calls = parse_reply(text)
        assert _calls(calls) == _calls(whole_calls)
        assert (content.strip() or None if calls else content) == whole_content


def test_a_stream_holds_back_only_what_may_open_a_call():
    stream = ToolCallStream()
    assert stream.push("Hi <tool") == ["Hi "]
    assert stream.push("box>") == ["<toolbox>"]
    assert stream.push("<tool_call>{\"name\": \"f\", \"arguments\": {}}") == []
    out = stream.push("</tool_call>")
    assert len(out) == 1 and out[0].name == "f" and stream.calls == 1


CUT = [JSON_CALLS.rsplit("<tool_call>", 1)[0] + '<tool_call>\n{"name": "clo', JSON_CALLS.rsplit("<tool_call>", 1)[0] + "<",
       JSON_CALLS.rsplit("<tool_call>", 1)[0] + "<tool_ca"]


@pytest.mark.parametrize("text", CUT)
def test_a_call_cut_off_is_dropped_not_content(text):
    content, calls, dropped = split_reply(text, cut=True)
    assert content == "Let me check." and _calls(calls) == [("get_weather", {"city": "Paris", "days": 2})]
    assert dropped
    # not cut (a stop string, EOS): the unclosed text stays content
    assert split_reply(text)[0].endswith(text.rsplit("</tool_call>", 1)[1].strip())


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_a_stream_cut_off_drops_the_same_fragment(step):
    for text in CUT + ['<tool_call>\n{"name": "f", "argu']:
        stream, pieces = ToolCallStream(), []
        for i in range(0, len(text), step):
            pieces += stream.push(text[i:i + step])
        pieces += stream.finish(cut=True)
        content = "".join(p for p in pieces if isinstance(p, str))
        assert "<" not in content and stream.dropped
        assert _calls([p for p in pieces if isinstance(p, ToolCall)]) == _calls(split_reply(text, cut=True)[1])


def test_arguments_written_as_the_template_writes_them_are_kept_as_written():
    _, calls = parse_reply('<tool_call>\n{"name": "f", "arguments": {"a":1,"b":"}"}}\n</tool_call>')
    assert calls[0].arguments == '{"a":1,"b":"}"}'  # rendered back by the template: the same text
    _, calls = parse_reply('<tool_call>\n{"name":"f","arguments":{"a":1}}\n</tool_call>')
    assert calls[0].arguments == '{"a": 1}'  # another layout: re-serialized
