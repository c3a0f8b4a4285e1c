"""Session: a handle on one slot of the engine's state set. All work is done by its engine (the front door,
engine.py); the engine's session table (session_table.py) is the one writer of its fields."""
from __future__ import annotations

import itertools
from typing import Any, Sequence

import torch

from capsulert.errors import SessionClosedError, StaleSessionError
from capsulert.protocol.requests import Restore, Snapshot
from capsulert.protocol.sampling import SamplingParams

from capsulert.capsule_store.capsule import CapsuleRef
from capsulert.chat.turn import ChatReply, ChatTurn
from capsulert.protocol.conversation import ChatPrompt
from capsulert.protocol.results import GenerateResult

_ids = itertools.count()


class Session:
    """Host-side view of a slot: the token ids committed so far, all of them folded into the slot's live
    state."""

    def __init__(self, engine: Any, slot: int, weights_version: int):
        """`engine`: the front door whose verbs this handle calls (an Engine; typed loosely because the engine
        module imports this one); `weights_version`: the weights the slot's state is computed under."""
        self.engine = engine
        self.slot = slot
        self.id = next(_ids)
        self.tokens: list[int] = []
        # tokens[:decoded_from] came through the prefill path, the rest through one-token decode steps: with
        # the tokens this says how the state was made (None: unknown, restored from a capsule without it)
        self.decoded_from: int | None = 0
        # the slot's tail buffers (engine/tail_replay.py) hold the prefilled tokens from the grid point before
        # tail_end up to it (None: nothing kept); those tokens an append replays instead of re-running them
        self.tail_end: int | None = None
        self.closed = False
        self.stop_reason: str | None = None
        self.interrupt_requested = False  # set by interrupt() from any thread, read by the decode loop
        # the weights version the slot's state was computed under: an update_weights makes the session stale
        # (its state mixes nothing: every verb but close, restore and rederive refuses it)
        self.weights_version = weights_version
        self.restored_from: str | None = None  # the tier a restore or fork that made it read the capsule from

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"slot={self.slot} len={len(self.tokens)}"
        return f"Session(id={self.id}, {state})"

    def check_open(self) -> None:
        if self.closed:
            raise SessionClosedError(f"session {self.id} is closed; open or restore a new one")

    @property
    def stale(self) -> bool:
        """Whether the slot holds state computed under older weights than the engine runs now."""
        return bool(self.tokens) and self.weights_version != self.engine.weights_version

    def check_current(self) -> None:
        """StaleSessionError when the session is stale. An empty one computed nothing: it just moves on to
        the current weights."""
        if self.stale:
            raise StaleSessionError(
                f"session {self.id} holds state computed under weights version {self.weights_version}; the "
                f"engine runs version {self.engine.weights_version} (update_weights since): rederive() it (a "
                "prefill of its tokens under the current weights), restore a capsule into it, or close it")
        self.weights_version = self.engine.weights_version

    def rederive(self) -> int:
        """Recompute the state from the tokens under the current weights (a cold prefill of them); the length."""
        return self.engine.rederive(self)

    def truncate(self, n: int) -> int:
        """Roll back to the first n tokens, bitwise the state a cold prefill of them computes; the length."""
        return self.engine.truncate(self, n)

    def append(self, tokens_or_text: str | Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Prefill more tokens; returns the next-token logits [vocab] (fp32)."""
        return self.engine.append(self, tokens_or_text)

    def logits(self) -> torch.Tensor:
        return self.engine.logits(self)

    def append_chat(self, messages, tools=None, *, add_generation_prompt: bool = True,
                    **template_kwargs) -> torch.Tensor:
        """Append `messages` (OpenAI-style dicts) rendered by the checkpoint's chat template, listing
        `tools` (OpenAI tool definitions) where the template lists tools, and opening the assistant's
        turn; returns the next-token logits. The template sees exactly these messages: give a new
        session the whole conversation, or a session that holds the earlier turns only the new ones."""
        return self.append(ChatPrompt.of(messages, tools, add_generation_prompt, **template_kwargs))

    def chat(self, messages, max_tokens: int | None = None, sampling: SamplingParams | dict | None = None,
             **options) -> ChatReply:
        """One chat turn: append_chat(messages, tools), then generate the assistant's reply and parse it
        (ChatReply: content, tool_calls, finish_reason, result). Takes OpenAI's arguments (tools,
        tool_choice, parallel_tool_calls, response_format, temperature, top_p, n, stop, seed, logprobs,
        top_logprobs; chat/options.py has their defaults), or `sampling` whole; chat-template variables go
        in `template_vars`. An argument it cannot honour is an InvalidRequestError naming it. tool_choice
        "required" or a named function, and response_format ({"type": "json_object"} or {"type":
        "json_schema", "json_schema": {"schema": ...}}), constrain the reply by grammar
        (capsulert/chat/formats.py)."""
        turn = ChatTurn.plan(messages, sampling, max_tokens=max_tokens, call_format=self.engine.codec.chat.call_format,
                             **options)
        self.append(turn.prompt)
        return turn.reply(self.generate(turn.max_tokens, turn.sampling))

    def generate(self, max_new_tokens: int, sampling: SamplingParams | None = None) -> GenerateResult:
        """Sample up to max_new_tokens; each produced token is committed to the state before the next.
        The result is the list of tokens, with logprobs, text and stop reason (protocol/results.py)."""
        return self.engine.generate([self], max_new_tokens, [sampling] if sampling else None)[0]

    def interrupt(self) -> None:
        """Stop a running generate at the next token boundary (thread-safe flag)."""
        self.interrupt_requested = True

    def snapshot(self, name: str, tier: str = Snapshot.tier, pin: bool = Snapshot.pin,
                 namespace: str = Snapshot.namespace, mode: str = Snapshot.mode) -> CapsuleRef:
        return self.engine.snapshot(self, name, tier=tier, pin=pin, mode=mode, namespace=namespace)

    def restore(self, name: str, namespace: str = Restore.namespace) -> str:
        """Replace this session's state with the capsule's, in place (rollback, episode reset); returns the
        tier the capsule was read from (gpu, host or disk)."""
        return self.engine.restore_into(self, name, namespace)

    def close(self) -> None:
        if not self.closed:
            self.engine.release(self)
