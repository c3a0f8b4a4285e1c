"""The orchestrator's end of a worker process's lifeline (worker/lifeline.py): one connection per process,
whose end is that process's death, seen in milliseconds instead of the most of a second Ray's own
notice can take under load.

A watch belongs to one process (its pid): a restarted worker gets a new watch, and an end seen after the
worker moved on to a new process is ignored by the pool. A worker whose lifeline cannot be reached (a
firewall between nodes, say) is still watched by Ray: the watch logs that once and sees nothing. The watch
first sends the process's secret (its Ping's `lifeline_token`): the worker holds only connections that do, and
says so with one byte (HELD). Only an end after that byte is the process's death; an end before it (the token
came too late, the event loop here having been held up past the worker's handshake time) is answered by
connecting again, and a connect the process's port refuses then is its death.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Callable

from capsulert.worker.lifeline import HELD

log = logging.getLogger(__name__)

HANDSHAKE_TRIES = 3  # connections whose token the worker may refuse before the watch leaves it to Ray


class ProcessExited(Exception):
    """Internal: a worker process's lifeline ended (the process is gone)."""


class ProcessWatch:
    def __init__(self, worker: int, pid: int, address: tuple[str, int], on_exit: Callable[[int, int], None],
                 token: bytes):
        self.worker, self.pid, self._token = worker, pid, token
        loop = asyncio.get_running_loop()
        self.connected: asyncio.Future = loop.create_future()  # done once the connection stands
        self.exited: asyncio.Future = loop.create_future()  # done when the process is seen gone
        # in a context of its own: a watch started while serving one request must not be cancelled with it
        self.task = loop.create_task(self._watch(address, on_exit), context=contextvars.Context())

    async def _watch(self, address: tuple[str, int], on_exit: Callable[[int, int], None]) -> None:
        for attempt in range(HANDSHAKE_TRIES):
            try:
                reader, writer = await asyncio.open_connection(*address)
            except OSError as e:
                if attempt:  # it listened a moment ago and refuses now: the process is gone
                    break
                log.warning("worker %d: its lifeline at %s:%d cannot be reached (%s); its death is seen through "
                            "Ray only, which can take a second", self.worker, *address, e)
                return
            try:
                writer.write(self._token)
                await writer.drain()
                held = await reader.read(len(HELD)) == HELD
            except OSError:
                held = False
            if not held:  # a refused handshake, or the process died during it: the next connect tells which
                writer.close()
                continue
            self.connected.set_result(None)
            try:
                await reader.read()  # nothing more is written: this returns at the end of the stream
            except OSError:
                pass
            finally:
                writer.close()
            break
        else:
            log.warning("worker %d: its lifeline at %s:%d refused the process's token %d times; its death is seen "
                        "through Ray only", self.worker, *address, HANDSHAKE_TRIES)
            return
        self.exited.set_result(None)
        on_exit(self.worker, self.pid)

    def close(self) -> None:
        self.task.cancel()
