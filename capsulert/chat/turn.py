"""ChatTurn: one chat turn planned (the prompt to append and the sampling, with the constraint its
tool_choice or response_format imposes) and ChatReply: what came back (content, parsed tool calls, the
OpenAI finish reason and the GenerateResult). The Python chat API and the HTTP server both plan and read
turns here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from capsulert.chat.formats import check_tool_choice, format_constraint, tool_constraint
from capsulert.chat.options import ChatOptions
from capsulert.protocol.messages import tool_choice_arg, tools_arg
from capsulert.protocol.conversation import ChatPrompt
from capsulert.chat.tool_calls import ToolCall, split_reply
from capsulert.errors import InvalidRequestError
from capsulert.protocol.sampling import DEFAULT_MAX_TOKENS, SamplingParams
from capsulert.protocol.results import GenerateResult

# a generate's stop reason as OpenAI's finish_reason (a reply with tool calls finishes with "tool_calls")
FINISH_REASON = {"eos": "stop", "stop_token": "stop", "stop_string": "stop", "interrupted": "stop",
                 "grammar_end": "stop", "length": "length", "max_seq": "length"}


def cut_off(stop_reason: str | None) -> bool:
    """Whether a generate ended at a token limit (max_tokens, max_seq): its text may end inside a call."""
    return FINISH_REASON.get(stop_reason or "length") == "length"


def finish_reason(stop_reason: str | None, calls: int, dropped: bool) -> str:
    """A chat reply's finish_reason: "length" when a call was cut off (and dropped), else "tool_calls" when
    it made calls, else its stop reason's. The server (whole and streamed) and ChatReply all use this."""
    if dropped:
        return "length"
    return "tool_calls" if calls else FINISH_REASON.get(stop_reason or "length", "stop")


def read_reply(text: str, stop_reason: str | None) -> tuple[str | None, list[ToolCall], str]:
    """(content, calls, finish_reason) of a whole reply of a turn that parses tool calls: a call cut off by
    a token limit is neither a call nor content."""
    content, calls, dropped = split_reply(text, cut_off(stop_reason))
    return content, calls, finish_reason(stop_reason, len(calls), dropped)


@dataclass(frozen=True)
class ChatReply:
    """A chat turn's answer: `content` (the text outside tool calls; None when the reply is only calls),
    `tool_calls` (parsed from the model's markup when the turn had tools and tool_choice was not
    "none"), `finish_reason` ("tool_calls" when there are calls, else stop or length) and `result`, the
    GenerateResult (tokens, logprobs, the raw text, stop_reason)."""
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str
    result: GenerateResult

    def message(self) -> dict:
        """The reply as an assistant message to append to the conversation for the next turn."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or ""}
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return msg


@dataclass(frozen=True)
class ChatTurn:
    prompt: ChatPrompt
    sampling: SamplingParams
    parse_tools: bool
    max_tokens: int = DEFAULT_MAX_TOKENS

    @classmethod
    def plan(cls, messages, sampling: Any = None, *, tools=None, tool_choice: Any = "auto",
             response_format: Any = None, parallel_tool_calls: bool = True, structured_outputs: Any = None,
             add_generation_prompt: bool = True, template_vars: dict | None = None, call_format: str = "json",
             **options) -> "ChatTurn":
        """Check a turn's arguments and decide its constraint: tool_choice "required" or a named function
        (a grammar of tool calls), or response_format / structured_outputs (a JSON schema, any JSON
        object, a regex, a grammar); not both. `sampling` (SamplingParams or a dict of its fields) or the
        OpenAI arguments in `options` (max_tokens, temperature, top_p, n, stop, seed, logprobs,
        top_logprobs: chat/options.py) say how to draw; `template_vars` are the chat template's own
        variables; `call_format` is the markup a forced call is written in (the template's: ChatRenderer.
        call_format). InvalidRequestError names what is wrong, an unknown argument included."""
        opts = ChatOptions.of(sampling=sampling, **options)
        specs = tools_arg(tools)
        choice = tool_choice_arg(tool_choice)
        check_tool_choice(specs, choice)
        from_tools = tool_constraint(specs, choice, parallel_tool_calls, call_format)
        from_format = format_constraint(response_format, structured_outputs)
        if from_tools is not None and from_format is not None:
            raise InvalidRequestError("tool_choice 'required' or a named function cannot be combined with a "
                                      "response_format or structured_outputs")
        sampling = opts.sampling_params()
        constraint = from_tools or from_format
        if constraint is not None:
            if sampling.constraint is not None:
                raise InvalidRequestError("the sampling params already carry a constraint")
            sampling = sampling.model_copy(update={"constraint": constraint})
        template_vars = _template_vars(template_vars)
        prompt = ChatPrompt.of(messages, tools, add_generation_prompt, **template_vars)
        return cls(prompt, sampling, specs is not None and choice != "none", opts.token_limit)

    def reply(self, result: GenerateResult) -> ChatReply:
        """The reply `result` is, read: content, the calls it made (when the turn parses them), finish_reason."""
        text = result.text or ""
        if not self.parse_tools:
            return ChatReply(text, [], finish_reason(result.stop_reason, 0, False), result)
        return ChatReply(*read_reply(text, result.stop_reason), result)


def _template_vars(template_vars: Any) -> dict:
    if template_vars is None:
        return {}
    if not isinstance(template_vars, dict) or not all(isinstance(k, str) for k in template_vars):
        raise InvalidRequestError(f"template_vars must be a dict of names to values, got {template_vars!r:.60}")
    reserved = {"messages", "add_generation_prompt", "tools"} & set(template_vars)
    if reserved:
        raise InvalidRequestError(f"template_vars cannot set {sorted(reserved)}: they are chat arguments of their own")
    return template_vars
