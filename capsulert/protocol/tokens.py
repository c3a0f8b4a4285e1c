"""The one check every text passes before a tokenizer sees it, wherever it enters."""
from __future__ import annotations

from capsulert.errors import InvalidTokenError


def check_text(text: object) -> str:
    """`text` if it is a str the tokenizer can take (valid Unicode: no lone surrogate); else InvalidTokenError."""
    if not isinstance(text, str):
        raise InvalidTokenError(f"text must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidTokenError(f"text is not valid Unicode: {e.reason} at index {e.start} "
                                f"({text[e.start:e.end]!r}); lone surrogates cannot be tokenized") from None
    return text
