"""Chat templates: the model's own (as Hugging Face checkpoints ship it) rendered the way transformers'
`apply_chat_template` renders it, so a chat request becomes exactly the prompt text the model was
trained on.

Where the template comes from, first found wins: `chat_template.jinja` in the checkpoint directory (what
transformers writes since 4.43), the `chat_template` of its `tokenizer_config.json` (a string, or a list
of named templates of which "default" is used), else the small template capsulert ships for its embedded
default model (`capsulert/data/chat_template.jinja`).

Tools reach the template as transformers passes them: `tools`, a list of OpenAI tool definitions
({"type": "function", "function": {"name", "description", "parameters"}}); assistant messages carry
their `tool_calls` and `tool` messages their results, and the template writes both in the model's markup.

The environment matches transformers': a sandbox whose templates cannot touch Python objects,
trim_blocks and lstrip_blocks, the loopcontrols extension, `raise_exception`, `strftime_now`, a `tojson`
that leaves non-ASCII text and HTML characters alone, `{% generation %}` blocks accepted (rendered as
their content), and the special tokens of tokenizer_config.json (bos_token, eos_token, ...) as
variables, passed only when the checkpoint defines them (a template may test `bos_token is defined`).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from capsulert.errors import InvalidRequestError

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; for rendering a
    prompt it is just its content."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_content"), [], [], body).set_lineno(lineno)

    def _content(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    origin: str  # where the template came from (logged at start)
    special_tokens: dict[str, str] = field(default_factory=dict)
    compiled: jinja2.Template = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        try:
            compiled = _environment().from_string(self.source)
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"the chat template of {self.origin} does not compile: {e}") from None
        object.__setattr__(self, "compiled", compiled)  # frozen: compiled once, here

    @property
    def call_format(self) -> str:
        """How the template writes an assistant's tool calls back: "xml" (`<function=NAME><parameter=P>`,
        Qwen3.5's and Qwen3-Coder's) or "json" (`{"name": ..., "arguments": ...}`, Qwen3's and the default)."""
        return "xml" if "<function=" in self.source else "json"

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **variables: Any) -> str:
        """The prompt text of a conversation; a template that refuses it (raise_exception, a missing
        variable it requires) is an InvalidRequestError carrying the template's message."""
        try:
            context = {**variables, **self.special_tokens}  # the checkpoint's tokens, never a request's
            return self.compiled.render(context, messages=messages, add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:  # a template's own bug, hit by these messages
            raise InvalidRequestError(f"chat template cannot render these messages: {type(e).__name__}: {e}") from None

    @classmethod
    def for_model(cls, model_dir: Path | None, eos_token: str | None = None) -> "ChatTemplate":
        """The template of the checkpoint in `model_dir`, else capsulert's default. `eos_token` (the text
        of the config's EOS id) fills in when tokenizer_config.json names none."""
        config = _tokenizer_config(model_dir)
        tokens = {k: v for k in SPECIAL_TOKENS if (v := _token_text(config.get(k))) is not None}
        if eos_token is not None:
            tokens.setdefault("eos_token", eos_token)
        if model_dir is not None and (model_dir / "chat_template.jinja").is_file():
            path = model_dir / "chat_template.jinja"
            return cls(path.read_text(encoding="utf-8"), str(path), tokens)
        source = _named_template(config.get("chat_template"))
        if source is not None:
            return cls(source, f"{model_dir}/tokenizer_config.json", tokens)
        if model_dir is not None and config:
            log.warning("%s has no chat template; chat requests use capsulert's default template", model_dir)
        return cls(DEFAULT_TEMPLATE.read_text(encoding="utf-8"), "capsulert's default template", tokens)


def _tokenizer_config(model_dir: Path | None) -> dict:
    f = None if model_dir is None else model_dir / "tokenizer_config.json"
    if f is None or not f.is_file():
        return {}
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable %s: %s", f, e)
        return {}
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _named_template(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None
