"""ChatPrompt: a conversation to append to a session, rendered by the checkpoint's chat template where
the tokenizer is (ChatRenderer); it travels as the tokens of an append (Session.append_chat, an Append or
Turn request to a worker), so every path renders it with the same code."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capsulert.chat.messages import messages_arg, tools_arg
from capsulert.errors import InvalidRequestError
from capsulert.protocol.tokens import check_text


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
        reserved = {"messages", "add_generation_prompt", "tools"} & set(template_kwargs)
        if reserved:
            raise InvalidRequestError(f"template variables cannot set {sorted(reserved)}")
        return cls(tuple(msgs), None if specs is None else tuple(t.model_dump(exclude_none=True) for t in specs),
                   add_generation_prompt, tuple(sorted(template_kwargs.items())))


class ChatRenderer:
    """A model's chat template with its tokenizer: ChatPrompt -> prompt text -> token ids. The template
    is read on first use (model_dir None: capsulert's default template)."""

    def __init__(self, model_dir: Path | None, tokenizer, eos_token: str | None = None):
        self.model_dir, self.tokenizer, self.eos_token = model_dir, tokenizer, eos_token
        self._template = None

    @property
    def template(self):
        if self._template is None:
            from capsulert.chat.template import ChatTemplate

            self._template = ChatTemplate.for_model(self.model_dir, self.eos_token)
        return self._template

    def text(self, prompt: ChatPrompt) -> str:
        variables = dict(prompt.template_kwargs)
        if prompt.tools is not None:
            variables["tools"] = [dict(t) for t in prompt.tools]
        return self.template.render([dict(m) for m in prompt.messages], prompt.add_generation_prompt, **variables)

    def encode(self, prompt: ChatPrompt) -> list[int]:
        """The prompt's token ids: the rendered text already holds the special tokens the model expects
        (a BOS among them, if any), so none is added (as transformers does)."""
        if self.tokenizer is None:
            raise InvalidRequestError("the model has no tokenizer: a chat prompt cannot be encoded")
        text = self.text(prompt)
        return self.tokenizer.encode(check_text(text), add_special_tokens=False).ids if text else []
