"""CapsuleTransfers: the worker's half of a capsule transfer over a pair link (worker/peer_link.py).

A part the WorkerCore holds: it is given the capsule store, the engine device, the PeerLink and `put`, the
worker's one import path (it shares blocks when the origin is the store's own and persists a pin), and
keeps nothing else.
"""
from __future__ import annotations

import time
from contextlib import ExitStack, suppress
from typing import TYPE_CHECKING, Callable

import torch

from capsulert.capsule_store.capsule import CapsuleMeta
from capsulert.errors import CapsuleError, CorruptCapsuleError, DuplicateCapsuleError, PeerLinkError
from capsulert.capsule_store.format.wire import (
    ALIGN, TRAILER, decode_manifest, encode_failure, encode_manifest, layout, manifest_meta, pack_into, seal,
    tensor_views, unseal)
from capsulert.worker.peer_link import PeerLink, free_port
from capsulert.protocol.requests import LinkProbe, PeerAddress, PeerClose, PeerConnect, ReceiveCapsule, SendCapsule

if TYPE_CHECKING:
    from capsulert.capsule_store import CapsuleStore

# put(meta, tensors, tier, pin, origin=...) -> the reply of an import ({"name", "tier", "nbytes", "boundary"})
Put = Callable[..., dict]

MANIFEST_FRAME = 1 << 18  # one op carries the manifest of a capsule of up to ~60k tokens (4 bytes a token)


class CapsuleTransfers:
    def __init__(self, store: CapsuleStore, device: torch.device, peers: PeerLink, put: Put, worker_index: int):
        self.store = store
        self.device = device
        self.peers = peers
        self.put = put
        self.worker_index = worker_index

    # Three ops over a pair link: the sender's manifest (or the reason it cannot send), the receiver's answer
    # ("ok" or why it refuses: no bytes move then), and the packed buffer, sealed with its digest. Both sides
    # always run the whole exchange, so a refusal, a failed pack or a bad digest leaves the link in step for
    # the next transfer; a broken or silent peer fails the op at the deadline and drops the link
    # (PeerLinkError). Each side works while the link waits: the sender packs and seals while the receiver
    # checks the manifest, the receiver builds the metadata while the bytes arrive.
    def connect(self, r: PeerConnect) -> str:
        self.peers.connect(r.peer_key, r.peer, r.rank, r.host, r.port, r.timeout_s)
        return self.peers.backend

    def send(self, r: SendCapsule) -> dict:
        link, key, deadline = self.peers, r.peer_key, time.monotonic() + r.timeout_s
        phases = Phases()
        with ExitStack() as reading:  # the capsule's read reference, held until its bytes are packed
            try:
                meta, parts, _ = reading.enter_context(self.store.reading_parts(r.name, r.namespace))
                pieces, dim = parts.pieces()
                specs, size = layout(pieces, dim)
                buf = torch.empty(size + TRAILER, dtype=torch.uint8, device=self.device)
                manifest = encode_manifest(meta, parts.origin, specs, size)
            except Exception as e:
                with suppress(PeerLinkError):  # the receiver waits for a manifest: tell it why none comes
                    link.send_bytes(key, encode_failure(e), deadline, MANIFEST_FRAME)
                raise
            sending = link.start_send_bytes(key, manifest, MANIFEST_FRAME)
            phases.mark("manifest")
            failed = None
            try:
                pack_into(buf[:size], specs, pieces, dim)
                seal(buf, size)
            except Exception as e:  # the receiver may have said yes already: it gets a buffer marked failed
                failed = e
                seal(buf, size, failed=True)
            packed = _event(buf.device)
            phases.mark("pack")  # on CUDA: queued; the copies run while the answer comes
            for op in sending:
                link.wait(op, deadline)
            answer = link.recv_bytes(key, deadline).decode(errors="replace")
            if packed is not None:
                packed.synchronize()
            phases.mark("answer")
        if answer != "ok":
            if failed is not None:
                raise failed
            return {"sent": False, "refused": answer}
        link.send(key, buf, deadline)  # on CUDA ordered after the pack and the seal by the engine's stream
        phases.mark("send")
        if failed is not None:
            raise failed
        return {"sent": True, "nbytes": size, "phases_ms": phases.ms}

    def receive(self, r: ReceiveCapsule) -> dict:
        link, key, deadline = self.peers, r.peer_key, time.monotonic() + r.timeout_s
        phases = Phases()
        try:
            head, tokens = decode_manifest(link.recv_bytes(key, deadline, frame=MANIFEST_FRAME))
        except ValueError:
            link.close(key)
            raise PeerLinkError(f"worker link {key!r}: the sender's manifest is unreadable (out of step)") from None
        phases.mark("manifest")  # from the call's start: it includes the wait for the sender's read
        if "error" in head:
            raise CapsuleError(f"the sending worker could not send the capsule: {head['error']}")
        try:
            name, size = self._check_manifest(head, r)
            buf = torch.empty(size + TRAILER, dtype=torch.uint8, device=self.device)
            tensors = tensor_views(buf[:size], head.get("specs"))
        except Exception as e:
            with suppress(PeerLinkError):  # the sender waits for an answer: no bytes move after this one
                link.send_bytes(key, f"refused: {type(e).__name__}: {e}".encode(), deadline)
            raise
        ops = [*link.start_send_bytes(key, b"ok"), link.start_recv(key, buf)]
        phases.mark("check")
        meta = bad = None
        try:  # while the bytes move; any failure waits for them, so the link stays in step
            meta = manifest_meta(head, tokens)
        except Exception as e:  # noqa: BLE001 - raised once the exchange is complete
            bad = e
        phases.mark("meta")
        for op in ops:
            link.wait(op, deadline)
        phases.mark("recv")
        digest = unseal(buf, size, name)  # on the device, as the sender's seal (capsule_store/format/wire.py)
        phases.mark("digest")
        if bad is not None:
            raise bad
        # stored through the one import path: blocks shared when the origin is this store's own
        reply = self.put(meta, tensors, r.tier, r.pin, origin=head.get("origin"))
        phases.mark("store")  # on CUDA: queued on the engine's stream, as every store copy
        return {**reply, "digest": digest, "phases_ms": phases.ms}

    def _check_manifest(self, head: dict, r: ReceiveCapsule) -> tuple[str, int]:
        """The capsule's name and packed size, once the manifest says nothing this worker refuses."""
        fields, size = head.get("meta"), head.get("nbytes")
        origin = head.get("origin")
        if not isinstance(fields, dict) or not isinstance(fields.get("name"), str) \
                or not isinstance(fields.get("namespace"), str) or not (origin is None or isinstance(origin, str)):
            raise CorruptCapsuleError("a transfer manifest without a capsule name, namespace or origin")
        if type(size) is not int or size < 0 or size % ALIGN:
            raise CorruptCapsuleError(f"a transfer manifest's size {size!r} is not a packed buffer's")
        name, namespace = fields["name"], fields["namespace"]
        if r.name is not None and name != r.name:
            raise CapsuleError(f"the sending worker sends capsule {name!r}, not {r.name!r}")
        _check_namespace(name, namespace, r.namespace)
        if self.store.contains(name, namespace):
            raise DuplicateCapsuleError(f"capsule {name!r} already exists in namespace {namespace!r} "
                                        f"on worker {self.worker_index}")
        return name, size

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

    # control requests of the pair links
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
