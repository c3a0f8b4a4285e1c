"""Chat: the checkpoint's chat template, tool calls and structured output, shared by the in-process API
(Session.append_chat / chat, Engine.chat, their async forms, the orchestrator's sessions) and the HTTP server. Nothing
here imports FastAPI or Ray.

    template.py    ChatTemplate: the checkpoint's template, rendered as transformers renders it
    (protocol/messages.py: ChatMessage, ToolSpec, ToolChoice, what a conversation and its tools are)
    prompt.py      ChatPrompt (a conversation to append, rendered where the tokenizer is) and ChatRenderer
    tool_calls.py  ToolCall; the model's tool-call markup parsed, whole and as a stream
    formats.py     tool_choice and response_format as a decoding Constraint
    turn.py        ChatTurn (a conversation planned into a prompt and sampling) and ChatReply
"""
from capsulert.protocol.messages import ToolSpec
from capsulert.protocol.conversation import ChatPrompt
from capsulert.chat.tool_calls import ToolCall
from capsulert.chat.turn import ChatReply, ChatTurn

__all__ = ["ChatPrompt", "ChatReply", "ChatTurn", "ToolCall", "ToolSpec"]
