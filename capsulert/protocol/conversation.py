"""ChatPrompt: a conversation to append to a session. It travels as the tokens of an append (Session.append_chat,
an Append or Turn request to a worker) and is rendered where the tokenizer is (chat/prompt.py: ChatRenderer), so
every path renders it with the same code."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from capsulert.errors import InvalidRequestError
from capsulert.protocol.messages import messages_arg, tools_arg

# template variables a request cannot set: what the renderer passes itself, the checkpoint's special tokens
# (an `eos_token` of the client's would let it write turns of its own into the prompt) and the environment's
# functions
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "add_generation_prompt", "tools", "bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
    "cls_token", "mask_token", "raise_exception", "strftime_now"})


@dataclass(frozen=True)
class ChatPrompt:
    """Messages (dicts, as a template sees them), the tools the template lists, whether the rendering
    ends by opening the assistant's turn, and extra template variables."""
    messages: tuple[dict, ...]
    tools: tuple[dict, ...] | None = None
    add_generation_prompt: bool = True
    template_kwargs: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, messages, tools=None, add_generation_prompt: bool = True, **template_kwargs) -> "ChatPrompt":
        """Checked arguments of the Python chat API (InvalidRequestError naming what is wrong)."""
        msgs = [m.for_template() for m in messages_arg(messages)]
        specs = tools_arg(tools)
        if not isinstance(add_generation_prompt, bool):
            raise InvalidRequestError(f"add_generation_prompt must be a bool, got {add_generation_prompt!r}")
        reserved = RESERVED_TEMPLATE_VARIABLES & set(template_kwargs)
        if reserved:
            raise InvalidRequestError(f"template variables cannot set {sorted(reserved)}")
        return cls(tuple(msgs), None if specs is None else tuple(t.model_dump(exclude_none=True) for t in specs),
                   add_generation_prompt, tuple(sorted(template_kwargs.items())))
