"""Tool calls streamed as they are generated: a call's name as soon as it is written, then its arguments'
text in pieces (OpenAI's `tool_calls[].function.arguments` deltas), for a chat stream that asks for it
(`stream_options: {"tool_arguments": "incremental"}`, serve/bodies.py).

The default (tool_calls.py, ToolCallStream) sends each call whole once its block closes, and drops a call
cut by max_tokens, so a client never sees a fragment. Here pieces reach the client before the call is known
to complete: a reply cut inside a call ends with finish_reason "length" and its last call as far as it was
written (`partial`).

What the pieces of a call add up to:
- JSON form (`{"name": ..., "arguments": {...}}`): the arguments object's text as the model writes it (a
  whole reply re-serializes it where it is not written as the default template writes it: the same JSON,
  perhaps spaced otherwise);
- XML form (`<function=NAME><parameter=P>VALUE</parameter>...</function>`): a parameter is read as JSON or
  as text only once its `</parameter>` is written, so the arguments arrive a parameter at a time:
  `{"P": value, ...}`, exactly the whole reply's text.
A block whose name cannot be read as it arrives (another layout) is sent whole when it closes, or left in
the content when it is not a call, as the default does.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from capsulert.chat.tool_calls import CLOSE, OPEN, ToolCall, before_call, parameter_value, parse_call

_JSON_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')
_XML_HEAD = re.compile(r"\s*<function=([^>\n]+)>")
_XML_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
_XML_END = re.compile(r"\s*</function>")


@dataclass(frozen=True)
class CallDelta:
    """A piece of call `index`: its first carries the id and the name, every one some arguments text."""
    index: int
    arguments: str
    name: str | None = None
    id: str | None = None

    def to_openai(self) -> dict:
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallDeltas:
    """push(delta) returns, in order, content text (str) and CallDeltas; finish(cut) the rest."""

    def __init__(self):
        self._buf = ""  # outside a call: text that may open one; inside: the block's body so far
        self._in_call = False
        self._sent: int | None = None  # inside a call whose head was sent: arguments characters sent
        self.calls = 0  # calls begun (the next call's index)
        self.partial = False  # the reply ended inside a call already begun (finish(cut=True))
        self.dropped = False  # the reply ended inside a call whose head was not sent yet (nothing of it sent)

    @property
    def in_call(self) -> bool:
        """Whether the text so far ends inside a call's block (its last CallDelta may not be its last piece)."""
        return self._in_call

    def push(self, delta: str) -> list[str | CallDelta]:
        self._buf += delta
        out: list[str | CallDelta] = []
        while True:
            if not self._in_call:
                text, rest, self._in_call = before_call(self._buf)
                if text:
                    out.append(text)
                if not self._in_call:
                    self._buf = rest
                    return out
                self._buf, self._sent = rest[len(OPEN):], None
            end = self._buf.find(CLOSE)
            body = self._buf if end < 0 else self._buf[:end]
            out += self._pieces(body, closed=end >= 0)
            if end < 0:
                return out
            self._buf, self._in_call = self._buf[end + len(CLOSE):], False

    def _pieces(self, body: str, closed: bool) -> list[str | CallDelta]:
        head = _head(body)
        if self._sent is None and head is None:
            if not closed:
                return []
            call = parse_call(body)  # another layout: whole, as the default sends it, or content
            if call is None:
                return [OPEN + body + CLOSE]
            self.calls += 1
            return [CallDelta(self.calls - 1, call.arguments, call.name, call.id)]
        name, arguments = head if head is not None else ("", "")
        out: list[str | CallDelta] = []
        if self._sent is None:
            self.calls += 1
            self._sent = 0
            out.append(CallDelta(self.calls - 1, "", name, ToolCall(name, "").id))
        if len(arguments) > self._sent:
            out.append(CallDelta(self.calls - 1, arguments[self._sent:]))
            self._sent = len(arguments)
        return out

    def finish(self, cut: bool = False) -> list[str | CallDelta]:
        """The text held back. A reply that ended inside a call: `partial` when the call was begun (what was
        sent stays sent), else the block is dropped when `cut` (a token limit) and content otherwise."""
        rest, in_call, self._buf, self._in_call = self._buf, self._in_call, "", False
        if in_call and self._sent is not None:
            self.partial = True
            return []
        if cut and rest:
            self.dropped = True
            return []
        return [OPEN + rest if in_call else rest] if rest else []


def _head(body: str) -> tuple[str, str] | None:
    """(name, the arguments text written so far) of a call's body, once its name can be read."""
    m = _JSON_HEAD.match(body)
    if m is not None:
        try:
            name = json.loads(m.group(1))
        except ValueError:
            return None
        return name, _json_value_prefix(body, m.end())
    m = _XML_HEAD.match(body)
    if m is None:
        return None
    parts, at = [], m.end()
    while (p := _XML_PARAMETER.match(body, at)) is not None:
        parts.append(json.dumps(p.group(1).strip(), ensure_ascii=False) + ": "
                     + json.dumps(parameter_value(p.group(2)), ensure_ascii=False))
        at = p.end()
    done = "}" if _XML_END.match(body, at) else ""
    return m.group(1).strip(), "{" + ", ".join(parts) + done


def _json_value_prefix(text: str, start: int) -> str:
    """The JSON object starting at text[start] as far as it is written, up to its closing brace."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return text[start:]
