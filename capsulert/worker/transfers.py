"""CapsuleTransfers: the worker's half of capsule moves over its pair links (worker/peer_link.py).

A part the WorkerCore holds: it is given the capsule store, the engine device, the PeerLink and `put`, the
worker's one import path (it shares blocks when the origin is the store's own and persists a pin), and
keeps nothing else. The source of a move runs SendCapsule, the orchestrator's one call per move; the target
takes part through the link alone: each link listens for moves from its peer from the moment it is
connected until it is closed or breaks (a thread per link, PeerLink.listen), so no call reaches the target.

A move is an exchange over two channels of the link, MOVES (sender to receiver) and REPLIES (back), and the
link's data ops: the sender's manifest with the orchestrator's order (which capsule, where to store it, the
deadline), or the reason it cannot send; the receiver's answer ("ok", or why it refuses: no bytes move
then); after "ok", the packed buffer sealed with its digest, then the receiver's final reply: what it stored
(name, tier, nbytes, boundary, digest), or why it failed. The sender returns that reply, or raises the
receiver's typed refusal or failure, so the orchestrator learns the outcome from its one call. Both sides
always run the whole exchange, and every message on MOVES gets its answer, so a refusal, a failed read or
pack, or a bad digest leaves the link in step for the next move; a broken or silent peer fails an op at
the deadline (at once when its process ended: PeerLink) and drops the link (PeerLinkError). Each side works
while the link waits: the sender packs and seals while the receiver checks the manifest, the receiver
builds the metadata while the bytes arrive.

The receiving thread stores through `put` as the worker's request threads do: the capsule store serialises
every change under its one lock (capsule_store/store.py), and the orchestrator runs one move per worker at a
time, so a worker receives at most one capsule at once. Both directions of a link may move capsules; the
channels keep their messages apart.
"""
from __future__ import annotations

import json
import logging
import time
from contextlib import ExitStack, suppress
from typing import TYPE_CHECKING, Callable

import torch

from capsulert import errors
from capsulert.capsule_store.capsule import CapsuleMeta
from capsulert.errors import CapsuleError, CapsuleRTError, CorruptCapsuleError, DuplicateCapsuleError, PeerLinkError
from capsulert.capsule_store.format.wire import (
    ALIGN, TRAILER, decode_manifest, encode_failure, encode_manifest, layout, manifest_meta, pack_into, seal,
    tensor_views, unseal)
from capsulert.worker.peer_link import PeerLink, free_port
from capsulert.protocol.checks import tier_arg
from capsulert.protocol.requests import LinkProbe, PeerAddress, PeerClose, PeerConnect, SendCapsule

if TYPE_CHECKING:
    from capsulert.capsule_store import CapsuleStore

log = logging.getLogger(__name__)
# put(meta, tensors, tier, pin, origin=...) -> the reply of an import ({"name", "tier", "nbytes", "boundary"})
Put = Callable[..., dict]

MOVES, REPLIES = 1, 2  # the link's channels of a move: sender to receiver, receiver to sender
MANIFEST_FRAME = 1 << 18  # one op carries the manifest of a capsule of up to ~60k tokens (4 bytes a token)
_OK = b'{"ok":true}'
_ORDER = {"name": str, "namespace": str, "tier": str, "pin": bool, "timeout_s": (int, float)}


class CapsuleTransfers:
    def __init__(self, store: CapsuleStore, device: torch.device, peers: PeerLink, put: Put, worker_index: int):
        self.store = store
        self.device = device
        self.peers = peers
        self.put = put
        self.worker_index = worker_index

    def connect(self, r: PeerConnect) -> str:
        self.peers.connect(r.peer_key, r.peer, r.rank, r.host, r.port, r.timeout_s)
        self.peers.listen(r.peer_key, MOVES, self._receive, MANIFEST_FRAME)
        return self.peers.backend

    # ------------------------------------------------------------------ the sender
    def send(self, r: SendCapsule) -> dict:
        """Move capsule r.name to the peer of link r.peer_key; the receiver's reply: what it stored, and each
        side's wall time per phase (ms, "send" and "receive")."""
        link, key, deadline = self.peers, r.peer_key, time.monotonic() + r.timeout_s
        order = {"name": r.name, "namespace": r.namespace, "tier": r.tier, "pin": r.pin, "timeout_s": r.timeout_s}
        phases = Phases()
        with ExitStack() as reading:  # the capsule's read reference, held until its bytes are packed
            try:
                meta, parts, _ = reading.enter_context(self.store.reading_parts(r.name, r.namespace))
                pieces, dim = parts.pieces()
                specs, size = layout(pieces, dim)
                buf = torch.empty(size + TRAILER, dtype=torch.uint8, device=self.device)
                manifest = encode_manifest(meta, parts.origin, specs, size)
            except Exception as e:
                with suppress(PeerLinkError):  # the receiver answers every message: take its answer too
                    link.send_bytes(key, _with_order(order, encode_failure(e)), deadline, channel=MOVES,
                                    frame=MANIFEST_FRAME)
                    link.recv_bytes(key, deadline, channel=REPLIES)
                raise
            sending = link.start_send_bytes(key, _with_order(order, manifest), channel=MOVES, frame=MANIFEST_FRAME)
            phases.mark("manifest")
            failed = None
            try:
                pack_into(buf[:size], specs, pieces, dim)
                seal(buf, size)
            except Exception as e:  # the receiver may say yes: it gets a buffer marked failed
                failed = e
                seal(buf, size, failed=True)
            packed = _event(buf.device)
            phases.mark("pack")  # on CUDA: queued; the copies run while the answer comes
            for op in sending:
                link.wait(op, deadline)
            answer = link.recv_bytes(key, deadline, channel=REPLIES)
            if packed is not None:
                packed.synchronize()
            phases.mark("answer")
        try:
            _reply(link, key, answer, "ok")  # the receiver's refusal, raised: no bytes move
        except CapsuleRTError:
            if failed is not None:
                raise failed from None
            raise
        link.send(key, buf, deadline)  # on CUDA ordered after the pack and the seal by the engine's stream
        phases.mark("send")
        final = link.recv_bytes(key, deadline, channel=REPLIES)
        phases.mark("stored")
        if failed is not None:  # the root cause: the receiver only saw the buffer marked failed
            raise failed
        stored = _reply(link, key, final, "stored")
        return {**stored, "phases_ms": {"send": phases.ms, "receive": stored.get("phases_ms")}}

    # ------------------------------------------------------------------ the receiver (the link's listener)
    def _receive(self, key: str, message: bytes) -> None:
        """One move from the peer of link `key`: check, answer, take the bytes, store, reply. Refusals and
        failures are replies; only a broken link raises (PeerLinkError, which ends the listening)."""
        link, phases = self.peers, Phases()
        try:
            order, body = _open_order(message)
            head, tokens = decode_manifest(body)
        except ValueError:
            link.close(key)
            raise PeerLinkError(f"worker link {key!r}: the sender's manifest is unreadable (out of step)") from None
        deadline = time.monotonic() + order["timeout_s"]
        phases.mark("manifest")
        if "error" in head:
            log.info("worker %d: capsule %r does not come over link %r: the sending worker could not send it (%s)",
                     self.worker_index, order["name"], key, head["error"])
            why = CapsuleError(f"the sending worker could not send capsule {order['name']!r}: {head['error']}")
            link.send_bytes(key, _failure(why), deadline, channel=REPLIES)
            return
        try:
            name, size = self._check_manifest(head, order)
            buf = torch.empty(size + TRAILER, dtype=torch.uint8, device=self.device)
            tensors = tensor_views(buf[:size], head.get("specs"))
        except Exception as e:  # noqa: BLE001 - the refusal is the answer: no bytes move after it
            link.send_bytes(key, _failure(e), deadline, channel=REPLIES)
            return
        ops = [*link.start_send_bytes(key, _OK, channel=REPLIES), link.start_recv(key, buf)]
        phases.mark("check")
        meta = bad = None
        try:  # while the bytes move; any failure waits for them, so the link stays in step
            meta = manifest_meta(head, tokens)
        except Exception as e:  # noqa: BLE001 - replied once the bytes are in
            bad = e
        phases.mark("meta")
        for op in ops:
            link.wait(op, deadline)
        phases.mark("recv")
        try:
            digest = unseal(buf, size, name)  # on the device, as the sender's seal (capsule_store/format/wire.py)
            phases.mark("digest")
            if bad is not None:
                raise bad
            # stored through the one import path: blocks shared when the origin is this store's own
            stored = self.put(meta, tensors, order["tier"], order["pin"], origin=head.get("origin"))
            phases.mark("store")  # on CUDA: queued on the engine's stream, as every store copy
            reply = _encode({"stored": {**stored, "digest": digest, "phases_ms": phases.ms}})
        except Exception as e:  # noqa: BLE001 - the failure is the reply
            reply = _failure(e)
        link.send_bytes(key, reply, deadline, channel=REPLIES)

    def _check_manifest(self, head: dict, order: dict) -> tuple[str, int]:
        """The capsule's name and packed size, once the manifest says nothing this worker refuses."""
        fields, size = head.get("meta"), head.get("nbytes")
        origin = head.get("origin")
        if not isinstance(fields, dict) or not isinstance(fields.get("name"), str) \
                or not isinstance(fields.get("namespace"), str) or not (origin is None or isinstance(origin, str)):
            raise CorruptCapsuleError("a transfer manifest without a capsule name, namespace or origin")
        if type(size) is not int or size < 0 or size % ALIGN:
            raise CorruptCapsuleError(f"a transfer manifest's size {size!r} is not a packed buffer's")
        name, namespace = fields["name"], fields["namespace"]
        tier_arg(order["tier"])
        if name != order["name"]:
            raise CapsuleError(f"the sending worker sends capsule {name!r}, not {order['name']!r}")
        _check_namespace(name, namespace, order["namespace"])
        if self.store.contains(name, namespace):
            raise DuplicateCapsuleError(f"capsule {name!r} already exists in namespace {namespace!r} "
                                        f"on worker {self.worker_index}")
        return name, size

    # ------------------------------------------------------------------ the raw link, and control
    def probe(self, r: LinkProbe) -> list[float]:
        deadline = time.monotonic() + r.timeout_s
        buf = torch.zeros(r.nbytes, dtype=torch.uint8, device=self.device)
        op = self.peers.send if r.send else self.peers.recv
        times = []
        for _ in range(r.repeats):
            t0 = time.perf_counter()
            op(r.peer_key, buf, deadline)  # returns when the op completed (on CUDA: its kernel finished)
            times.append(time.perf_counter() - t0)
        return times

    def address(self, r: PeerAddress) -> tuple[str, int]:
        return self.peers.host, free_port()

    def close_link(self, r: PeerClose) -> None:
        self.peers.close(r.peer_key)


class Phases:
    """Wall time per phase of one half of a transfer, in ms, for the migration benchmark's breakdown. A mark
    never waits for the device (that would undo the overlap): on CUDA a phase that only queues work (a pack,
    a store copy) is short, and the work runs during the phases after it, until one waits for it."""

    def __init__(self):
        self.ms: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.ms[phase] = round((now - self._last) * 1e3, 3)
        self._last = now


# ---------------------------------------------------------------------- the messages of a move
def _with_order(order: dict, manifest: bytes) -> bytes:
    """The sender's message: the orchestrator's order (JSON, its length first), then the manifest."""
    text = _encode(order)
    return len(text).to_bytes(4, "little") + text + manifest


def _open_order(data: bytes) -> tuple[dict, bytes]:
    """(order, manifest); ValueError when `data` is no such message (the link is out of step)."""
    n = int.from_bytes(data[:4], "little")
    order = json.loads(data[4:4 + n]) if len(data) >= 4 + n else None
    if not isinstance(order, dict) or set(order) != set(_ORDER) \
            or any(not isinstance(order[k], t) for k, t in _ORDER.items()) or not order["timeout_s"] > 0:
        raise ValueError("not a move's order")
    return order, data[4 + n:]


def _encode(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":"), allow_nan=False).encode()


def _failure(e: BaseException) -> bytes:
    return _encode({"error": type(e).__name__, "message": str(e)})


def _reply(link: PeerLink, key: str, data: bytes, part: str):
    """The `part` of a receiver's reply ("ok": its yes; "stored": what it stored), or the typed error the
    reply carries, raised: a capsulert error by its own class, any other as a CapsuleError naming it."""
    try:
        reply = json.loads(data)
    except ValueError:
        reply = None
    if isinstance(reply, dict) and isinstance(reply.get("error"), str):
        cls = getattr(errors, reply["error"], None)
        message = str(reply.get("message"))
        if isinstance(cls, type) and issubclass(cls, CapsuleRTError):
            raise cls(message)
        raise CapsuleError(f"{reply['error']}: {message}")
    if isinstance(reply, dict) and part in reply:
        return reply[part]
    link.close(key)
    raise PeerLinkError(f"worker link {key!r}: the receiver's reply is unreadable (out of step)")


def _event(device: torch.device):
    """On CUDA, an event after the work queued so far on the engine's stream (None on CPU: done already)."""
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


def check_namespace(meta: CapsuleMeta, namespace: str | None) -> None:
    _check_namespace(meta.name, meta.namespace, namespace)


def _check_namespace(name: str, namespace: str, expected: str | None) -> None:
    if expected is not None and namespace != expected:
        raise CapsuleError(f"capsule {name!r} belongs to namespace {namespace!r}, not {expected!r}; "
                           "a namespace imports only its own capsules")
