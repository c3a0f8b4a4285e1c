"""Special-token text in what a client wrote is encoded as plain text.

A chat prompt is rendered to text and the text encoded with the tokenizer, which turns every occurrence of
a special token's text (`<|endoftext|>`, `<|im_start|>`) into that token. So a user, a tool result or an
assistant message could write the markup of a turn of its own (a forged system turn) and the model would
read it as the template's. Here every string the client supplied (message contents and fields, tool
definitions, template variables) has its special-token text swapped for a marker before rendering (a
private-use character pair around a per-render nonce, which no client text can guess); the rendered text is
encoded piece by piece: the template's pieces as before, the markers as the plain text of the token they
stand for. A prompt without any such text is encoded exactly as before.
"""
from __future__ import annotations

import re
import secrets
from dataclasses import replace
from typing import Any

from capsulert.protocol.conversation import ChatPrompt

OPEN, CLOSE = "\ue000", "\ue001"


class SpecialText:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = tokenizer.get_added_tokens_decoder() if hasattr(tokenizer, "get_added_tokens_decoder") else {}
        specials = sorted({t.content for t in decoder.values() if t.special and t.content}, key=len, reverse=True)
        self._find = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._plain = None  # a copy of the tokenizer that reads special-token text as text (made on first use)

    def hide(self, prompt: ChatPrompt) -> tuple[ChatPrompt, dict[str, str]]:
        """The prompt with the special-token text of its client strings swapped for markers, and what each
        marker stands for ({} and the prompt itself when there is none)."""
        if self._find is None:
            return prompt, {}
        nonce, hidden = secrets.token_hex(8), {}

        def swap(m: re.Match) -> str:
            marker = f"{OPEN}{nonce}{len(hidden)}{CLOSE}"
            hidden[marker] = m.group()
            return marker

        def walk(v: Any) -> Any:
            if isinstance(v, str):
                return self._find.sub(swap, v)
            if isinstance(v, dict):
                return {walk(k): walk(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return type(v)(walk(x) for x in v)
            return v
        out = replace(prompt, messages=walk(prompt.messages), tools=walk(prompt.tools),
                      template_kwargs=walk(prompt.template_kwargs))
        return (out, hidden) if hidden else (prompt, {})

    def encode(self, text: str, hidden: dict[str, str]) -> list[int]:
        """The rendered text's ids: markers as the plain text they stand for, the rest as the tokenizer reads it."""
        if not hidden:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        ids, at = [], 0
        for m in re.finditer("|".join(map(re.escape, hidden)), text):
            ids += self.tokenizer.encode(text[at:m.start()], add_special_tokens=False).ids if m.start() > at else []
            ids += self._plain_tokenizer().encode(hidden[m.group()], add_special_tokens=False).ids
            at = m.end()
        return ids + (self.tokenizer.encode(text[at:], add_special_tokens=False).ids if at < len(text) else [])

    def _plain_tokenizer(self):
        if self._plain is None:
            from tokenizers import Tokenizer

            plain = Tokenizer.from_str(self.tokenizer.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain
