"""Stream chunks written from a template are the JSON of the chunks, byte for byte; metrics deferred to the
event loop's next turn keep their order."""
from __future__ import annotations

import asyncio
import itertools

import pytest

from capsulert.serve.generation import Choice, Chunk
from capsulert.serve.metrics import Deferred, RequestLabels, current_request, request_namespace
from capsulert.serve.responses import Shape
from capsulert.serve.streaming import sse
from capsulert.serve.token_text import TokenText


# ------------------------------------------------------------------------------------------ chunk events
TEXTS = ["", "plain", " h\u00e9 \u2603 \U0001f600", 'quote " back \\ slash', "line\nbreak\ttab\x01\x7f", "\u2028"]


@pytest.mark.parametrize("chat, logprobs, token_ids", list(itertools.product([False, True], [None, 0, 3],
                                                                             [False, True])))
def test_chunk_events_are_the_json_of_chunks(default_model_dir, chat, logprobs, token_ids):
    for tokens in (TokenText.load(default_model_dir, 4096), TokenText(None, 4096, False)):
        shape = Shape(chat, "chatcmpl-\u00e9\"x" if chat else "cmpl-abc", 1796000000, "m\u00f6del \"q\"", tokens,
                      logprobs, token_ids)
        for i, text in enumerate(TEXTS):
            toks = tuple(range(300 + i, 300 + i + i % 3))
            top = tuple(((t, -0.25), (t + 1, float("-inf")), (t + 2, float("nan"))) for t in toks)
            final = None if i % 2 else Choice(12, toks, text, (), (), ["length", "eos", "odd"][i % 3])
            ch = Chunk(i * 7, text, toks, tuple(-0.5 * k for k in range(len(toks))), top, final)
            for first in (True, False):
                for offset in (0, 17):
                    assert shape.chunk_event(ch, first, offset) == sse(shape.chunk(ch, first, offset))
        lone = Chunk(0, "\ud800", (), ())  # not UTF-8: both refuse it alike
        for encode in (lambda: shape.chunk_event(lone, True, 0), lambda: sse(shape.chunk(lone, True, 0))):
            with pytest.raises(UnicodeEncodeError):
                encode()


# -------------------------------------------------------------------------------------------- metrics
class _Record:
    """What Deferred records into (PromMetrics' methods), the calls kept."""

    def __init__(self):
        self.calls = []

    def request(self, namespace, route, status, seconds):
        self.calls.append(("request", namespace, route, status))

    def inflight(self, n):
        self.calls.append(("inflight", n))


def test_deferred_metrics_record_after_the_step_in_order():
    rec = _Record()
    m = Deferred(rec)
    m.inflight(3)  # no loop running: at once
    assert rec.calls == [("inflight", 3)]

    async def main():
        current_request.set(RequestLabels("chat"))
        request_namespace("acme")  # the request's key was read: its namespace labels what it records
        m.inflight(1)
        m.request("chat", 200, 0.1)
        m.inflight(0)
        assert len(rec.calls) == 1  # not yet: the request's step goes on
        await asyncio.sleep(0)
    asyncio.run(main())
    assert rec.calls[1:] == [("inflight", 1), ("request", "acme", "chat", 200), ("inflight", 0)]
    m.request("other", 404, 0.1)  # outside any request: no namespace
    assert rec.calls[-1] == ("request", "", "other", 404)
