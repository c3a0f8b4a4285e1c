"""Streaming pieces: SSE framing, and the tokens of a choice waiting for its next chunk. (What text a
stream may show while a stop string can still match is decided in the worker: HeldText in
capsulert/engine/stops.py.)"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from starlette.responses import StreamingResponse

DONE = b"data: [DONE]\n\n"
# set in a request's scope by ingress.CancelOnDisconnect: a client that goes away cancels the handler
CANCELS_ON_DISCONNECT = "capsulert.cancels_on_disconnect"


def sse(payload: dict) -> bytes:
    """One server-sent event carrying a JSON object (compact: every byte is per token)."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n\n"


@dataclass
class PendingTokens:
    """Tokens produced since the choice's last chunk, with their logprobs and top-k alternatives (a chunk
    goes out once it has text to show)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)

    def add(self, token: int, logprob: float, top: tuple[tuple[int, float], ...] = ()) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.top_logprobs.append(top)

    def take(self) -> tuple[tuple[int, ...], tuple[float, ...], tuple[tuple[tuple[int, float], ...], ...]]:
        """Everything pending (tokens, logprobs, top-k rows), and nothing pending afterwards."""
        out = tuple(self.tokens), tuple(self.logprobs), tuple(self.top_logprobs)
        self.tokens.clear()
        self.logprobs.clear()
        self.top_logprobs.clear()
        return out


class EventStream(StreamingResponse):
    """A stream of server-sent events. Where the request is cancelled when its client goes away (the
    replica's own server), Starlette's per-response task group listening for the disconnect is not needed:
    the events are sent from the request's task, and the last one, [DONE], goes out with the end of the body
    (one write instead of two). Elsewhere (behind Serve's proxy) it is Starlette's StreamingResponse."""

    async def __call__(self, scope, receive, send) -> None:
        if not scope.get(CANCELS_ON_DISCONNECT):
            return await super().__call__(scope, receive, send)
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for chunk in self.body_iterator:  # bytes; the iterator runs to its end (its finally) either way
            if not ended:
                ended = chunk is DONE  # nothing follows [DONE]
                await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        if self.background is not None:
            await self.background()
