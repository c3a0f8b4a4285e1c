"""PeerLink: a worker's point-to-point links to other workers, one per worker pair.

Each pair has its own groups, built directly (never torch.distributed's global default group, so any number
of pairs coexist in one process and nothing else in the process is touched): rank 0 hosts a TCPStore on a
port of its node, and both ranks build the pair's data group, `ProcessGroupNCCL(store, rank, 2)` on a CUDA
engine or `ProcessGroupGloo(store, rank, 2)` on a CPU one, and exchange one byte over it, so a link that
cannot be set up fails at connect time, not in the first transfer. The same code moves bytes over NVLink/PCIe
(NCCL) and over TCP (Gloo).

Messages (`send_bytes`, `recv_bytes`) go over Gloo whatever the engine device: the data group itself on a CPU
engine, a second Gloo group of the pair on a CUDA one. A message travels on a channel (a Gloo tag; the data
ops have tag 0), whose messages arrive in order, apart from every other channel's. So a receive may stay
pending on one channel for as long as the link lives (`listen`: a thread handing each message of a channel
to a handler) while the pair's other ops run. On NCCL it could not: a pair's ops run in order on one
stream, so a pending receive there would hold up every later send of its side. Gloo also sees the peer's
process end (its connection closes), which fails every message op pending on the link at once.

Every op has a deadline: a peer that died, restarted or hangs fails the op with PeerLinkError when the
deadline passes (or at once when the transport notices the closed connection), and the link is closed and
dropped: a broken link is never used again. Closing a link fails every op still pending on it, on both
sides: the peer's side breaks with it. A data op can be started and waited for later (`start_send`,
`start_recv`, `wait`), so a transfer overlaps its own work with the bytes in flight. A pair is named by a
key the orchestrator makes from both workers' process ids and a generation, so a restarted peer always gets
a new link; connecting a new key to a peer drops the older link to that peer.
"""
from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, NoReturn

import torch
import torch.distributed as dist

from capsulert.errors import PeerLinkError

log = logging.getLogger(__name__)
# NCCL's own timeout is only the backstop behind the deadlines here, far behind them: its watchdog tears the
# whole worker process down when it fires (Gloo ops take their deadline from each wait instead)
_NCCL_BACKSTOP_S = 1800.0
_FRAME = 4096  # bytes of a message's first (often only) op: its length and as much of it as fits
# a listening receive waits this long: as good as forever (a Gloo wait that times out breaks the group)
_IDLE_S = 10 * 365 * 86400.0
_SHUT = 255  # the channel no message uses: closing a link times out a receive of its own there
_SHUT_WAIT = datetime.timedelta(milliseconds=1)


@dataclass
class _Pair:
    key: str
    peer: int  # the peer worker's index
    rank: int  # ours; the peer's is 1 - rank
    group: object  # the data ops' group: NCCL on a CUDA engine, Gloo on a CPU one
    messages: object  # the messages' Gloo group: `group` itself on a CPU engine
    store: object  # kept alive with the groups (rank 0 serves it)
    listeners: list = field(default_factory=list)  # the threads of `listen`


def free_port() -> int:
    """A TCP port free on this node now (the store binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_address() -> str:
    """This node's address as other nodes reach it (Ray's view of it; 127.0.0.1 outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - no Ray, or no node: only this host can be reached
        pass
    return "127.0.0.1"


class PeerLink:
    """The pair links of one worker, by key. Thread-safe: ops for different pairs run at once, and on one
    pair the ops of different channels; the orchestrator never runs two transfers on one pair at a time,
    so a pair's data ops are never interleaved."""

    def __init__(self, device: torch.device | str, host: str | None = None):
        self.device = torch.device(device)
        self.host = host or node_address()
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self._pairs: dict[str, _Pair] = {}
        self._lock = threading.Lock()

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._pairs)

    # ------------------------------------------------------------------ set up and tear down
    def connect(self, key: str, peer: int, rank: int, host: str, port: int, timeout_s: float) -> None:
        """Join pair `key` with worker `peer` as `rank` (0 hosts the store at host:port); both sides call it
        at the same time. Returns once one byte went through; PeerLinkError after `timeout_s`."""
        if rank not in (0, 1):
            raise PeerLinkError(f"a pair has ranks 0 and 1, not {rank}")
        with self._lock:
            stale = [k for k, p in self._pairs.items() if p.peer == peer or k == key]
        for k in stale:  # the peer restarted, or an earlier link to it broke: never reuse that group
            self.close(k)
        deadline = time.monotonic() + timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(host, port, 2, rank == 0, timeout=timeout, wait_for_workers=False)
            store = dist.PrefixStore(key, store)
            messages = self._gloo(dist.PrefixStore("messages", store), rank, timeout)
            group = self._nccl(store, rank) if self.backend == "nccl" else messages
        except Exception as e:  # noqa: BLE001 - a port taken, a peer that never came: all one refusal
            raise PeerLinkError(f"worker link {key!r} ({self.backend}, rank {rank}, store {host}:{port}) could not "
                                f"be set up within {timeout_s:g}s: {type(e).__name__}: {e}") from None
        pair = _Pair(key, peer, rank, group, messages, store)
        with self._lock:
            self._pairs[key] = pair
        probe = torch.ones(1, dtype=torch.uint8, device=self.device)
        (self.send if rank == 0 else self.recv)(key, probe, deadline)

    def _gloo(self, store, rank: int, timeout: datetime.timedelta):
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout  # bounds the connection set up in the constructor
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
        return dist.ProcessGroupGloo(store, rank, 2, opts)

    @staticmethod
    def _nccl(store, rank: int):
        """Its communicator is made by the first op (connect's probe, polled)."""
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None:
            raise RuntimeError("this torch build has no NCCL")
        opts = nccl.Options()
        opts._timeout = datetime.timedelta(seconds=_NCCL_BACKSTOP_S)
        return nccl(store, rank, 2, opts)

    def close(self, key: str) -> None:
        """Drop pair `key`: every op still pending on it fails, here and on the peer's side (whose link breaks
        with it), and its listening threads end. Unknown keys are ignored."""
        with self._lock:
            pair = self._pairs.pop(key, None)
        if pair is not None:
            self._shut(pair)

    def close_all(self) -> None:
        for key in self.keys():
            self.close(key)

    def _discard(self, pair: _Pair) -> None:
        """Close `pair` if it is still the link of its key (a newer link of the same key stays)."""
        with self._lock:
            if self._pairs.get(pair.key) is not pair:
                return
            del self._pairs[pair.key]
        self._shut(pair)

    @staticmethod
    def _shut(pair: _Pair) -> None:
        if pair.group is not pair.messages:
            try:
                pair.group.abort()  # NCCL: an op still blocked on it fails
            except Exception:  # noqa: BLE001 - it is being dropped either way
                pass
        # Gloo aborts no pending op, but a wait of its own that times out closes the group's connections,
        # which fails every op pending on it, here and on the peer's side
        try:
            pair.messages.recv([torch.empty(1, dtype=torch.uint8)], 1 - pair.rank, _SHUT).wait(_SHUT_WAIT)
        except Exception:  # noqa: BLE001 - the timeout is the point
            pass

    # ------------------------------------------------------------------ data ops
    def send(self, key: str, tensor: torch.Tensor, deadline: float) -> None:
        """Send a contiguous tensor on the engine device to the peer of pair `key`, by time.monotonic()
        `deadline`."""
        self.wait(self.start_send(key, tensor), deadline)

    def recv(self, key: str, tensor: torch.Tensor, deadline: float) -> None:
        """Receive into `tensor` (contiguous, on the engine device; the sender's size) by `deadline`."""
        self.wait(self.start_recv(key, tensor), deadline)

    def start_send(self, key: str, tensor: torch.Tensor) -> Pending:
        """Start a send and return at once (the thread may do other work while it runs); `wait` finishes
        it. The data ops of a pair run in the order they were started, on both ranks."""
        pair = self._pair(key)
        return self._start(pair, "send", lambda: pair.group.send([tensor], 1 - pair.rank, 0), tensor)

    def start_recv(self, key: str, tensor: torch.Tensor) -> Pending:
        pair = self._pair(key)
        return self._start(pair, "recv", lambda: pair.group.recv([tensor], 1 - pair.rank, 0), tensor)

    # ------------------------------------------------------------------ messages
    def send_bytes(self, key: str, data: bytes, deadline: float, *, channel: int, frame: int = _FRAME) -> None:
        for op in self.start_send_bytes(key, data, channel=channel, frame=frame):
            self.wait(op, deadline)

    def start_send_bytes(self, key: str, data: bytes, *, channel: int, frame: int = _FRAME) -> list[Pending]:
        """A message on `channel` (an int from 1 to 254): one op of `frame` bytes (its length, then the data)
        when it fits, else that and one op for the rest; the receiver needs no size in advance, only the same
        `frame`."""
        pair, channel = self._pair(key), _channel(channel)
        buf = bytearray(frame)
        buf[:8] = len(data).to_bytes(8, "little")
        head = data[:frame - 8]
        buf[8:8 + len(head)] = head
        chunks = [buf] + ([bytearray(data[len(head):])] if len(data) > len(head) else [])
        return [self._start_message(pair, "send", torch.frombuffer(c, dtype=torch.uint8), channel) for c in chunks]

    def recv_bytes(self, key: str, deadline: float | None, *, channel: int, limit: int = 1 << 30,
                   frame: int = _FRAME) -> bytes:
        """The next message on `channel`; a None `deadline` waits until one comes or the link is closed."""
        return self._recv_bytes(self._pair(key), deadline, _channel(channel), limit, frame)

    def _recv_bytes(self, pair: _Pair, deadline: float | None, channel: int, limit: int, frame: int) -> bytes:
        first = torch.empty(frame, dtype=torch.uint8)
        self.wait(self._start_message(pair, "recv", first, channel), deadline)
        size = int.from_bytes(first[:8].numpy().tobytes(), "little")
        if size > limit:
            self._discard(pair)  # out of step with the peer: the link cannot be trusted any more
            raise PeerLinkError(f"worker link {pair.key!r}: a message of {size} bytes (out of step with the peer)")
        if size <= frame - 8:
            return first[8:8 + size].numpy().tobytes()
        rest = torch.empty(size - (frame - 8), dtype=torch.uint8)
        self.wait(self._start_message(pair, "recv", rest, channel), deadline)
        return first[8:].numpy().tobytes() + rest.numpy().tobytes()

    def _start_message(self, pair: _Pair, what: str, tensor: torch.Tensor, channel: int) -> Pending:
        op = pair.messages.send if what == "send" else pair.messages.recv
        return self._start(pair, f"message {what} (channel {channel})", lambda: op([tensor], 1 - pair.rank, channel),
                           tensor, polled=False)

    def listen(self, key: str, channel: int, handle: Callable[[str, bytes], None], frame: int = _FRAME) -> None:
        """Hand every message of `channel` on pair `key` to `handle(key, message)`, in a thread of its own,
        one message at a time, until the link is closed or breaks. `handle` answers what it can over the
        link; an error it raises other than PeerLinkError leaves the link out of step, so it is closed."""
        pair, channel = self._pair(key), _channel(channel)
        thread = threading.Thread(target=self._listen, args=(pair, channel, handle, frame), daemon=True,
                                  name=f"peer-link-{key}-{channel}")
        with self._lock:
            pair.listeners.append(thread)
        thread.start()

    def listeners(self, key: str) -> list[threading.Thread]:
        """The threads listening on pair `key` (none once it is closed)."""
        with self._lock:
            pair = self._pairs.get(key)
            return list(pair.listeners) if pair is not None else []

    def _listen(self, pair: _Pair, channel: int, handle: Callable[[str, bytes], None], frame: int) -> None:
        while True:
            try:
                message = self._recv_bytes(pair, None, channel, 1 << 30, frame)
                handle(pair.key, message)
            except PeerLinkError:
                return  # closed here or by the peer, or broken: the link is dropped already
            except Exception:  # noqa: BLE001 - the handler broke off an exchange: the link is out of step
                log.exception("worker link %r: listening on channel %d failed; the link is dropped", pair.key,
                              channel)
                self._discard(pair)
                return

    # ------------------------------------------------------------------ ops
    def _pair(self, key: str) -> _Pair:
        with self._lock:
            pair = self._pairs.get(key)
        if pair is None:
            raise PeerLinkError(f"no worker link {key!r} here (never connected, or dropped after a failure)")
        return pair

    def _start(self, pair: _Pair, what: str, start, tensor: torch.Tensor, polled: bool | None = None) -> Pending:
        try:
            return Pending(pair, start(), what, tensor, self.backend == "nccl" if polled is None else polled)
        except Exception as e:  # noqa: BLE001 - the group is unusable: drop it
            self._drop(pair, what, e)

    def wait(self, op: Pending, deadline: float | None) -> None:
        """Finish a started op by `deadline` (None: no deadline; on CUDA: until its kernel finished);
        PeerLinkError, and the link dropped, when it fails or the deadline passes."""
        try:
            if not op.polled:
                left = _IDLE_S if deadline is None else max(deadline - time.monotonic(), 0.001)
                op.work.wait(datetime.timedelta(seconds=left))  # Gloo raises at its deadline itself
                return
            # NCCL's wait() only orders the current stream after the op: poll the op's event, so the thread
            # (not the GPU) is what waits, and only until the deadline; the pause stays short, as it is
            # what a finished op waits to be noticed
            pause = 1e-5
            while not op.work.is_completed():
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"{op.what} did not complete by its deadline")
                if self._pairs.get(op.pair.key) is not op.pair:
                    raise RuntimeError("the link was dropped (its peer was lost)")
                time.sleep(pause)
                pause = min(pause * 2, 1e-4)
            op.work.wait()  # raises the op's error, if any; orders the current stream after it
        except Exception as e:  # noqa: BLE001 - the peer died, restarted or hung: the link is done for
            self._drop(op.pair, op.what, e)

    def _drop(self, pair: _Pair, what: str, e: Exception) -> NoReturn:
        self._discard(pair)
        raise PeerLinkError(f"worker link {pair.key!r} to worker {pair.peer}: {what} failed "
                            f"({type(e).__name__}: {str(e)[:300]}); the link is dropped") from None


@dataclass
class Pending:
    """An op started on a pair link, not yet waited for; it keeps its tensor alive until then."""
    pair: _Pair
    work: object
    what: str
    tensor: torch.Tensor
    polled: bool  # an NCCL op: its completion is polled (a Gloo op's wait takes a timeout)


def _channel(channel: int) -> int:
    if not isinstance(channel, int) or not 0 < channel < _SHUT:
        raise ValueError(f"a message channel is an int from 1 to {_SHUT - 1}, not {channel!r}")
    return channel
