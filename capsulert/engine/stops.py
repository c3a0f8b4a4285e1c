"""When a generate stops, and the incremental text it produces.

EOS ids come from the checkpoint's config.json and generation_config.json (either may hold an int or a
list); SamplingParams adds stop token ids and stop strings. Stop strings are matched on the incrementally
detokenized output, so a string split across tokens is found once its last piece arrives, and the final
text ends before it. So a stream must not show text that may turn out to be the start of a stop string
(HeldText): it holds back the last (longest stop - 1) characters until more text or the end decides, and
nothing from a match on; the stream's texts then add up to exactly the final text. Without stop strings
nothing is held back.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable, Sequence

from capsulert.errors import InvalidRequestError
from capsulert.protocol.sampling import SamplingParams

# a byte-level BPE token can end inside a UTF-8 character; the decoder shows it as U+FFFD until the rest
# arrives, so text ending in it is held back
_PARTIAL = "\ufffd"


def eos_ids_from_checkpoint(path: Path | None, config_eos: int | None) -> tuple[int, ...]:
    ids: list[int] = [] if config_eos is None else [config_eos]
    if path is not None:
        for name in ("config.json", "generation_config.json"):
            f = Path(path) / name
            if not f.is_file():
                continue
            try:
                data = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            for d in (data, data.get("text_config") or {}):
                value = d.get("eos_token_id") if isinstance(d, dict) else None
                for v in (value if isinstance(value, list) else [value]):
                    if isinstance(v, int) and not isinstance(v, bool) and v not in ids:
                        ids.append(v)
    return tuple(ids)


class TextStream:
    """Incremental detokenization of a generate's output. Each token decodes a short window (the tokens
    since the text emitted before the last delta), not the whole output: the window starts at a token the
    previous delta already covered, so decoders that treat a sequence's first token specially (a leading
    space) do so on both sides of the difference."""

    def __init__(self, decode: Callable[[Sequence[int]], str] | None):
        self._decode = decode
        self.tokens: list[int] = []
        self._prefix = 0  # the window's first token
        self._read = 0  # tokens whose text was returned
        self._before: str | None = None  # the text of tokens[_prefix:_read], kept while a character is incomplete

    def push(self, token: int) -> str | None:
        """The new text `token` completes ("" while a character is incomplete); None without a tokenizer."""
        self.tokens.append(token)
        if self._decode is None:
            return None
        before = self._before
        if before is None:
            before = self._before = self._decode(self.tokens[self._prefix:self._read])
        after = self._decode(self.tokens[self._prefix:])
        if after.endswith(_PARTIAL) or len(after) <= len(before):
            return ""
        delta = after[len(before):]
        self._prefix, self._read, self._before = self._read, len(self.tokens), None
        return delta

    def flush(self) -> str:
        """The text held back at the end (an incomplete character, shown as U+FFFD as the decoder does):
        the output is over, so it is released; "" when nothing is held or without a tokenizer."""
        if self._decode is None or self._read == len(self.tokens):
            return ""
        before = self._decode(self.tokens[self._prefix:self._read])
        delta = self._decode(self.tokens[self._prefix:])[len(before):]
        self._prefix, self._read, self._before = self._read, len(self.tokens), None
        return delta


class StopRule:
    """EOS and stop token ids, and the length limit. Stop strings are matched where the stream's text is
    held back (HeldText): the stream tells check whether one matched."""

    def __init__(self, params: SamplingParams, eos_ids: Sequence[int], max_new_tokens: int,
                 vocab_size: int | None = None):
        outside = [t for t in params.stop_token_ids if vocab_size is not None and not 0 <= t < vocab_size]
        if outside:  # a stop id the model can never sample: a mistake, not a rule that never fires
            raise InvalidRequestError(f"stop_token_ids {outside[:5]} are outside the vocabulary [0, {vocab_size})")
        self.ids = {} if params.ignore_eos else {t: "eos" for t in eos_ids}
        self.ids.update({t: "stop_token" for t in params.stop_token_ids if t not in self.ids})
        self.max_new = max_new_tokens

    def check(self, token: int, produced: int, stop_string: bool) -> str | None:
        """The stop reason after `token` (the produced-th token), or None to go on."""
        if token in self.ids:
            return self.ids[token]
        if stop_string:
            return "stop_string"
        if produced >= self.max_new:
            return "length"
        return None


@dataclass
class HeldText:
    """The text of one choice shown so far, never past what the final text can be."""

    stops: tuple[str, ...] = ()
    seen: str = ""  # every delta the worker sent
    shown: int = 0  # characters of `seen` already shown
    cut: int | None = None  # where a stop string matched: nothing at or past it is ever shown

    @property
    def text(self) -> str:
        """Everything seen, cut before a matched stop string."""
        return self.seen if self.cut is None else self.seen[:self.cut]

    @cached_property
    def hold(self) -> int:
        """Characters kept back: a stop string may be starting there (longest stop - 1)."""
        return max((len(s) for s in self.stops), default=1) - 1

    def push(self, delta: str | None) -> str:
        """Add a worker text delta; the text that can be shown now ("" when nothing new is safe)."""
        hold = self.hold
        if delta:
            start = max(0, len(self.seen) - hold)  # a match must end in the new text
            self.seen += delta
            if self.stops and self.cut is None:
                hits = [i for i in (self.seen.find(s, start) for s in self.stops) if i >= 0]
                if hits:
                    self.cut = min(hits)  # the token that completes a stop string also carries text
        safe = len(self.seen) - hold if self.cut is None else self.cut
        if safe <= self.shown:
            return ""
        out = self.seen[self.shown:safe]
        self.shown = safe
        return out

    def finish(self, final_text: str | None = None) -> str:
        """The rest of the final text (given, or what was seen, cut before a matched stop string)."""
        final = self.text if final_text is None else final_text
        out = final[self.shown:]
        self.shown = len(final)
        return out
