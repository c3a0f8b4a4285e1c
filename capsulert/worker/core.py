"""WorkerCore: the body of a WorkerActor, owning one Engine (model, state set, capsule store) and its step
scheduler, and holding the worker's parts: the scheduler, the running calls, the event feed, the pinned
files, the pair links and the capsule transfers over them (transfers.py).

It has one entry point, `execute(request)`, and its streaming twin `stream(request)`: a typed request
(protocol/requests.py) runs by the handler its type maps to. Session requests go to the step scheduler (ordered
per session, decodes batched across every caller); store requests call the capsule store and the weights;
control requests read and interrupt; transfer requests run the worker's CapsuleTransfers. Sessions are named
by integer ids that stay unique across actor restarts. Everything returned is plain data (protocol/results.py,
CapsuleRef, token lists, numpy logits); capsules cross actors as safetensors bytes (never pickle), or worker to
worker over a pair link as one packed buffer on the engine device (SendCapsule to the source; the target
receives on the link itself, see transfers.py). Pinned capsules are also written to `persist_dir` and
reloaded (pinned) when the worker starts again, whichever caller pinned them.

The dispatch, and its invariant: every request type maps to exactly one handler, in `WorkerCore.HANDLERS`
(a session request's maps to `_scheduled`, which hands it to the scheduler; its starter, the loop-side half,
is its one entry of `starters.STARTERS`), and nothing else dispatches on a request's type. A *simple
session verb*, one engine call on one session (a `SessionVerb`, e.g. `Truncate(session, n)`), has no entry
in either table: it applies itself (`SessionVerb.apply(engine, session)`), both tables route every
SessionVerb (WorkerCore.handler, starters.starter), and the scheduler runs it in the session's order,
replying the session's SessionInfo. Adding one touches protocol/requests.py and the engine, nothing in worker/.
"""
from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from capsulert.capsule_store import read_capsule_origin
from capsulert.capsule_store.capsule import CapsuleMeta
from capsulert.capsule_store.format.export import decode_export_meta, decode_export_tensors, encode_export
from capsulert.errors import InvalidRequestError, SessionClosedError, WorkerLost
from capsulert.worker.event_feed import EventFeed
from capsulert.worker.peer_link import PeerLink
from capsulert.worker.pinned_files import PinnedFiles
from capsulert.scheduler.running_calls import RunningCalls
from capsulert.worker.transfers import CapsuleTransfers, check_namespace
from capsulert.engine.engine import Engine
from capsulert.scheduler.step_scheduler import Sink, StepScheduler, queue_sink, stream_item
from capsulert.scheduler.starters import STARTERS
from capsulert.engine.state import LAYOUT_VERSION
from capsulert.protocol.requests import (
    BATCHABLE, CONTROL, Append, Batch, Close, Delete, Demote, Detokenize, ExportCapsule, ExportToDir, Feed,
    Generate, ImportCapsule, ImportFromFile, Interrupt, LastCall, LinkProbe, ListCapsules, PeerAddress, PeerClose,
    PeerConnect, Ping, Promote, ReadTokens, Rebuild, Request, SendCapsule, SessionVerb, Snapshot, Stats, Streamed, Tokenize,
    Turn, UpdateWeights)
from capsulert.protocol.results import CapsuleExport

log = logging.getLogger(__name__)
# the requests that stream (stream()); the others answer once (execute())
STREAMS = (Generate, Turn, Feed)
Handler = Callable[["WorkerCore", Request, Any], Any]


def _on_transfers(method: Callable[[CapsuleTransfers, Request], Any]) -> Handler:
    """The handler of a transfer request: `method` of the worker's CapsuleTransfers."""
    def handle(core: WorkerCore, r: Request, call_id) -> Any:
        return method(core.transfers, r)
    handle.__name__ = handle.__qualname__ = f"transfers.{method.__name__}"
    return handle


class WorkerCore:
    """The actor's body (a plain class, so it is usable and testable in-process too)."""

    def __init__(self, engine_config: dict, persist_dir: str | None = None, torch_threads: int | None = None,
                 worker_index: int = 0, node: str | None = None, lifeline: tuple[str, int] | None = None,
                 lifeline_token: str | None = None):
        t0 = time.perf_counter()
        self.index = worker_index
        self.node = node  # the Ray node id (None in-process)
        self.lifeline = lifeline  # where the process's lifeline listens (worker/lifeline.py; None in-process)
        self.lifeline_token = lifeline_token  # the secret a connection to it sends first (hex)
        self.engine = Engine.from_config(dict(engine_config))
        if torch_threads:  # after the engine's own EngineConfig.cpu_threads: the worker's setting wins
            torch.set_num_threads(torch_threads)
        # ids never reused by a restarted actor: a session of the old process is unknown to the new one
        self.scheduler = StepScheduler(self.engine, first_id=random.getrandbits(40) << 20)
        self.calls = RunningCalls(self.scheduler)
        self.feed = EventFeed()  # the events of Streamed requests, read by the orchestrator's Feed stream
        self.pinned = PinnedFiles(persist_dir)
        self.reloaded = self.pinned.reload(self.engine.store)
        self.last_call_ms = float("nan")
        self.peers = PeerLink(self.engine.device)  # pair links to other workers, made on the orchestrator's demand
        self.transfers = CapsuleTransfers(self.engine.store, self.engine.device, self.peers, self._put, worker_index)
        self.started_s = time.perf_counter() - t0  # engine start, graph capture and reloads (restart time)
        eng = self.engine
        log.info("worker %d ready in %.1f s: %s on %s (%s), %d slots, %d pinned capsule(s) reloaded, %d disk-tier "
                 "capsule(s) re-indexed, %d file(s) set aside", worker_index, self.started_s, eng.config.model,
                 eng.device, str(eng.dtype).removeprefix("torch."), eng.config.slots, len(self.reloaded),
                 eng.store.reindexed, len(self.quarantined))

    @property
    def quarantined(self) -> list:
        """The capsule files this worker set aside at start instead of loading (its disk tier's, its pinned
        directory's): typed records (capsule_store/quarantine.py)."""
        return self.engine.store.quarantined + self.pinned.quarantined

    # ------------------------------------------------------------------ entry points
    def execute(self, request: Request, call_id=None) -> Any:
        """Run one typed request; its reply. `call_id` names the call for interrupts (Interrupt.call_id)."""
        handler = self.handler(type(request))
        if isinstance(request, Feed):
            raise InvalidRequestError("Feed is a stream: send it with stream(), not execute()")
        if request.lane == CONTROL:
            return handler(self, request, call_id)
        t0 = time.perf_counter()
        try:
            return handler(self, request, call_id)
        finally:
            self.last_call_ms = (time.perf_counter() - t0) * 1e3

    def stream(self, request: Generate | Turn | Feed, call_id=None) -> Iterator[list]:
        """The events of a generate as the scheduler produces them, in lists: each list holds every event
        produced since the last one was taken (one when the consumer keeps up; several when it lags, so a
        worker streaming to 64 sessions sends fewer, larger items instead of falling behind). The last list
        ends with the FinalEvent. A consumer that goes away (or an interrupt) stops the generate at the next
        token boundary, its tokens committed. For a Feed: the worker's event feed (event_feed.py), the
        events of every Streamed request as (key, kind, value) items, until another Feed opens."""
        if not isinstance(request, STREAMS):
            raise InvalidRequestError(f"only Generate, Turn and Feed stream, not {type(request).__name__}")
        if isinstance(request, Feed):
            yield from self.handler(Feed)(self, request, call_id)
            return
        self._require_session(request)
        events: queue.Queue = queue.Queue()
        job = self.scheduler.submit(request, queue_sink(events.put))
        self.calls.track(call_id, job)
        finished = False
        try:
            while not finished:
                items = [events.get()]
                while items[-1][0] == "event" and not events.empty():
                    items.append(events.get_nowait())
                finished = items[-1][0] != "event"
                if items[-1][0] == "error" and len(items) > 1:
                    yield [stream_item(i) for i in items[:-1]]  # what came before the error is delivered
                    items = items[-1:]
                yield [stream_item(i) for i in items]
        finally:
            if not finished:
                self.scheduler.cancel(job)
            self.calls.untrack(call_id)

    @classmethod
    def handler(cls, request_type: type) -> Handler:
        """The handler of a request type: its entry of HANDLERS, or, for a simple session verb, the
        scheduler's, which has one starter for them all."""
        handler = cls.HANDLERS.get(request_type)
        if handler is None and issubclass(request_type, SessionVerb) and request_type is not SessionVerb:
            handler = cls._scheduled
        if handler is None:
            raise InvalidRequestError(f"a worker runs typed requests (capsulert.protocol.requests), "
                                      f"not {request_type.__name__}")
        return handler

    # ------------------------------------------------------------------ session requests (step scheduler)
    def _scheduled(self, request: Request, call_id) -> Any:
        """Hand the request to the step scheduler and wait for its reply (this call's thread blocks; the
        scheduler's loop thread does the work, batched with every other request)."""
        self._require_session(request)
        done, box = self._submit(request, call_id)
        try:
            done.wait()
        finally:
            self.calls.untrack(call_id)
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _feed_items(self, r: Feed, call_id) -> Iterator[list]:
        return self.feed.stream()

    def _streamed(self, r: Streamed, call_id) -> None:
        """Submit a Generate or Turn whose events go into the event feed under r.key (an Interrupt(r.key)
        stops it), or an Append whose reply goes there."""
        if not isinstance(r.request, (Generate, Turn, Append)):
            raise InvalidRequestError(f"only Generate, Turn and Append go through the event feed, "
                                      f"not {type(r.request).__name__}")
        self._require_session(r.request)
        finished = threading.Event()

        def untrack() -> None:
            finished.set()
            self.calls.untrack(r.key)

        self.calls.track(r.key, self.scheduler.submit(r.request, self.feed.sink_for(r.key, untrack, r.events)))
        if finished.is_set():  # it ended before it was tracked (a refusal in the loop): nothing to interrupt
            self.calls.untrack(r.key)

    def _submit(self, request: Request, call_id=None) -> tuple[threading.Event, dict]:
        done, box = threading.Event(), {}
        sink = Sink(done=lambda v: (box.__setitem__("value", v), done.set()),
                    error=lambda e: (box.__setitem__("error", e), done.set()))
        self.calls.track(call_id, self.scheduler.submit(request, sink))
        return done, box

    def _batch(self, batch: Batch, call_id) -> list[tuple[bool, Any]]:
        """Every request of the batch submitted at once, in order, and together: the step loop takes none of
        them before it can take them all, so a crowd's requests share its steps. [(True, reply) | (False,
        error)]; a Streamed's reply is its submission (None)."""
        pending: list[tuple[threading.Event | None, dict]] = []
        for request in batch.requests:
            if type(request) not in BATCHABLE:
                raise InvalidRequestError(f"a Batch holds {', '.join(t.__name__ for t in BATCHABLE)} requests, "
                                          f"not {type(request).__name__}")
        with self.scheduler.together():
            for request in batch.requests:
                try:
                    if isinstance(request, Streamed):
                        self._streamed(request, None)
                        pending.append((None, {"value": None}))
                        continue
                    self._require_session(request)
                    pending.append(self._submit(request))
                except Exception as e:  # noqa: BLE001 - the refusal is this request's reply
                    pending.append((None, {"error": e}))
        out = []
        for done, box in pending:
            if done is not None:
                done.wait()
            out.append((False, box["error"]) if "error" in box else (True, box["value"]))
        return out

    def _snapshot(self, request: Snapshot, call_id) -> Any:
        """The one snapshot path: the scheduler makes the capsule (ordered after the session's earlier
        requests); a pin is then persisted, or the capsule is deleted again."""
        ref = self._scheduled(request, call_id)
        if request.pin:
            self.pinned.write_or_delete(self.engine.store, ref.name, ref.namespace)
        return ref

    def _delete(self, request: Delete, call_id) -> None:
        self._scheduled(request, call_id)  # between decode steps, after the restores submitted before it
        self.pinned.remove(request.name, request.namespace)

    def _require_session(self, request: Request) -> None:
        """A session this worker does not hold died with an earlier process: WorkerLost. (Closing one is
        a no-op, so Close is not checked.)"""
        sid = request.target
        if sid is None or isinstance(request, Close):
            return
        try:
            self.scheduler.session(sid)
        except SessionClosedError:
            raise WorkerLost(f"session {sid} is not on worker {self.index} "
                             "(the worker restarted, or it was closed)") from None

    # ------------------------------------------------------------------ store requests
    def _promote(self, r: Promote, call_id) -> None:
        self.engine.store.promote(r.name, r.tier, r.namespace)

    def _demote(self, r: Demote, call_id) -> None:
        self.engine.store.demote(r.name, r.tier, r.namespace)

    def _rebuild(self, r: Rebuild, call_id) -> bool:
        info = self.engine.store.info(r.name, r.namespace)
        ref = self.engine.rebuild(r.name, r.namespace)
        if ref is not None and info.pinned:
            self.pinned.rewrite(self.engine.store, r.name, r.namespace)
        return ref is not None

    def _update_weights(self, r: UpdateWeights, call_id) -> int:
        from safetensors.torch import load as st_load  # model weights sent as bytes (not a capsule)

        source = st_load(bytes(r.source)) if isinstance(r.source, (bytes, bytearray)) else r.source
        version = self.engine.update_weights(source, rebuild_pinned=r.rebuild_pinned, version=r.version,
                                             identity=r.identity)
        if r.rebuild_pinned:
            for info in self.engine.store.list():
                if info.pinned:
                    self.pinned.rewrite(self.engine.store, info.name, info.namespace)
        return version

    @contextmanager
    def _reading_whole(self, name: str, namespace: str):
        """(meta, block origin, tensors each in one piece on the engine device) of a capsule, with a read
        reference held. The origin names the numerics that computed a canonical capsule (None for one that is
        not), so a worker of the same origin can share its KV blocks with its own capsules of that prefix."""
        with self.engine.store.reading_parts(name, namespace) as (meta, parts, _):
            yield meta, parts.origin, parts.full()

    def _export(self, r: ExportCapsule, call_id) -> CapsuleExport:
        with self._reading_whole(r.name, r.namespace) as (meta, origin, tensors):
            cpu = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
        return CapsuleExport(*encode_export(meta, cpu), origin)

    def _import(self, r: ImportCapsule, call_id) -> dict:
        payload = r.payload
        if not isinstance(payload, CapsuleExport):
            raise InvalidRequestError(f"ImportCapsule takes a CapsuleExport, got {type(payload).__name__}")
        meta = decode_export_meta(payload.meta_json)
        check_namespace(meta, r.namespace)
        meta, tensors = decode_export_tensors(meta, payload.checksum, payload.blob)
        # the store shares the blocks only when the origin is its own (equal tokens give equal bytes only
        # under equal numerics); another origin's capsule stays whole
        return self._put(meta, tensors, r.tier, r.pin, origin=payload.origin)

    def _export_to_dir(self, r: ExportToDir, call_id) -> str:
        return str(self.engine.store.export_file(r.name, r.directory, r.namespace))

    def _import_from_file(self, r: ImportFromFile, call_id) -> dict:
        meta, tensors, origin = read_capsule_origin(r.path, self.engine.fingerprint, LAYOUT_VERSION)
        check_namespace(meta, r.namespace)
        return self._put(meta, tensors, r.tier, r.pin, origin=origin)  # its blocks shared when the origin is ours

    def _put(self, meta: CapsuleMeta, tensors, tier: str, pin: bool, origin: str | None = None) -> dict:
        ref = self.engine.store.put(meta, tensors, tier=tier, pin=pin, origin=origin)
        if pin:
            self.pinned.write_or_delete(self.engine.store, meta.name, meta.namespace)
        return {"name": ref.name, "tier": ref.tier, "nbytes": ref.nbytes, "boundary": ref.boundary}

    # ------------------------------------------------------------------ control requests
    def _ping(self, r: Ping, call_id) -> dict:
        dev = self.engine.device
        gpu = str(torch.cuda.get_device_properties(dev).uuid) if dev.type == "cuda" else None
        return {"worker": self.index, "pid": os.getpid(), "node": self.node, "device": dev.type, "gpu": gpu,
                "weights_version": self.engine.weights_version, "weights_identity": self.engine.weights_identity,
                "reloaded": list(self.reloaded),
                "reindexed": self.engine.store.reindexed, "quarantined": [q.to_dict() for q in self.quarantined],
                "started_s": self.started_s, "lifeline": self.lifeline, "lifeline_token": self.lifeline_token,
                "call_format": self.engine.codec.chat.call_format}

    def _stats(self, r: Stats, call_id) -> dict:
        sch = self.scheduler
        return {"worker": self.index, "free_slots": self.engine.free_slots, "slots": self.engine.config.slots,
                "sessions": sch.session_count, "queued": sch.queued, "decode_steps": sch.steps,
                "prefill_forwards": sch.prefill_forwards,
                "decoded_tokens": sch.decoded_tokens, "loop_busy_s": dict(sch.busy_s),
                "recent_steps": sch.trace.since(r.steps_since) if r.steps_since is not None else [],
                "capsules": len(self.engine.store.list()), "store": self.engine.store.stats()}

    def _list(self, r: ListCapsules, call_id) -> list[dict]:
        return [{"name": i.name, "namespace": i.namespace, "tier": i.tier, "pinned": i.pinned,
                 "nbytes": i.nbytes, "size_bytes": i.meta.nbytes, "boundary": i.meta.boundary, "worker": self.index}
                for i in self.engine.store.list(r.namespace)]

    def _read_tokens(self, r: ReadTokens, call_id) -> list[int]:
        self._require_session(r)
        return list(self.scheduler.session(r.session).tokens)

    def _tokenize(self, r: Tokenize, call_id) -> list[int]:
        return self.engine.tokenize(r.text)

    def _detokenize(self, r: Detokenize, call_id) -> str:
        return self.engine.detokenize(list(r.tokens))

    def _interrupt(self, r: Interrupt, call_id) -> bool:
        if r.call_id is not None:
            self.calls.interrupt(r.call_id)
        elif r.session is not None:
            self.calls.interrupt_session(r.session)
        else:
            raise InvalidRequestError("an Interrupt names a session, a call or both")
        if r.session is None:
            return False
        try:
            self.scheduler.session(r.session)
        except SessionClosedError:
            return False
        return True

    def _last_call(self, r: LastCall, call_id) -> float:
        return self.last_call_ms

    #: the worker's dispatch: one handler per request type, in this one table. A session request goes to the
    #: step scheduler (_scheduled), which starts it by its starter (starters.STARTERS: the scheduler runs
    #: without a WorkerCore too, in AsyncEngine); Snapshot and Delete do more once it answered. A simple
    #: session verb (a SessionVerb, which applies itself) needs no entry here nor there (see `handler`).
    HANDLERS: dict[type, Handler] = {
        **dict.fromkeys(STARTERS, _scheduled),
        Snapshot: _snapshot, Delete: _delete, Batch: _batch, Streamed: _streamed, Feed: _feed_items,
        Promote: _promote, Demote: _demote, Rebuild: _rebuild, UpdateWeights: _update_weights,
        ExportCapsule: _export, ImportCapsule: _import, ExportToDir: _export_to_dir, ImportFromFile: _import_from_file,
        PeerConnect: _on_transfers(CapsuleTransfers.connect), SendCapsule: _on_transfers(CapsuleTransfers.send),
        LinkProbe: _on_transfers(CapsuleTransfers.probe), PeerAddress: _on_transfers(CapsuleTransfers.address),
        PeerClose: _on_transfers(CapsuleTransfers.close_link),
        Ping: _ping, Stats: _stats, ListCapsules: _list, ReadTokens: _read_tokens, Tokenize: _tokenize,
        Detokenize: _detokenize, Interrupt: _interrupt, LastCall: _last_call,
    }
