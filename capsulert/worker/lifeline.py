"""Lifeline: a TCP socket the worker process listens on, so that whoever holds a connection to it learns of
the process's death at once.

Ray tells callers that an actor died through its control store; under load that takes most of a second
(0.3-0.8 s from the kill to the failed calls, measured on a 2-core box with 30 calls in flight). The operating
system closes a process's sockets the moment the process dies, and the other end of a connection then reads
the end of its stream, whatever the process was doing. So the orchestrator holds one connection to each worker
process (orchestrator/lifeline.py) and takes its end for the process's death. The worker writes one byte (HELD)
to a connection, once, when it takes its token, and nothing after: an end after that byte means the process
exited, or its host went away; an end before it is a refused handshake (a wrong token, or one sent too late by
an orchestrator whose event loop was held up), which the watch answers by connecting again.

The socket listens on the node's address (the orchestrator may run on another node), so anything that can
reach the node can connect. A connection is held only after it sent the process's secret (`token`, random
per process, given to the orchestrator in the worker's Ping over Ray) within HANDSHAKE_S; one that sends
anything else, or nothing in time, is closed. At most MAX_PENDING connections wait for their handshake and
MAX_HELD are held (a newcomer past either bound is closed at once), accepts are paced to ACCEPTS_PER_S (a
flood waits in the kernel's backlog instead of taking the GIL from decode), and an accept that fails (out of
descriptors: EMFILE) is retried after a pause instead of ending the thread. So a hostile client costs the
process a bounded number of descriptors and little CPU, and the lifeline keeps serving.
"""
from __future__ import annotations

import hmac
import logging
import secrets
import selectors
import socket
import threading
import time

log = logging.getLogger(__name__)

TOKEN_BYTES = 16
HELD = b"\x01"  # written once a connection's token is taken: from then on its end is the process's death
HANDSHAKE_S = 2.0  # a connection must send the token within this
MAX_PENDING = 32  # connections waiting for their handshake
MAX_HELD = 16  # authenticated connections (one per orchestrator watching this process)
ACCEPTS_PER_S = 200.0
ACCEPT_ERROR_PAUSE_S = 0.1  # after a failed accept (EMFILE, ENFILE, ENOBUFS)


class Lifeline:
    """The listening socket and the thread that accepts connections, checks their token and holds them."""

    def __init__(self, host: str):
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._server = socket.create_server((host, 0), backlog=64)
        self._server.setblocking(False)
        self.address = (host, self._server.getsockname()[1])
        self._pending: dict[socket.socket, tuple[float, bytes]] = {}  # conn -> (deadline, bytes so far)
        self._held: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._serve, name="capsulert-lifeline", daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        """Descriptors the lifeline holds besides its listening socket (waiting for a handshake, or held)."""
        return len(self._pending) + len(self._held)

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        next_accept = 0.0
        while True:
            now = time.monotonic()
            self._listen(sel, next_accept <= now)  # paced: the listening socket is looked at again only then
            wake = min((d for d, _ in self._pending.values()), default=now + 60.0)
            if next_accept > now:
                wake = min(wake, next_accept)
            for key, _ in sel.select(max(wake - now, 0.0)):
                if key.fileobj is self._server:
                    next_accept = self._accept(sel)
                else:
                    self._read(sel, key.fileobj)  # type: ignore[arg-type]
            now = time.monotonic()
            for conn in [c for c, (d, _) in self._pending.items() if d <= now]:
                self._drop(sel, conn)  # no token in time

    def _listen(self, sel: selectors.BaseSelector, on: bool) -> None:
        listening = self._server.fileno() in sel.get_map()
        if on and not listening:
            sel.register(self._server, selectors.EVENT_READ)
        elif not on and listening:
            sel.unregister(self._server)

    def _accept(self, sel: selectors.BaseSelector) -> float:
        """Accept one connection; when the next accept may run."""
        now = time.monotonic()
        try:
            conn, _ = self._server.accept()
        except BlockingIOError:
            return now
        except OSError as e:  # out of descriptors, say: the thread goes on, after a pause
            log.warning("lifeline: accept failed (%s); retrying in %g s", e, ACCEPT_ERROR_PAUSE_S)
            return now + ACCEPT_ERROR_PAUSE_S
        if len(self._pending) >= MAX_PENDING or len(self._held) >= MAX_HELD:
            conn.close()
        else:
            conn.setblocking(False)
            self._pending[conn] = (now + HANDSHAKE_S, b"")
            sel.register(conn, selectors.EVENT_READ)
        return now + 1.0 / ACCEPTS_PER_S

    def _read(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        try:
            data = conn.recv(TOKEN_BYTES)
        except OSError:
            data = b""
        if conn in self._held or not data:  # the holder went away, or a held one wrote: forget it
            self._drop(sel, conn)
            return
        deadline, got = self._pending[conn]
        got += data
        if not hmac.compare_digest(got, self.token[:len(got)]):
            self._drop(sel, conn)
        elif len(got) == TOKEN_BYTES:
            del self._pending[conn]
            try:
                conn.send(HELD)  # one byte into an empty send buffer: never blocks
            except OSError:
                self._drop(sel, conn)
                return
            self._held.add(conn)
        else:
            self._pending[conn] = (deadline, got)

    def _drop(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        self._pending.pop(conn, None)
        self._held.discard(conn)
        sel.unregister(conn)
        conn.close()
