"""PeerLink: a worker's point-to-point process groups to other workers, one per worker pair.

Each pair has its own group, built directly (never torch.distributed's global default group, so any number
of pairs coexist in one process and nothing else in the process is touched): rank 0 hosts a TCPStore on a
port of its node, both ranks build `ProcessGroupNCCL(store, rank, 2)` on a CUDA engine or
`ProcessGroupGloo(store, rank, 2)` on a CPU one, and exchange one byte, so a link that cannot be set up
fails at connect time, not in the first transfer. The same code moves bytes over NVLink/PCIe (NCCL) and over
TCP (Gloo).

Every op has a deadline: a peer that died, restarted or hangs fails the op with PeerLinkError when the
deadline passes (or at once when the transport notices the closed connection), and the group is aborted and
dropped: a broken group is never used again. An op can be started and waited for later (`start_send`,
`start_recv`, `wait`), so a transfer overlaps its own work with the bytes in flight. On CUDA, messages
(`send_bytes`) use a stream of their own: a message never waits for work queued on the engine's stream. A pair
is named by a key the orchestrator makes from both workers' process ids and a generation, so a restarted peer
always gets a new group; connecting a new key to a peer drops the older group to that peer.
"""
from __future__ import annotations

import datetime
import socket
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from capsulert.errors import PeerLinkError

# NCCL's own timeout is only the backstop behind the deadlines here, far behind them: its watchdog tears the
# whole worker process down when it fires (Gloo ops take their deadline from each wait instead)
_NCCL_BACKSTOP_S = 1800.0
_FRAME = 4096  # bytes of a message's first (often only) op: its length and as much of it as fits


@dataclass
class _Pair:
    key: str
    peer: int  # the peer worker's index
    rank: int  # ours; the peer's is 1 - rank
    group: object
    store: object  # kept alive with the group (rank 0 serves it)


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
    """The pair groups of one worker, by key. Thread-safe: the worker's transfer lane runs ops for
    different pairs at once; the orchestrator never runs two transfers on one pair at a time."""

    def __init__(self, device: torch.device | str, host: str | None = None):
        self.device = torch.device(device)
        self.host = host or node_address()
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self._pairs: dict[str, _Pair] = {}
        self._lock = threading.Lock()
        self._stream = None  # CUDA: the stream of messages, made on first use

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
            group = self._group(store, rank, timeout)
        except Exception as e:  # noqa: BLE001 - a port taken, a peer that never came: all one refusal
            raise PeerLinkError(f"worker link {key!r} ({self.backend}, rank {rank}, store {host}:{port}) could not "
                                f"be set up within {timeout_s:g}s: {type(e).__name__}: {e}") from None
        pair = _Pair(key, peer, rank, group, store)
        with self._lock:
            self._pairs[key] = pair
        probe = torch.ones(1, dtype=torch.uint8, device=self.device)
        (self.send if rank == 0 else self.recv)(key, probe, deadline)

    def _group(self, store, rank: int, timeout: datetime.timedelta):
        if self.backend == "nccl":  # its communicator is made by the first op (connect's probe, polled)
            nccl = getattr(dist, "ProcessGroupNCCL", None)
            if nccl is None:
                raise RuntimeError("this torch build has no NCCL")
            opts = nccl.Options()
            opts._timeout = datetime.timedelta(seconds=_NCCL_BACKSTOP_S)
            return nccl(store, rank, 2, opts)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout  # bounds the connection set up in the constructor
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
        return dist.ProcessGroupGloo(store, rank, 2, opts)

    def close(self, key: str) -> None:
        """Drop pair `key` (aborting its group: an op still blocked on it fails); unknown keys are ignored."""
        with self._lock:
            pair = self._pairs.pop(key, None)
        if pair is not None:
            try:
                pair.group.abort()
            except Exception:  # noqa: BLE001 - it is being dropped either way
                pass

    def close_all(self) -> None:
        for key in self.keys():
            self.close(key)

    # ------------------------------------------------------------------ ops
    def send(self, key: str, tensor: torch.Tensor, deadline: float) -> None:
        """Send a contiguous tensor on the engine device to the peer of pair `key`, by time.monotonic()
        `deadline`."""
        self.wait(self.start_send(key, tensor), deadline)

    def recv(self, key: str, tensor: torch.Tensor, deadline: float) -> None:
        """Receive into `tensor` (contiguous, on the engine device; the sender's size) by `deadline`."""
        self.wait(self.start_recv(key, tensor), deadline)

    def start_send(self, key: str, tensor: torch.Tensor, stream=None) -> Pending:
        """Start a send and return at once (the thread may do other work while it runs); `wait` finishes
        it. The ops of a pair run in the order they were started, on both ranks."""
        pair = self._pair(key)
        return self._start(pair, "send", lambda: pair.group.send([tensor], 1 - pair.rank, 0), tensor, stream)

    def start_recv(self, key: str, tensor: torch.Tensor, stream=None) -> Pending:
        pair = self._pair(key)
        return self._start(pair, "recv", lambda: pair.group.recv([tensor], 1 - pair.rank, 0), tensor, stream)

    def send_bytes(self, key: str, data: bytes, deadline: float, frame: int = _FRAME) -> None:
        for op in self.start_send_bytes(key, data, frame):
            self.wait(op, deadline)

    def start_send_bytes(self, key: str, data: bytes, frame: int = _FRAME) -> list[Pending]:
        """A message: one op of `frame` bytes (its length, then the data) when it fits, else that and one op
        for the rest; the receiver needs no size in advance, only the same `frame`. On CUDA the message
        stream carries it: it never waits for work queued on the engine's stream (a pack, a decode step)."""
        buf = bytearray(frame)
        buf[:8] = len(data).to_bytes(8, "little")
        head = data[:frame - 8]
        buf[8:8 + len(head)] = head
        chunks = [buf] + ([bytearray(data[len(head):])] if len(data) > len(head) else [])
        stream = self._message_stream()
        with _on(stream):
            tensors = [torch.frombuffer(c, dtype=torch.uint8).to(self.device) for c in chunks]
        return [self.start_send(key, t, stream) for t in tensors]

    def recv_bytes(self, key: str, deadline: float, limit: int = 1 << 30, frame: int = _FRAME) -> bytes:
        stream = self._message_stream()
        with _on(stream):
            first = torch.empty(frame, dtype=torch.uint8, device=self.device)
        self.wait(self.start_recv(key, first, stream), deadline)
        with _on(stream):
            head = first.cpu().numpy().tobytes()
        size = int.from_bytes(head[:8], "little")
        if size > limit:
            self.close(key)  # out of step with the peer: the group cannot be trusted any more
            raise PeerLinkError(f"worker link {key!r}: a message of {size} bytes (out of step with the peer)")
        if size <= frame - 8:
            return head[8:8 + size]
        with _on(stream):
            rest = torch.empty(size - (frame - 8), dtype=torch.uint8, device=self.device)
        self.wait(self.start_recv(key, rest, stream), deadline)
        with _on(stream):
            return head[8:] + rest.cpu().numpy().tobytes()

    def _message_stream(self):
        if self.device.type != "cuda":
            return None
        with self._lock:
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            return self._stream

    def _pair(self, key: str) -> _Pair:
        with self._lock:
            pair = self._pairs.get(key)
        if pair is None:
            raise PeerLinkError(f"no worker link {key!r} here (never connected, or dropped after a failure)")
        return pair

    def _start(self, pair: _Pair, what: str, start, tensor: torch.Tensor, stream) -> Pending:
        try:
            with _on(stream):
                return Pending(pair, start(), what, tensor, stream)
        except Exception as e:  # noqa: BLE001 - the group is unusable: drop it
            self._drop(pair, what, e)

    def wait(self, op: Pending, deadline: float) -> None:
        """Finish a started op by `deadline` (on CUDA: until its kernel finished); PeerLinkError, and the link
        dropped, when it fails or the deadline passes."""
        try:
            if self.backend == "gloo":
                left = max(deadline - time.monotonic(), 0.001)
                op.work.wait(datetime.timedelta(seconds=left))  # Gloo raises at its deadline itself
                return
            # NCCL's wait() only orders the current stream after the op: poll the op's event, so the thread
            # (not the GPU) is what waits, and only until the deadline; the pause stays short, as it is
            # what a finished op waits to be noticed
            pause = 1e-5
            while not op.work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{op.what} did not complete by its deadline")
                if self._pairs.get(op.pair.key) is not op.pair:
                    raise RuntimeError("the link was dropped (its peer was lost)")
                time.sleep(pause)
                pause = min(pause * 2, 1e-4)
            with _on(op.stream):
                op.work.wait()  # raises the op's error, if any; orders the op's stream after it
        except Exception as e:  # noqa: BLE001 - the peer died, restarted or hung: the group is done for
            self._drop(op.pair, op.what, e)

    def _drop(self, pair: _Pair, what: str, e: Exception) -> NoReturn:
        self.close(pair.key)
        raise PeerLinkError(f"worker link {pair.key!r} to worker {pair.peer}: {what} failed "
                            f"({type(e).__name__}: {str(e)[:300]}); the link is dropped") from None


@dataclass
class Pending:
    """An op started on a pair link, not yet waited for; it keeps its tensor alive until then."""
    pair: _Pair
    work: object
    what: str
    tensor: torch.Tensor
    stream: object = None  # the CUDA stream it was started on (None: the current one)


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else nullcontext()
