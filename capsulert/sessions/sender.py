"""Sender: how a session's requests reach the step scheduler that holds the session. The one session class
(session.py) defines every verb once and holds a sender; the in-process sender (local.py) hands requests to
an AsyncEngine's StepScheduler, the remote one (orchestrator/remote_sender.py) to one worker of the orchestrator's pool.

Invariants every sender keeps:
- `call(request)` runs one typed request (protocol/requests.py) and returns its reply, or raises its typed
  error (capsulert.errors). Session requests on one session run in the order they are sent; control
  requests (ReadTokens, Interrupt, Detokenize) answer while a generate of the session runs.
- `start(request, call_id)` submits a Generate or Turn without waiting and returns a handle; `result(handle,
  ...)` awaits its reply. Cancelling the task that awaits `result` leaves the call running: the session
  interrupts it by `call_id` and awaits the same handle later (its partial result).
- `stream(request, call_id)` yields a TokenEvent per token, then one FinalEvent; closing the iterator
  before its FinalEvent stops the generate at the next token boundary, its tokens committed.
- `post(request)` sends a control request without waiting for its reply (an interrupt on a cancel path).
- `check()` raises WorkerLost at once when the process holding the sender's sessions is gone.
- `placing(name)` makes capsule `name` readable where the session lives (a copy to its worker);
  `making(name)` is held around a snapshot named `name` (the router's per-capsule lock, the view updated).
"""
from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from contextlib import asynccontextmanager
from typing import Any, AsyncGenerator

from capsulert.protocol.requests import Generate, Request, Turn
from capsulert.protocol.results import FinalEvent, TokenEvent


_call_ids = itertools.count(random.getrandbits(32) << 16)


def next_call_id() -> int:
    """A call id unique in this process (what an Interrupt names; a stream's key in the event feed)."""
    return next(_call_ids)


class Sender(ABC):
    #: the namespace the sessions' capsules live in (their snapshots, restores and turns name it)
    namespace: str
    #: the worker holding the sessions (None in-process) and its process id when they were made
    worker: int | None = None
    pid: int | None = None

    @abstractmethod
    async def call(self, request: Request, timeout: float | None = None) -> Any:
        """Run `request`; its reply (or its typed error)."""

    @abstractmethod
    async def start(self, request: Generate | Turn, call_id: int) -> Any:
        """Submit a generate without waiting; a handle for `result`."""

    @abstractmethod
    async def result(self, handle: Any, request: Generate | Turn, timeout: float | None = None) -> Any:
        """The reply of a started generate (a cancelled await leaves the call running)."""

    @abstractmethod
    def stream(self, request: Generate | Turn, call_id: int) -> AsyncGenerator[TokenEvent | FinalEvent, None]:
        """A generate's events; closing the iterator early interrupts it."""

    @abstractmethod
    def post(self, request: Request) -> None:
        """Send a control request without waiting for its reply."""

    @abstractmethod
    def call_format(self) -> str:
        """The markup the sessions' model writes tool calls in ("json" or "xml": its chat template's,
        ChatRenderer.call_format), which a forced tool call's grammar must follow."""

    def check(self) -> None:
        """WorkerLost when the process holding the sessions is gone (in-process: never)."""

    async def placing(self, name: str) -> None:
        """Make capsule `name` readable where the sessions live (in-process: it already is)."""

    @asynccontextmanager
    async def making(self, name: str):
        """Held while a snapshot makes capsule `name` (in-process: the engine's store serialises it)."""
        yield

    def opened(self, session: Any) -> None:
        """A session was handed out (the remote pool counts them per worker)."""

    def closed(self, session: Any) -> None:
        """A handed-out session was closed."""
