"""Streaming pieces: SSE framing, and the tokens of a choice waiting for its next chunk. (What text a
stream may show while a stop string can still match is decided in the worker: HeldText in
capsulert/worker/stops.py.)"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

DONE = b"data: [DONE]\n\n"


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
