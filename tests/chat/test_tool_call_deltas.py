"""Tool calls streamed as generated (capsulert/chat/tool_call_deltas.py): for any split of the reply, the
name comes first and before the call closes, the arguments' pieces add up to what the whole reply's call
carries (JSON and XML forms), content is the whole reply's, and a reply cut inside a call ends partial."""
from __future__ import annotations

import json
import random

import pytest

from capsulert.chat.tool_call_deltas import CallDelta, ToolCallDeltas
from capsulert.chat.tool_calls import CLOSE, parse_reply

JSON_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris {\\"}", "days": '
              '[2, {"a": 1}]}}\n</tool_call>\n<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>')
XML_CALLS = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, CA\n</parameter>\n"
             "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=clock>\n"
             "</function>\n</tool_call>")


def _splits(text: str, seed: int) -> list[str]:
    if seed == 0:
        return list(text)  # a character at a time
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), 12))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def _run(pieces: list[str], cut: bool = False):
    stream, content, calls, seen = ToolCallDeltas(), "", {}, ""
    for piece in pieces:
        seen += piece
        for p in stream.push(piece):
            if isinstance(p, str):
                content += p
                continue
            assert isinstance(p, CallDelta)
            if p.name is not None:
                assert p.index not in calls and p.id.startswith("call_")
                calls[p.index] = {"name": p.name, "arguments": p.arguments, "head_at": len(seen), "pieces": 0}
            else:
                calls[p.index]["arguments"] += p.arguments
            calls[p.index]["pieces"] += 1
    for p in stream.finish(cut):
        content += p if isinstance(p, str) else ""
    return content, calls, stream


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("text", [JSON_CALLS, XML_CALLS], ids=["json", "xml"])
def test_deltas_add_up_to_the_whole_replys_calls(text, seed):
    want_content, want = parse_reply(text)
    content, calls, stream = _run(_splits(text, seed))
    assert (content.strip() or None) == want_content and not stream.partial and not stream.dropped
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(w.name, w.arguments) for w in want]
    first_close = text.index(CLOSE)
    assert calls[0]["head_at"] < first_close  # the name went out before its call was complete
    if seed == 0:
        assert calls[0]["pieces"] > 2  # and the arguments in several pieces


def test_a_reply_cut_inside_a_call_ends_partial():
    cut_at = JSON_CALLS.index('"days"')
    content, calls, stream = _run(_splits(JSON_CALLS[:cut_at], 0), cut=True)
    assert content == "Let me check.\n" and stream.partial and not stream.dropped
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == '{"city": "Paris {\\"}", '
    head_only = JSON_CALLS[:JSON_CALLS.index('"name"') + 3]  # its name not written yet: nothing was sent
    content, calls, stream = _run([head_only], cut=True)
    assert calls == {} and stream.dropped and not stream.partial and content == "Let me check.\n"


def test_blocks_that_are_not_calls_stay_content_and_other_layouts_go_whole():
    text = '<tool_call>\nnot a call\n</tool_call> then <tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call>'
    content, calls, _ = _run(_splits(text, 0))
    assert content.startswith("<tool_call>\nnot a call\n</tool_call> then ")
    assert [(c["name"], json.loads(c["arguments"]), c["pieces"]) for c in calls.values()] == [("f", {"a": 1}, 1)]
