"""Streaming pieces: the text a stream may show while stop strings can still match, and SSE framing.

A stop string is matched on the detokenized output once its last piece arrives, and the final text ends
before it. So a stream must not show text that may turn out to be the start of a stop string: it holds
back the last (longest stop - 1) characters until more text or the end decides, and nothing from a match
on (the token completing a stop string arrives, with its text, before the stop is reported); then it
shows exactly the final text. Without stop strings nothing is held back.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    """One server-sent event carrying a JSON object (compact: every byte is per token)."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n\n"


@dataclass
class HeldText:
    """The text of one choice shown so far, never past what the final text can be."""

    stops: tuple[str, ...] = ()
    seen: str = ""  # every delta the worker sent
    shown: int = 0  # characters of `seen` already shown
    cut: int | None = None  # where a stop string matched: nothing at or past it is ever shown

    @property
    def hold(self) -> int:
        """Characters kept back: a stop string may be starting there (longest stop - 1)."""
        return max((len(s) for s in self.stops), default=1) - 1

    def push(self, delta: str | None) -> str:
        """Add a worker text delta; the text that can be shown now ("" when nothing new is safe)."""
        if delta:
            start = max(0, len(self.seen) - self.hold)  # a match must end in the new text
            self.seen += delta
            hits = [i for i in (self.seen.find(s, start) for s in self.stops) if i >= 0]
            if hits and self.cut is None:
                self.cut = min(hits)  # the token that completes a stop string also carries text
        safe = len(self.seen) - self.hold if self.cut is None else self.cut
        if safe <= self.shown:
            return ""
        out = self.seen[self.shown:safe]
        self.shown = safe
        return out

    def finish(self, final_text: str | None) -> str:
        """The rest of the final text (the worker's, cut before a matched stop string)."""
        final = self.seen if final_text is None else final_text
        out = final[self.shown:]
        self.shown = len(final)
        return out


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
