"""ChatRenderer: a conversation to append to a session (protocol/conversation.py: ChatPrompt) rendered by
the checkpoint's chat template where the tokenizer is; it travels as the tokens of an append (Session.append_chat, an Append or
Turn request to a worker), so every path renders it with the same code."""
from __future__ import annotations

from pathlib import Path

from capsulert.chat.special_text import SpecialText
from capsulert.protocol.conversation import ChatPrompt
from capsulert.errors import InvalidRequestError
from capsulert.protocol.tokens import check_text


class ChatRenderer:
    """A model's chat template with its tokenizer: ChatPrompt -> prompt text -> token ids. The template
    is read on first use (model_dir None: capsulert's default template)."""

    def __init__(self, model_dir: Path | None, tokenizer, eos_token: str | None = None):
        self.model_dir, self.tokenizer, self.eos_token = model_dir, tokenizer, eos_token
        self._template = None
        self._special = None

    @property
    def template(self):
        if self._template is None:
            from capsulert.chat.template import ChatTemplate

            self._template = ChatTemplate.for_model(self.model_dir, self.eos_token)
        return self._template

    @property
    def call_format(self) -> str:
        """The tool-call markup the template writes: "xml" or "json" (ChatTemplate.call_format)."""
        return self.template.call_format

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
        if self._special is None:
            self._special = SpecialText(self.tokenizer)
        prompt, hidden = self._special.hide(prompt)  # client text never becomes a special token (special_text.py)
        text = self.text(prompt)
        return self._special.encode(check_text(text), hidden) if text else []
