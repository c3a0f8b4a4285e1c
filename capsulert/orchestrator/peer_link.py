"""PeerLink: a worker's point-to-point process groups to other workers, one per worker pair.

Each pair has its own group, built directly (never torch.distributed's global default group, so any number
of pairs coexist in one process and nothing else in the process is touched): rank 0 hosts a TCPStore on a
port of its node, both ranks build `ProcessGroupNCCL(store, rank, 2)` on a CUDA engine or
`ProcessGroupGloo(store, rank, 2)` on a CPU one, and exchange one byte, so a link that cannot be set up
fails at connect time, not in the first transfer. The same code moves bytes over NVLink/PCIe (NCCL) and over
TCP (Gloo).

Ops block, so every one has a deadline: a peer that died, restarted or hangs fails the op with
PeerLinkError when the deadline passes (or at once when the transport notices the closed connection), and
the group is aborted and dropped: a broken group is never used again. A pair is named by a key the
orchestrator makes from both workers' process ids and a generation, so a restarted peer always gets a new
group; connecting a new key to a peer drops the older group to that peer.
"""
from __future__ import annotations

import datetime
import socket
import threading
import time
from dataclasses import dataclass

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
        pair = self._pair(key)
        self._finish(pair, lambda: pair.group.send([tensor], 1 - pair.rank, 0), "send", deadline)

    def recv(self, key: str, tensor: torch.Tensor, deadline: float) -> None:
        """Receive into `tensor` (contiguous, on the engine device; the sender's size) by `deadline`."""
        pair = self._pair(key)
        self._finish(pair, lambda: pair.group.recv([tensor], 1 - pair.rank, 0), "recv", deadline)

    def send_bytes(self, key: str, data: bytes, deadline: float) -> None:
        """A message: one op of _FRAME bytes (its length, then the data) when it fits, else that and one op
        for the rest; the receiver needs no size in advance."""
        frame = bytearray(_FRAME)
        frame[:8] = len(data).to_bytes(8, "little")
        head = data[:_FRAME - 8]
        frame[8:8 + len(head)] = head
        self.send(key, torch.frombuffer(frame, dtype=torch.uint8).to(self.device), deadline)
        if len(data) > len(head):
            rest = bytearray(data[len(head):])
            self.send(key, torch.frombuffer(rest, dtype=torch.uint8).to(self.device), deadline)

    def recv_bytes(self, key: str, deadline: float, limit: int = 1 << 30) -> bytes:
        frame = torch.empty(_FRAME, dtype=torch.uint8, device=self.device)
        self.recv(key, frame, deadline)
        frame = frame.cpu().numpy().tobytes()
        size = int.from_bytes(frame[:8], "little")
        if size > limit:
            self.close(key)  # out of step with the peer: the group cannot be trusted any more
            raise PeerLinkError(f"worker link {key!r}: a message of {size} bytes (out of step with the peer)")
        if size <= _FRAME - 8:
            return frame[8:8 + size]
        rest = torch.empty(size - (_FRAME - 8), dtype=torch.uint8, device=self.device)
        self.recv(key, rest, deadline)
        return frame[8:] + rest.cpu().numpy().tobytes()

    def _pair(self, key: str) -> _Pair:
        with self._lock:
            pair = self._pairs.get(key)
        if pair is None:
            raise PeerLinkError(f"no worker link {key!r} here (never connected, or dropped after a failure)")
        return pair

    def _finish(self, pair: _Pair, start, what: str, deadline: float) -> None:
        try:
            work = start()
            if self.backend == "gloo":
                left = max(deadline - time.monotonic(), 0.001)
                work.wait(datetime.timedelta(seconds=left))  # Gloo raises at its deadline itself
            else:
                # NCCL's wait() only orders the current stream after the op: poll the op's event, so the
                # thread (not the GPU) is what waits, and only until the deadline
                pause = 5e-5
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{what} did not complete by its deadline")
                    if self._pairs.get(pair.key) is not pair:
                        raise RuntimeError("the link was dropped (its peer was lost)")
                    time.sleep(pause)
                    pause = min(pause * 2, 5e-4)
                work.wait()  # raises the op's error, if any
        except Exception as e:  # noqa: BLE001 - the peer died, restarted or hung: the group is done for
            self.close(pair.key)
            raise PeerLinkError(f"worker link {pair.key!r} to worker {pair.peer}: {what} failed "
                                f"({type(e).__name__}: {str(e)[:300]}); the link is dropped") from None
