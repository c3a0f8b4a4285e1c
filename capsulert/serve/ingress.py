"""The replica's own HTTP server (ServerOptions.direct_ingress): uvicorn serving the app on host:port in the
replica's event loop, and the middleware that cancels a request whose client went away (as Serve's proxy
does when it fronts the replica)."""
from __future__ import annotations

import asyncio
import logging
import time

from capsulert.errors import ConfigError
from capsulert.serve.streaming import CANCELS_ON_DISCONNECT

log = logging.getLogger(__name__)
ACCESS_LOG = logging.getLogger("capsulert.serve.access")  # ServerOptions.access_log


class DirectIngress:
    """uvicorn serving the app on host:port in this event loop (the replica's own HTTP server)."""

    # the requests in flight when the replica stops get this long (within the deployment's
    # graceful_shutdown_timeout_s) before they are cancelled
    SHUTDOWN_S = 15.0
    KEEP_ALIVE_S = 90  # an idle client connection is kept this long (as Serve's proxy does)

    def __init__(self, server, task: asyncio.Task):
        self.server, self.task = server, task

    @classmethod
    async def start(cls, app, host: str, port: int, access_log: bool) -> "DirectIngress":
        import socket

        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        # SO_REUSEADDR: a restarted server binds at once, whatever connections of the last one linger
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        if access_log:  # capsulert's logger (the replica's stderr, which Ray forwards to the driver), at INFO
            ACCESS_LOG.setLevel(logging.INFO)
        config = uvicorn.Config(CancelOnDisconnect(app, access_log), host=host, port=port, lifespan="off",
                                http=head_with_body_protocol(), access_log=False, log_config=None,
                                timeout_keep_alive=cls.KEEP_ALIVE_S, timeout_graceful_shutdown=cls.SHUTDOWN_S)
        server = uvicorn.Server(config)
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                sock.close()
                task.result()  # its error
                raise RuntimeError(f"the HTTP server on {host}:{port} did not start")
            await asyncio.sleep(0.01)
        # uvicorn picks httptools when installed; the loop is the replica's (uvloop under Ray)
        log.debug("HTTP server on %s:%d: %s, %s", host, port, config.http_protocol_class.__name__,
                  type(asyncio.get_running_loop()).__module__)
        return cls(server, task)

    def check(self) -> None:
        if self.task.done():
            raise RuntimeError("the replica's HTTP server stopped")

    async def stop(self) -> None:
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), self.SHUTDOWN_S + 2)
        except Exception as e:
            log.debug("stopping the HTTP server: %s: %s", type(e).__name__, e)
            self.task.cancel()


class HeadWithBody:
    """A connection's transport that holds a response's head (its status line and headers, which uvicorn
    writes alone) until the body's first write, so both leave in one write and one TCP segment: the client
    reads each answer once, not twice. A head no body follows in the same loop turn (a stream whose first
    event is not ready, an interim 100 Continue) goes out at the end of that turn."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport, self._loop = transport, loop
        self._head: bytes | None = None

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def write(self, data) -> None:
        if self._head is not None:
            data, self._head = self._head + data, None
        elif data[:9] == b"HTTP/1.1 " and data[-4:] == b"\r\n\r\n":
            self._head = bytes(data)
            self._loop.call_soon(self.flush)
            return
        self._transport.write(data)

    def flush(self) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            self._transport.write(head)

    def close(self) -> None:
        self.flush()
        self._transport.close()


def head_with_body_protocol() -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools when installed, else h11) with its connections' transports
    wrapped in HeadWithBody."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    def connection_made(self, transport) -> None:
        AutoHTTPProtocol.connection_made(self, HeadWithBody(transport, asyncio.get_running_loop()))

    return type("HeadWithBody" + AutoHTTPProtocol.__name__, (AutoHTTPProtocol,), {"connection_made": connection_made})


class CancelOnDisconnect:
    """ASGI middleware: a client that goes away before its response is complete cancels the request's
    handler (its generates are interrupted at the next token and its sessions closed), as Serve's proxy
    does; uvicorn alone would let a non-streamed request run to its end for nobody. With `access_log`, a
    line per request."""

    def __init__(self, app, access_log: bool = False):
        self.app, self.access_log = app, access_log

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self.access_log:
            return await self._call(scope, receive, send)
        t0, status = time.perf_counter(), [None]

        async def logged_send(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
        try:
            await self._call(scope, receive, logged_send)
        finally:
            client = scope.get("client")
            ACCESS_LOG.info("%s %s %s %s %.1fms", f"{client[0]}:{client[1]}" if client else "-", scope["method"],
                            scope["path"], status[0] or "-", (time.perf_counter() - t0) * 1e3)

    async def _call(self, scope, receive, send) -> None:
        # the handler runs in this task (no task of its own, no asyncio.wait per request). The request's body
        # is read first, here (the app gets it as it was sent); then a watcher waits for the disconnect and
        # cancels this task when the client goes before the response is complete
        scope[CANCELS_ON_DISCONNECT] = True
        me = asyncio.current_task()
        body: list[dict] = []
        while not body or body[-1]["type"] == "http.request" and body[-1].get("more_body", False):
            body.append(await receive())
        gone = asyncio.get_running_loop().create_future()  # set when the client went away
        complete = cancelled = False

        async def watch() -> None:
            nonlocal cancelled
            while (await receive())["type"] != "http.disconnect":  # nothing else comes after the body
                pass
            gone.set_result(None)
            if not complete:
                cancelled = True
                me.cancel()

        async def app_receive():
            if body:
                return body.pop(0)
            await asyncio.shield(gone)
            return {"type": "http.disconnect"}

        async def app_send(message) -> None:
            nonlocal complete
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        watcher = None if body[-1]["type"] == "http.disconnect" else asyncio.ensure_future(watch())
        if watcher is None:
            gone.set_result(None)  # gone while its body was read: the app sees the disconnect in its receive
        try:
            await self.app(scope, app_receive, app_send)
        except asyncio.CancelledError:
            if not cancelled or me.uncancel() > 0:  # cancelled by someone else too (the server stops)
                raise
            cancelled = False
        finally:
            if cancelled:  # the handler swallowed our cancellation: it is spent
                me.uncancel()
            if watcher is not None:
                watcher.cancel()
                if watcher.done() and not watcher.cancelled() and watcher.exception() is not None:
                    log.debug("reading a request failed: %s", watcher.exception())
