"""Response bodies and stream chunks in the OpenAI shapes (text_completion, chat.completion[.chunk]).

Finish reasons: eos, stop_token, stop_string and grammar_end are "stop"; length and max_seq are "length"; a
generate interrupted because its client went away is "stop" (nobody reads it); a chat reply with tool
calls is "tool_calls".

Tool calls (chat with tools, tool_choice not "none"): the reply's `<tool_call>` markup is parsed
(capsulert/chat/tool_calls.py) into `message.tool_calls`, the rest is `message.content` (null when the
reply is only calls). Streamed, content deltas carry the text outside calls as it arrives (text that may
open a call is held back until decided) and each call comes as one `tool_calls` delta (index, id, name
and its whole arguments) once its block closes. A call is complete or absent: one cut off by max_tokens
(or max_seq) is dropped, never sent as content, and the finish_reason is then "length". A stream that asks
for `stream_options.tool_arguments` "incremental" gets a call's id and name as soon as the name is written
and its arguments in pieces as they are generated; cut by max_tokens, it ends with finish_reason "length"
and its last call as far as it was written (chat/tool_call_deltas.py).

Logprobs are the raw model's (log_softmax of the logits, before temperature and top-k / top-p). In a
stream each chunk carries the logprobs of its own tokens, with their top-k alternatives when asked for
(completions `logprobs` > 0, chat `top_logprobs` > 0; the worker sends them with every token).
Concatenated over a choice's chunks, they are the same list as the non-streamed response's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from capsulert.chat.tool_call_deltas import CallDelta, ToolCallDeltas
from capsulert.chat.tool_calls import ToolCallStream
from capsulert.chat.turn import FINISH_REASON, cut_off, finish_reason, read_reply
from capsulert.serve.generation import Choice, Chunk, Made, Usage
from capsulert.serve.streaming import sse
from capsulert.serve.token_text import TokenText

# what sse() writes for each part of a chunk (json.dumps, compact, ensure_ascii=False)
_string = json.encoder.encode_basestring
_number = int.__repr__
_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))



def usage_body(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def capsule_body(made: "Made") -> dict:
    """What a request's snapshot_as made (the `capsule` field of the response). `size_bytes` is the capsule's
    whole state, shared prefix blocks included: the same field, with the same meaning, as GET /v1/capsules."""
    ref = made.ref
    return {"name": ref.name, "tokens": ref.boundary, "tier": ref.tier, "pinned": made.pinned,
            "size_bytes": ref.nbytes}


@dataclass(frozen=True)
class Shape:
    chat: bool
    id: str
    created: int
    model: str
    tokens: TokenText
    logprobs: int | None  # None: none asked for; k: the chosen token's and the top-k alternatives
    return_token_ids: bool
    tools: bool = False  # chat replies' tool-call markup becomes tool_calls
    tool_deltas: bool = False  # streamed, a call's arguments go out in pieces (chat/tool_call_deltas.py)

    @property
    def _object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # ------------------------------------------------------------------ whole responses
    def body(self, choices: Sequence[Choice], usage: Usage, capsule: Made | None) -> dict:
        out = self._head(self._object)
        out["choices"] = [self._choice(c) for c in choices]
        out["usage"] = usage_body(usage)
        if capsule is not None:
            out["capsule"] = capsule_body(capsule)
        return out

    def _choice(self, c: Choice) -> dict:
        lp = None if self.logprobs is None else self._logprobs(c.tokens, c.logprobs, c.top_logprobs, 0)
        finish = FINISH_REASON.get(c.stop_reason, "stop")
        if self.chat:
            message = {"role": "assistant", "content": c.text}
            if self.tools:
                content, calls, finish = read_reply(c.text, c.stop_reason)
                message["content"] = content
                if calls:
                    message["tool_calls"] = [call.to_openai() for call in calls]
            d = {"index": c.index, "message": message, "logprobs": lp}
        else:
            d = {"index": c.index, "text": c.text, "logprobs": lp}
        d["finish_reason"] = finish
        if self.return_token_ids:
            d["token_ids"] = list(c.tokens)
        return d

    # ------------------------------------------------------------------ stream chunks
    def chunk(self, ch: Chunk, first: bool, offset: int) -> dict:
        """The chunk of one choice's new output; `first`: the choice's first chunk (chat sends the role);
        `offset`: characters of the choice's text sent before (completions' text_offset)."""
        lp = None
        if self.logprobs is not None and ch.tokens:
            lp = self._logprobs(ch.tokens, ch.logprobs, ch.top_logprobs, offset)
        if self.chat:
            delta = {"role": "assistant", "content": ch.text} if first else {"content": ch.text}
            d = {"index": ch.index, "delta": delta, "logprobs": lp}
        else:
            d = {"index": ch.index, "text": ch.text, "logprobs": lp}
        d["finish_reason"] = None if ch.final is None else FINISH_REASON.get(ch.final.stop_reason, "stop")
        if self.return_token_ids:
            d["token_ids"] = list(ch.tokens)
        out = self._head(self._object + ".chunk" if self.chat else self._object)
        out["choices"] = [d]
        return out

    @cached_property
    def _event_head(self) -> str:
        """A stream event up to its choice's index: the same for every chunk of the response."""
        obj = self._object + ".chunk" if self.chat else self._object
        return (f'data: {{"id":{_string(self.id)},"object":{_string(obj)},"created":{_number(self.created)},'
                f'"model":{_string(self.model)},"choices":[{{"index":')

    def chunk_event(self, ch: Chunk, first: bool, offset: int) -> bytes:
        """sse(self.chunk(ch, first, offset)), byte for byte, written from the stream's head instead of a dict
        encoded whole: every byte of it is per token."""
        if self.tools:
            return sse(self._tool_chunk(ch, first, offset))
        if type(ch.text) is not str:
            return sse(self.chunk(ch, first, offset))
        lp = "null"
        if self.logprobs is not None and ch.tokens:
            lp = _encoder.encode(self._logprobs(ch.tokens, ch.logprobs, ch.top_logprobs, offset))
        if self.chat:
            delta = '"delta":{"role":"assistant","content":' if first else '"delta":{"content":'
            text = delta + _string(ch.text) + "}"
        else:
            text = '"text":' + _string(ch.text)
        finish = "null" if ch.final is None else _string(FINISH_REASON.get(ch.final.stop_reason, "stop"))
        ids = ',"token_ids":[' + ",".join(map(_number, ch.tokens)) + "]" if self.return_token_ids else ""
        return (self._event_head + _number(ch.index) + "," + text + ',"logprobs":' + lp + ',"finish_reason":' + finish
                + ids + "}]}\n\n").encode("utf-8")

    @cached_property
    def _tool_streams(self) -> dict[int, ToolCallStream | ToolCallDeltas]:
        return {}

    def _tool_chunk(self, ch: Chunk, first: bool, offset: int) -> dict:
        """A chat chunk whose text went through the choice's ToolCallStream (ToolCallDeltas where the
        arguments go out incrementally): content outside calls, and the calls' tool_calls deltas."""
        stream = self._tool_streams.get(ch.index)
        if stream is None:
            stream = self._tool_streams[ch.index] = ToolCallDeltas() if self.tool_deltas else ToolCallStream()
        before = stream.calls
        pieces = stream.push(ch.text) + (stream.finish(cut_off(ch.final.stop_reason)) if ch.final is not None else [])
        content = "".join(p for p in pieces if isinstance(p, str))
        calls = [p for p in pieces if not isinstance(p, str)]
        if stream.calls and content.isspace():
            content = ""  # the line breaks between calls
        out = self.chunk(ch, first, offset)
        d = out["choices"][0]
        d["delta"]["content"] = content if content or not calls else None
        if calls:
            d["delta"]["tool_calls"] = [call.to_openai() if isinstance(call, CallDelta) else
                                        {"index": before + k, **call.to_openai()} for k, call in enumerate(calls)]
        if ch.final is not None:
            d["finish_reason"] = finish_reason(ch.final.stop_reason, stream.calls, stream.dropped or stream.partial)
        return out

    def tail_chunk(self, usage: Usage | None, capsule: Made | None) -> dict:
        """The last chunk: no choices, the usage (stream_options.include_usage) and the capsule made."""
        out = self._head(self._object + ".chunk" if self.chat else self._object)
        out["choices"] = []
        if usage is not None:
            out["usage"] = usage_body(usage)
        if capsule is not None:
            out["capsule"] = capsule_body(capsule)
        return out

    # ------------------------------------------------------------------ logprobs
    def _logprobs(self, tokens: Sequence[int], logprobs: Sequence[float], top: Sequence, offset: int) -> dict:
        piece = self.tokens.piece
        if self.chat:
            def entry(t: int, lp: float) -> dict:
                return {"token": piece(t), "logprob": lp, "bytes": self.tokens.piece_bytes(t)}
            content = []
            for i, (t, lp) in enumerate(zip(tokens, logprobs)):
                e = entry(t, lp)
                e["top_logprobs"] = [entry(a, alp) for a, alp in top[i]] if i < len(top) else []
                content.append(e)
            return {"content": content}
        pieces = [piece(t) for t in tokens]
        offsets = []
        for p in pieces:
            offsets.append(offset)
            offset += len(p)
        top_rows = [{piece(a): alp for a, alp in row} for row in top] if self.logprobs else None
        return {"tokens": pieces, "token_logprobs": list(logprobs), "top_logprobs": top_rows, "text_offset": offsets}
