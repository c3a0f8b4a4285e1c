"""CapsuleTransfers: the worker's half of a capsule transfer over a pair link (orchestrator/peer_link.py),
a part of WorkerCore kept in a file of its own.

A mixin: it uses the WorkerCore's `engine`, `index`, `peers` (its PeerLink), `_reading_whole` and `_put`
(the one import path, which shares blocks when the origin is the store's own).
"""
from __future__ import annotations

import json
import time
from contextlib import suppress

import torch

from capsulert.capsule_store.capsule import CapsuleMeta
from capsulert.errors import CapsuleError, CorruptCapsuleError, DuplicateCapsuleError, PeerLinkError
from capsulert.orchestrator.packed_capsule import buffer_digest, pack_tensors, tensor_views
from capsulert.orchestrator.peer_link import free_port
from capsulert.worker.verbs import LinkProbe, PeerAddress, PeerClose, PeerConnect, ReceiveCapsule, SendCapsule


class CapsuleTransfers:
    # Over a pair link, in this order: the sender's manifest (metadata JSON, origin, tensor specs, or the
    # reason it cannot send), the receiver's answer ("ok" or why it refuses: no bytes move then), the packed
    # buffer, the sender's digest. Both sides always run the whole exchange, so a refusal or a bad digest
    # leaves the link in step for the next transfer; a broken or silent peer fails the op at the deadline and
    # drops the link (PeerLinkError).
    def _peer_connect(self, r: PeerConnect, call_id) -> str:
        self.peers.connect(r.peer_key, r.peer, r.rank, r.host, r.port, r.timeout_s)
        return self.peers.backend

    def _send_capsule(self, r: SendCapsule, call_id) -> dict:
        link, key, deadline = self.peers, r.peer_key, time.monotonic() + r.timeout_s
        phases = Phases(self.engine.device)
        try:
            with self._reading_whole(r.name, r.namespace) as (meta, origin, tensors):
                buf, specs = pack_tensors(tensors, self.engine.device)
            phases.mark("pack")
        except Exception as e:
            with suppress(PeerLinkError):  # the receiver waits for a manifest: tell it why none comes
                link.send_bytes(key, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode(), deadline)
            raise
        manifest = {"meta": meta.to_json(), "origin": origin, "specs": specs, "nbytes": buf.numel()}
        link.send_bytes(key, json.dumps(manifest).encode(), deadline)
        phases.mark("manifest")
        answer = link.recv_bytes(key, deadline).decode()
        phases.mark("answer")
        if answer != "ok":
            return {"sent": False, "refused": answer}
        if buf.numel():
            link.send(key, buf, deadline)
        phases.mark("send")
        # the digest last: the sender computes it while the receiver computes its own over what arrived
        try:
            digest = buffer_digest(buf)
        except Exception:
            with suppress(PeerLinkError):  # no digest: the receiver refuses the bytes, and stays in step
                link.send_bytes(key, b"", deadline)
            raise
        link.send_bytes(key, digest.encode(), deadline)
        phases.mark("digest")
        return {"sent": True, "nbytes": int(buf.numel()), "digest": digest, "phases_ms": phases.ms}

    def _receive_capsule(self, r: ReceiveCapsule, call_id) -> dict:
        link, key, deadline = self.peers, r.peer_key, time.monotonic() + r.timeout_s
        phases = Phases(self.engine.device)
        try:
            manifest = json.loads(link.recv_bytes(key, deadline))
            phases.mark("manifest")  # from the call's start: it includes the wait for the sender's pack
        except ValueError:
            link.close(key)
            raise PeerLinkError(f"worker link {key!r}: the sender's manifest is not JSON (out of step)") from None
        if "error" in manifest:
            raise CapsuleError(f"the sending worker could not send the capsule: {manifest['error']}")
        try:
            meta = CapsuleMeta.from_json(manifest["meta"])
            check_namespace(meta, r.namespace)
            if self.engine.store.contains(meta.name, meta.namespace):
                raise DuplicateCapsuleError(f"capsule {meta.name!r} already exists in namespace {meta.namespace!r} "
                                            f"on worker {self.index}")
            buf = torch.empty(int(manifest["nbytes"]), dtype=torch.uint8, device=self.engine.device)
            tensors = tensor_views(buf, manifest["specs"])
        except Exception as e:
            with suppress(PeerLinkError):  # the sender waits for an answer: no bytes move after this one
                link.send_bytes(key, f"refused: {type(e).__name__}: {e}".encode(), deadline)
            raise
        phases.mark("check")
        link.send_bytes(key, b"ok", deadline)
        phases.mark("answer")
        if buf.numel():
            link.recv(key, buf, deadline)
        phases.mark("recv")
        digest = buffer_digest(buf)  # on the device, as the sender's (packed_capsule.py)
        if link.recv_bytes(key, deadline, limit=64).decode() != digest:
            raise CorruptCapsuleError(f"capsule {meta.name!r} changed in transit (digest mismatch)")
        phases.mark("digest")
        # stored through the one import path: blocks shared when the origin is this store's own
        reply = self._put(meta, tensors, r.tier, r.pin, origin=manifest["origin"])
        phases.mark("store")
        return {**reply, "phases_ms": phases.ms}

    def _link_probe(self, r: LinkProbe, call_id) -> list[float]:
        deadline = time.monotonic() + r.timeout_s
        buf = torch.zeros(r.nbytes, dtype=torch.uint8, device=self.engine.device)
        op = self.peers.send if r.send else self.peers.recv
        times = []
        for _ in range(r.repeats):
            t0 = time.perf_counter()
            op(r.peer_key, buf, deadline)  # returns when the op completed (on CUDA: its kernel finished)
            times.append(time.perf_counter() - t0)
        return times

    # control requests of the pair links
    def _peer_address(self, r: PeerAddress, call_id) -> tuple[str, int]:
        return self.peers.host, free_port()

    def _peer_close(self, r: PeerClose, call_id) -> None:
        self.peers.close(r.peer_key)


class Phases:
    """Wall time per phase of one half of a transfer, in ms, for the migration benchmark's breakdown. On
    CUDA each mark waits for the device first (a few µs): without it the time of queued copies and digests
    would show up in whichever later phase happens to wait for them."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self.ms: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.ms[phase] = round((now - self._last) * 1e3, 3)
        self._last = now


def check_namespace(meta: CapsuleMeta, namespace: str | None) -> None:
    if namespace is not None and meta.namespace != namespace:
        raise CapsuleError(f"capsule {meta.name!r} belongs to namespace {meta.namespace!r}, not {namespace!r}; "
                           "a namespace imports only its own capsules")

