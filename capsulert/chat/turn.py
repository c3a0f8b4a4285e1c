"""ChatTurn: one chat turn planned (the prompt to append and the sampling, with the constraint its
tool_choice or response_format imposes) and ChatReply: what came back (content, parsed tool calls, the
OpenAI finish reason and the GenerateResult). The Python chat API and the HTTP server both plan and read
turns here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from capsulert.chat.formats import check_tool_choice, format_constraint, tool_constraint
from capsulert.protocol.messages import tool_choice_arg, tools_arg
from capsulert.protocol.conversation import ChatPrompt
from capsulert.chat.tool_calls import ToolCall, parse_reply
from capsulert.errors import InvalidRequestError
from capsulert.protocol.sampling import SamplingParams
from capsulert.protocol.results import GenerateResult

# a generate's stop reason as OpenAI's finish_reason (a reply with tool calls finishes with "tool_calls")
FINISH_REASON = {"eos": "stop", "stop_token": "stop", "stop_string": "stop", "interrupted": "stop",
                 "grammar_end": "stop", "length": "length", "max_seq": "length"}


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

    @classmethod
    def plan(cls, messages, sampling: SamplingParams | None = None, *, tools=None, tool_choice: Any = "auto",
             response_format: Any = None, parallel_tool_calls: bool = True, structured_outputs: Any = None,
             add_generation_prompt: bool = True, **template_kwargs) -> "ChatTurn":
        """Check a turn's arguments and decide its constraint: tool_choice "required" or a named function
        (a grammar of tool calls), or response_format / structured_outputs (a JSON schema, any JSON
        object, a regex, a grammar); not both. InvalidRequestError names what is wrong."""
        specs = tools_arg(tools)
        choice = tool_choice_arg(tool_choice)
        check_tool_choice(specs, choice)
        from_tools = tool_constraint(specs, choice, parallel_tool_calls)
        from_format = format_constraint(response_format, structured_outputs)
        if from_tools is not None and from_format is not None:
            raise InvalidRequestError("tool_choice 'required' or a named function cannot be combined with a "
                                      "response_format or structured_outputs")
        sampling = sampling if sampling is not None else SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequestError(f"sampling must be SamplingParams or None, got {type(sampling).__name__}")
        constraint = from_tools or from_format
        if constraint is not None:
            if sampling.constraint is not None:
                raise InvalidRequestError("the sampling params already carry a constraint")
            sampling = sampling.model_copy(update={"constraint": constraint})
        prompt = ChatPrompt.of(messages, tools, add_generation_prompt, **template_kwargs)
        return cls(prompt, sampling, parse_tools=specs is not None and choice != "none")

    def reply(self, result: GenerateResult) -> ChatReply:
        text = result.text or ""
        content, calls = parse_reply(text) if self.parse_tools else (text, [])
        reason = "tool_calls" if calls else FINISH_REASON.get(result.stop_reason or "length", "stop")
        return ChatReply(content, calls, reason, result)
