"""Lifeline: a TCP socket the worker process listens on, so that whoever holds a connection to it learns of
the process's death at once.

Ray tells callers that an actor died through its control store; under load that takes most of a second
(0.3-0.8 s from the kill to the failed calls, measured on a 2-core box with 30 calls in flight). The operating
system closes a process's sockets the moment the process dies, and the other end of a connection then reads
the end of its stream, whatever the process was doing. So the orchestrator holds one connection to each worker
process (orchestrator/lifeline.py) and takes its end for the process's death. The worker never writes to a
connection nor closes one itself: an end means the process exited, or its host went away.
"""
from __future__ import annotations

import selectors
import socket
import threading


class Lifeline:
    """The listening socket and the thread that accepts connections and holds them open."""

    def __init__(self, host: str):
        self._server = socket.create_server((host, 0))
        self.address = (host, self._server.getsockname()[1])
        self._thread = threading.Thread(target=self._serve, name="capsulert-lifeline", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._server, selectors.EVENT_READ)
        while True:
            for key, _ in sel.select():
                sock = key.fileobj
                if sock is self._server:
                    conn, _ = self._server.accept()
                    conn.setblocking(False)
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                try:
                    data = sock.recv(64)  # type: ignore[union-attr]
                except OSError:
                    data = b""
                if not data:  # the holder went away (an orchestrator that closed or died): forget it
                    sel.unregister(sock)
                    sock.close()  # type: ignore[union-attr]
