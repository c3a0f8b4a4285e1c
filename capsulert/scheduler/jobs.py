"""A step scheduler job and its typed phases, and the sinks a job's outcome goes to.

A session request the scheduler starts becomes a Job. Its starter (StepScheduler.STARTERS) either answers
at once (a capsule copy, a close) or queues the job's phases: a Prefill (tokens to append, in budgeted
pieces) and / or a Decode (one token per step, batched with every other running generate). The job then
runs its phases in order; `phase` says which one it is in, so the loop picks its prefill and decode jobs by
that alone.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from capsulert.progress import Bar, NullBar
from capsulert.protocol.requests import Request, Tokens
from capsulert.protocol.results import FinalEvent, TokenEvent
from capsulert.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from capsulert.engine.decoding import DecodeStream


class Phase(Enum):
    PREFILL = "prefill"  # appending tokens, one budgeted piece per step
    DECODE = "decode"  # one token per step, in the batched decode step


@dataclass(frozen=True)
class Prefill:
    """Append `tokens` as the request gave them (text, a chat prompt or ids): checked once, by the scheduler,
    when the phase begins (the session's room is known only then), and never again on the way to the slot."""
    tokens: Tokens
    phase: ClassVar[Phase] = Phase.PREFILL


@dataclass(frozen=True)
class Decode:
    """Generate up to `max_new_tokens` tokens."""
    max_new_tokens: int
    sampling: SamplingParams | None
    phase: ClassVar[Phase] = Phase.DECODE


@dataclass
class Sink:
    """Where a request's outcome goes (called on the loop thread)."""
    done: Callable[[Any], object]  # what a callback returns is ignored
    error: Callable[[BaseException], object]
    event: Callable[[TokenEvent], object] | None = None


def queue_sink(put: Callable[[tuple[str, Any]], object]) -> Sink:
    """A sink that puts ("event", ev), ("done", result) or ("error", exc) items through `put`."""
    return Sink(done=lambda v: put(("done", v)), error=lambda e: put(("error", e)),
                event=lambda ev: put(("event", ev)))


def stream_item(item: tuple[str, Any]) -> TokenEvent | FinalEvent:
    """The stream event of a queue_sink item: a TokenEvent, the FinalEvent (the last one), or the error raised."""
    kind, value = item
    if kind == "error":
        raise value
    return value if kind == "event" else FinalEvent(value)


@dataclass
class Job:
    request: Request
    sink: Sink
    session: int | None  # the session it runs on, once known
    deadline: float = 0.0  # for slot waits
    steps: deque[Prefill | Decode] = field(default_factory=deque)  # phases still to run, in order
    phase: Phase | None = None  # the phase it is in (None: not started, or answered)
    prefill: list[int] | None = None  # checked token ids still to append (Phase.PREFILL)
    undo: list[int] | None = None  # its session's tokens before its prefill began (a failure puts them back)
    stream: DecodeStream | None = None  # its generate (Phase.DECODE)
    cancelled: bool = False
    opened: bool = False  # it made its session (Open): a refusal of its prompt closes it again
    want_logits: bool = False  # its reply carries the next-token logits (Append(logits=True))
    close_after: bool = False  # its session closes once it finished (Turn(close=True))
    restored_from: str | None = None  # the tier its restore read the capsule from
    restore_s: float | None = None  # and the time that restore took here
    # its capsule restored already, with the step's other restores (scheduler/restore_batch.py): the session
    # it went into (new or its own), the tier and the time
    restored: tuple[object, str, float] | None = None
    cached_tokens: int = 0  # tokens its appends restored from the prefix cache instead of prefilling
    bar: Bar = field(default_factory=NullBar)  # a long prefill's progress, one chunk piece per update
