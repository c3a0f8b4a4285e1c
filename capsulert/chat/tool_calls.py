"""The model's tool-call markup, parsed into OpenAI tool calls: whole (parse_reply) and as a stream
(ToolCallStream).

A call is a `<tool_call>...</tool_call>` block whose body is either
- JSON, `{"name": ..., "arguments": {...}}` (Qwen3's and capsulert's default template; written as the
  default template writes it, the arguments' text is kept as written, else re-serialized), or
- XML, `<function=NAME><parameter=P>VALUE</parameter>...</function>` (Qwen3-Coder's and Qwen3.5's),
  each VALUE read as JSON when it parses as JSON (a number, a bool, an object) and as text otherwise.
A block that is neither stays in the content, as written. The content is the text outside the calls.

A call is complete or absent: a reply cut off (by max_tokens or max_seq) inside a `<tool_call>` block, or
inside the marker itself, drops that fragment (`cut=True`); it is neither a call nor content.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
# a JSON body as the default template writes it: the arguments object's text is kept as it is
_RAW_ARGUMENTS = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": (\{.*\})\}', re.S)


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as a JSON text (as OpenAI sends them)."""
    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_call(body: str) -> ToolCall | None:
    """The call a block's body holds, or None when it is not a call (nor is one nested past what json reads
    without recursing too deep: ~1,200 levels used to raise RecursionError, an HTTP 500)."""
    try:
        return _parse_call(body)
    except RecursionError:
        return None


def _parse_call(body: str) -> ToolCall | None:
    body = body.strip()
    if body.startswith("{"):
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        args = value.get("arguments", value.get("parameters", {}))
        if isinstance(args, str):  # arguments already a JSON text
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        raw = _RAW_ARGUMENTS.fullmatch(body)
        if raw is not None and raw.group(1) == json.dumps(value["name"]) and _is_object_text(raw.group(2)):
            return ToolCall(value["name"], raw.group(2))  # as written: rendered back, the very same tokens
        return ToolCall(value["name"], json.dumps(args, ensure_ascii=False))
    match = _FUNCTION.fullmatch(body)
    if match is None:
        return None
    args = {name.strip(): parameter_value(raw) for name, raw in _PARAMETER.findall(match.group(2))}
    return ToolCall(match.group(1).strip(), json.dumps(args, ensure_ascii=False))


def _is_object_text(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def parameter_value(raw: str):
    text = raw.strip("\n")
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_reply(text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole reply: the content is the text outside the parsed calls, stripped
    (None when the reply is only calls); no calls: the text as it is (less a fragment of a call it was
    cut in, when `cut`)."""
    content, calls, _ = split_reply(text, cut)
    return content, calls


def split_reply(text: str, cut: bool = False) -> tuple[str | None, list[ToolCall], bool]:
    """parse_reply's (content, calls), and whether a fragment of a call was dropped (`cut` only)."""
    stream = ToolCallStream()
    pieces = stream.push(text) + stream.finish(cut)
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    content = "".join(p for p in pieces if isinstance(p, str))
    if not calls:
        return content, [], stream.dropped
    return content.strip() or None, calls, stream.dropped


class ToolCallStream:
    """Tool calls found in a reply as its text arrives. `push(delta)` returns what can be said now, in
    order: content text (str) and complete calls (ToolCall). Text that may be the start of `<tool_call>`
    is held back until the next delta decides; a call is returned once its block closes; `finish()`
    releases the rest (an unclosed block is content), or drops it when the reply was cut there."""

    def __init__(self):
        self._buf = ""
        self._in_call = False
        self.calls = 0
        self.dropped = False  # finish(cut=True) dropped a fragment of a call
        self.partial = False  # never: a call is sent whole or not at all (ToolCallDeltas may end in one)

    def push(self, delta: str) -> list[str | ToolCall]:
        self._buf += delta
        out: list[str | ToolCall] = []
        while True:
            if not self._in_call:
                text, self._buf, self._in_call = before_call(self._buf)
                if text:
                    out.append(text)
                if not self._in_call:
                    return out
            end = self._buf.find(CLOSE)
            if end < 0:
                return out
            block, self._buf, self._in_call = self._buf[:end + len(CLOSE)], self._buf[end + len(CLOSE):], False
            call = parse_call(block[len(OPEN):-len(CLOSE)])
            if call is None:
                out.append(block)
            else:
                self.calls += 1
                out.append(call)

    def finish(self, cut: bool = False) -> list[str | ToolCall]:
        """The text held back. `cut`: the reply ended at a token limit, so an unclosed block or a partial
        marker is a call cut off: dropped (`dropped` says so), not content."""
        rest, self._buf, self._in_call = self._buf, "", False
        if cut and rest:
            self.dropped = True
            return []
        return [rest] if rest else []


def before_call(text: str) -> tuple[str, str, bool]:
    """(the text before a call that is content for sure, the rest, whether the rest opens a call): an end
    that may be the start of `<tool_call>` is kept in the rest until the next text decides."""
    at = text.find(OPEN)
    if at >= 0:
        return text[:at], text[at:], True
    keep = partial_suffix(text, OPEN)
    return text[:len(text) - keep], text[len(text) - keep:], False


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
