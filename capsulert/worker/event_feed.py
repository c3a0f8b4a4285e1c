"""One stream of token events per worker, shared by every streamed generate on it.

A streamed Generate or Turn reaches a worker as `Streamed(request, key)`: the worker submits it to its
step scheduler and answers at once; the request's events (each token, then its result or its error) go
into the worker's EventFeed tagged with `key`. The orchestrator holds one `Feed` stream per worker (a Ray
streaming call), whose items are lists of every event produced since the last item, and hands each event to
the consumer subscribed under its key (FeedReader).

Why one stream and not one per generate: with a Ray streaming call per session, a worker serving 64
streams wakes 64 actor threads per decode step, each handing one event to Ray while the step loop waits
for the GIL, and the driver polls 64 generators; one feed is one thread, one item per step and one poller,
whatever the number of sessions.

A key's events arrive in order. Events for a key nobody listens to any more (a consumer that went away) are
dropped; the consumer interrupts its generate (Interrupt(key)), which stops at the next token boundary. A
worker that dies ends its feed: every consumer still waiting gets WorkerLost.
"""
from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any, Callable, Hashable, Iterator

from capsulert.errors import CapsuleRTError, WorkerLost
from capsulert.scheduler.step_scheduler import Sink

Item = tuple[Hashable, str, Any]  # (key, "event" | "done" | "error", TokenEvent | GenerateResult | exception)


class EventFeed:
    """The worker side: events put by the step loop, taken in batches by the one open feed."""

    def __init__(self):
        self._cv = threading.Condition()
        self._items: list[Item] = []
        self._generation = 0

    def put(self, key: Hashable, kind: str, value: Any) -> None:
        if kind == "error" and not isinstance(value, CapsuleRTError):
            # the feed carries plain, picklable errors: an unexpected one travels as its text
            value = RuntimeError(f"{type(value).__name__}: {value}")
        with self._cv:
            self._items.append((key, kind, value))
            self._cv.notify()

    def sink_for(self, key: Hashable, finished: Callable[[], None], events: bool = True) -> Sink:
        """The scheduler sink of one streamed request: its events (with `events`) and then its result or error
        into this feed under `key`; `finished` runs once its result or error is in."""
        def end(kind: str, value: Any) -> None:
            self.put(key, kind, value)
            finished()

        return Sink(done=lambda v: end("done", v), error=lambda e: end("error", e),
                    event=(lambda ev: self.put(key, "event", ev)) if events else None)

    def stream(self) -> Iterator[list[Item]]:
        """Lists of every item put since the last list, as they come. Opening a new stream ends the one
        before (an orchestrator that reconnects takes the feed over).

        The first list is empty: it says the takeover is done. An item put before it may still go to the
        stream before (whose reader may be gone), so the orchestrator submits streamed requests only after
        it (FeedReader.ready)."""
        with self._cv:
            self._generation += 1
            me = self._generation
            self._cv.notify_all()
        yield []
        while True:
            with self._cv:
                while not self._items and self._generation == me:
                    self._cv.wait()
                if self._generation != me:
                    return
                items, self._items = self._items, []
            yield items


class FeedReader:
    """The orchestrator side for one worker: reads its feed and routes each item to its key's queue."""

    def __init__(self, worker: int, open_feed: Callable[[], Any],
                 on_lost: Callable[[BaseException], None] | None = None):
        self.worker = worker
        self.subs: dict[Hashable, asyncio.Queue] = {}
        # done once the worker has handed this reader the feed (its first, empty item), or the feed ended
        self.ready = asyncio.get_running_loop().create_future()
        self._on_lost = on_lost  # called with the error that ended the feed (the worker's death, say)
        self._ended = False
        # in a context of its own: a feed opened while serving one request (a Ray Serve replica's) would
        # otherwise be that request's child task, and cancelled with it
        self.task = asyncio.get_running_loop().create_task(self._pump(open_feed), context=contextvars.Context())

    @property
    def open(self) -> bool:
        return not self._ended and not self.task.done()

    def subscribe(self, key: Hashable) -> asyncio.Queue:
        q = self.subs[key] = asyncio.Queue()
        return q

    def unsubscribe(self, key: Hashable) -> None:
        self.subs.pop(key, None)

    async def _pump(self, open_feed: Callable[[], Any]) -> None:
        why = "its event feed ended"
        try:
            async for ref in open_feed():
                items = await ref
                if not self.ready.done():
                    self.ready.set_result(None)
                for key, kind, value in items:
                    q = self.subs.get(key)
                    if q is not None:
                        q.put_nowait((kind, value))
        except Exception as e:  # noqa: BLE001 - whatever ended the feed, its consumers learn it below
            why = f"{type(e).__name__}"
            if self._on_lost is not None:
                self._on_lost(e)
        self._fail_all(why)

    def end(self, why: str) -> None:
        """The worker is known gone (its lifeline ended) before its feed says so: stop reading, and every
        consumer still waiting gets WorkerLost now."""
        self._ended = True
        self.task.cancel()
        self._fail_all(why)

    def _fail_all(self, why: str) -> None:
        # no await here: a consumer subscribing after this sees the task done and opens a new feed
        if not self.ready.done():
            self.ready.set_result(None)
        lost = WorkerLost(f"worker {self.worker} was lost with requests in flight on it ({why}); they did not "
                          "complete and its sessions are gone")
        for q in self.subs.values():
            q.put_nowait(("error", lost))
        self.subs.clear()
