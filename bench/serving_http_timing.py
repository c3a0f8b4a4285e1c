"""Where an HTTP request of `bench/serving.py --http` spends its time inside the server (serving_http.py): the
app stamped as it gets the request and writes its last byte, the orchestrator's one-request verbs timed as
the request's worker call. The requests are one at a time, so one clock holds the one in flight."""
from __future__ import annotations

import time


class ServerClock:
    """Where the one request in flight spent its time inside the server: when the app had all of it
    (`entered`), when its worker call started and ended (`called`, `answered`), when its last byte was
    written (`sent`)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.entered = self.called = self.answered = self.sent = None

    def own_ms(self) -> tuple[float, float]:
        """The server's own work on the request, in ms: before its worker call, and after it."""
        return (self.called - self.entered) * 1e3, (self.sent - self.answered) * 1e3

    def app(self, app):
        """The ASGI app `app`, stamping `entered` and `sent`."""
        async def timed(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            self.entered = time.perf_counter()

            async def timed_send(message) -> None:
                await send(message)
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    self.sent = time.perf_counter()
            await app(scope, receive, timed_send)
        return timed


class TimedOrchestrator:
    """The orchestrator as the app sees it, each namespace handle timing the one-request verbs (a request's
    one worker call) into `clock`; everything else is the orchestrator's own."""

    def __init__(self, orch, clock: ServerClock):
        self._orch, self._clock = orch, clock

    def __getattr__(self, name: str):
        return getattr(self._orch, name)

    def namespace(self, name: str) -> "TimedNamespace":
        return TimedNamespace(self._orch.namespace(name), self._clock)


class TimedNamespace:
    def __init__(self, ns, clock: ServerClock):
        self._ns, self._clock = ns, clock

    def __getattr__(self, name: str):
        return getattr(self._ns, name)

    async def restore_append_generate(self, *args, **kw):
        self._clock.called = time.perf_counter()
        try:
            return await self._ns.restore_append_generate(*args, **kw)
        finally:
            self._clock.answered = time.perf_counter()

    async def restore_append_stream(self, *args, **kw):
        self._clock.called = time.perf_counter()
        try:
            async for event in self._ns.restore_append_stream(*args, **kw):
                yield event
        finally:
            self._clock.answered = time.perf_counter()  # its last event
