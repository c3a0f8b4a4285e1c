"""WorkerCore: the body of a WorkerActor, owning one Engine (model, state set, capsule store).

Sessions are named by integer ids that stay unique across actor restarts. Every capsule verb takes a
`namespace` (keyword, "default" when left out): the store keys capsules by (namespace, name), so one
namespace never sees, restores or deletes another's capsules. Verbs a caller would chain are one call
(restore_append_generate, fork_append_generate, ...). Everything returned is plain Python data (token
lists, numpy logits); capsules cross actors as safetensors bytes, never pickle. Pinned capsules are also
written to `persist_dir` and reloaded (pinned) when the worker starts again.
"""
from __future__ import annotations

import os
import queue
import random
import threading
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from capsulert.capsule_store import capsule_file_name, read_capsule, tensors_checksum, write_capsule_with_meta
from capsulert.capsule_store.capsule import CapsuleMeta
from capsulert.capsule_store.disk import FILE_SUFFIX
from capsulert.errors import CapsuleError, CorruptCapsuleError, SessionClosedError, WorkerLost
from capsulert.worker.engine import Engine
from capsulert.worker.sampler import SamplingParams
from capsulert.worker.scheduler import Sink, StepScheduler, queue_sink, stream_item
from capsulert.worker.session import Session
from capsulert.worker.verbs import FinalEvent, Request, TokenEvent
from capsulert.worker.state import LAYOUT_VERSION


def _sp(d: dict | None) -> SamplingParams | None:
    return None if d is None else SamplingParams(**d)


class WorkerCore:
    """The actor's body (a plain class so it is usable and testable in-process too)."""

    def __init__(self, engine_config: dict, persist_dir: str | None = None, torch_threads: int | None = None,
                 worker_index: int = 0):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.index = worker_index
        self.engine = Engine.from_config(dict(engine_config))
        # the step scheduler batches every generate submitted as a request (submit_request / stream_request)
        # and owns the session registry; ids never reused by a restarted actor
        self.scheduler = StepScheduler(self.engine, first_id=random.getrandbits(40) << 20)
        self._jobs: dict[Any, Any] = {}  # call id -> the scheduler job it names (interrupts)
        self._early: set = set()  # call ids interrupted before their job was submitted
        # interrupt bookkeeping by id(session): the generate call running on it, and the call an
        # interrupt targets (written from the control group's thread; plain dict ops under the GIL)
        self._running: dict[int, Any] = {}
        self._interrupts: dict[int, Any] = {}
        self.persist_dir = Path(persist_dir) if persist_dir else None
        self.reloaded: list[str] = []
        if self.persist_dir is not None and self.persist_dir.is_dir():
            names = [read_capsule_meta_name(p) for p in sorted(self.persist_dir.glob("*" + FILE_SUFFIX))]
            if names:
                self.engine.store.load(self.persist_dir)
                for ns, name in names:
                    self.engine.store.pin(name, ns)
                self.reloaded = [n for _, n in names]

    # ------------------------------------------------------------------ helpers
    def _adopt(self, s: Session) -> int:
        return self.scheduler.adopt(s)

    def _get(self, sid: int) -> Session:
        try:
            return self.scheduler.session(sid)
        except SessionClosedError:
            raise WorkerLost(f"session {sid} is not on worker {self.index} (the worker restarted, or it was closed)") from None

    def _logits(self, s: Session, want: bool):
        return s.logits().numpy().copy() if want else None

    def _generate(self, sessions: list[Session], max_new: int, sampling: list, call_id) -> list[dict]:
        """An interrupt names the generate call it targets (it may arrive, through the control group,
        before that call has started here): a session stops once its interrupt names the running call."""
        keys = [id(s) for s in sessions]
        for k in keys:
            self._running[k] = call_id
        try:
            if call_id is not None and all(self._interrupts.get(k) == call_id for k in keys):
                outs = [[] for _ in sessions]  # interrupted before it started: stop at once
                for s in sessions:
                    s.stop_reason = "interrupted"
            else:
                outs = self.engine.generate(sessions, max_new, [_sp(p) for p in sampling], should_stop=self._interrupted)
        finally:
            for k in keys:
                self._running.pop(k, None)
                if call_id is not None and self._interrupts.get(k) == call_id:
                    del self._interrupts[k]
        return [{"tokens": o, "stop_reason": s.stop_reason, "len": len(s.tokens)} for o, s in zip(outs, sessions)]

    def _interrupted(self, s: Session) -> bool:
        running = self._running.get(id(s))
        return running is not None and self._interrupts.get(id(s)) == running

    def _persist(self, name: str, namespace: str = "default") -> None:
        if self.persist_dir is None:
            return
        with self.engine.store.reading(name, namespace) as (meta, tensors):
            write_capsule_with_meta(self.persist_dir, meta, tensors)

    def _unpersist(self, name: str, namespace: str = "default") -> None:
        if self.persist_dir is not None:
            (self.persist_dir / capsule_file_name(namespace, name)).unlink(missing_ok=True)

    # ------------------------------------------------------------------ engine verbs ("gpu")
    def open(self, prompt=None, return_logits: bool = False) -> dict:
        s = self.engine.open()
        try:
            if prompt is not None:
                s.append(prompt)
        except BaseException:
            s.close()
            raise
        return {"sid": self._adopt(s), "len": len(s.tokens), "logits": self._logits(s, return_logits and prompt is not None)}

    def append(self, sid: int, tokens, return_logits: bool = False) -> dict:
        s = self._get(sid)
        s.append(tokens)
        return {"len": len(s.tokens), "logits": self._logits(s, return_logits)}

    def restore(self, name: str, namespace: str = "default") -> dict:
        s = self.engine.restore(name, namespace)
        return {"sid": self._adopt(s), "len": len(s.tokens)}

    def restore_into(self, sid: int, name: str, namespace: str = "default") -> dict:
        s = self._get(sid)
        self.engine.restore_into(s, name, namespace)
        return {"len": len(s.tokens)}

    def restore_append_generate(self, name: str, suffix, max_new: int, sampling: dict | None = None,
                                sid: int | None = None, call_id=None, close: bool = False,
                                namespace: str = "default") -> dict:
        """Restore `name` (into session `sid` in place, or a new session), append, generate: one call."""
        if sid is None:
            s = self.engine.restore(name, namespace)
            sid = self._adopt(s)
        else:
            s = self._get(sid)
            self.engine.restore_into(s, name, namespace)
        try:
            if suffix is not None:
                s.append(suffix)
            out = self._generate([s], max_new, [sampling], call_id)[0]
        except BaseException:
            if close:
                self.close(sid)
            raise
        if close:
            self.close(sid)
        return {**out, "sid": None if close else sid}

    def fork(self, name: str, n: int, namespace: str = "default") -> list[dict]:
        return [{"sid": self._adopt(s), "len": len(s.tokens)} for s in self.engine.fork(name, n, namespace)]

    def fork_append_generate(self, name: str, suffixes: list, max_new: int, sampling: list,
                             snapshot_names: list[str] | None = None, close: bool = True, text: bool = False,
                             namespace: str = "default") -> list[dict]:
        """Fork len(suffixes) branches of `name`, append suffix i to branch i, decode them together (one
        batched step per token), optionally snapshot each branch, then close them (best-of-N, tree nodes)."""
        sessions = self.engine.fork(name, len(suffixes), namespace)
        sids = [self._adopt(s) for s in sessions]
        made: list[str] = []
        try:
            for s, suf in zip(sessions, suffixes):
                if suf is not None:
                    s.append(suf)
            outs = self._generate(sessions, max_new, sampling, None)
            for s, nm in zip(sessions, snapshot_names or []):
                self.engine.snapshot(s, nm, namespace=namespace)
                made.append(nm)
        except BaseException:
            for nm in made:
                self.engine.store.delete(nm, namespace)
            close = True
            raise
        finally:
            if close:
                self.close_many(sids)
        for o, sid in zip(outs, sids):
            o["sid"] = None if close else sid
            if text:
                o["text"] = self.engine.detokenize(o["tokens"]) if self.engine.tokenizer else None
        return outs

    def snapshot(self, sid: int, name: str, tier: str = "gpu", pin: bool = False, namespace: str = "default") -> dict:
        ref = self.engine.snapshot(self._get(sid), name, tier=tier, pin=pin, namespace=namespace)
        if pin:
            try:
                self._persist(name, namespace)
            except BaseException:
                self.engine.store.delete(name, namespace)
                self._unpersist(name, namespace)
                raise
        return {"name": ref.name, "namespace": ref.namespace, "tier": ref.tier, "nbytes": ref.nbytes,
                "boundary": ref.boundary, "pinned": bool(pin), "worker": self.index, "pid": os.getpid()}

    def close(self, sid: int) -> None:
        s = self.scheduler.release(sid)
        if s is not None:
            self._interrupts.pop(id(s), None)
            s.close()

    def close_many(self, sids: list[int]) -> None:
        for sid in sids:
            self.close(sid)

    def delete(self, name: str, namespace: str = "default") -> None:
        self.engine.store.delete(name, namespace)
        self._unpersist(name, namespace)

    def promote(self, name: str, tier: str, namespace: str = "default") -> None:
        self.engine.store.promote(name, tier, namespace)

    def demote(self, name: str, tier: str | None = None, namespace: str = "default") -> None:
        self.engine.store.demote(name, tier, namespace)

    # ------------------------------------------------------------------ weights
    def update_weights(self, source, rebuild_pinned: bool = False) -> int:
        """New weights in place (a checkpoint path, or safetensors bytes: never pickle); the new version.
        Pinned capsules rebuilt under them are persisted again."""
        if isinstance(source, (bytes, bytearray)):
            source = st_load(bytes(source))
        version = self.engine.update_weights(source, rebuild_pinned=rebuild_pinned)
        if rebuild_pinned:
            for info in self.engine.store.list():
                if info.pinned:
                    self._unpersist(info.name, info.namespace)
                    self._persist(info.name, info.namespace)
        return version

    def rebuild(self, name: str, namespace: str = "default") -> bool:
        """Re-derive a stale capsule under the current weights; False when it was current."""
        info = self.engine.store.info(name, namespace)
        ref = self.engine.rebuild(name, namespace)
        if ref is not None and info.pinned:
            self._unpersist(name, namespace)
            self._persist(name, namespace)
        return ref is not None

    # ------------------------------------------------------------------ requests (step scheduler)
    def submit_request(self, request: Request, call_id=None) -> Any:
        """Run one typed request through the step scheduler (batched with every other request's decode);
        blocks this call's thread until it is done."""
        self._check_session(request)
        done, box = threading.Event(), {}
        sink = Sink(done=lambda v: (box.__setitem__("value", v), done.set()),
                    error=lambda e: (box.__setitem__("error", e), done.set()))
        self._track(call_id, self.scheduler.submit(request, sink))
        try:
            done.wait()
        finally:
            self._untrack(call_id)
        if "error" in box:
            raise box["error"]
        return box["value"]

    def stream_request(self, request: Request, call_id=None) -> Iterator[TokenEvent | FinalEvent]:
        """TokenEvents as the scheduler produces them, then a FinalEvent. A consumer that goes away (or an
        interrupt) stops the generate at the next token boundary."""
        self._check_session(request)
        events: queue.Queue = queue.Queue()
        job = self.scheduler.submit(request, queue_sink(events.put))
        self._track(call_id, job)
        finished = False
        try:
            while not finished:
                item = events.get()
                finished = item[0] != "event"
                yield stream_item(item)
        finally:
            if not finished:
                self.scheduler.cancel(job)
            self._untrack(call_id)

    def _check_session(self, request: Request) -> None:
        sid = getattr(request, "session", None)
        if sid is not None:
            self._get(sid)  # a session this worker does not hold died with an earlier process: WorkerLost

    def _track(self, call_id, job) -> None:
        if call_id is None:
            return
        self._jobs[call_id] = job
        if call_id in self._early:  # the interrupt overtook the call
            self._early.discard(call_id)
            self.scheduler.cancel(job)

    def _untrack(self, call_id) -> None:
        if call_id is not None:
            self._jobs.pop(call_id, None)

    # ------------------------------------------------------------------ migration
    @staticmethod
    def _check_namespace(meta: CapsuleMeta, namespace: str | None) -> None:
        if namespace is not None and meta.namespace != namespace:
            raise CapsuleError(f"capsule {meta.name!r} belongs to namespace {meta.namespace!r}, not {namespace!r}; "
                               "a namespace imports only its own capsules")

    def export_capsule(self, name: str, namespace: str = "default") -> tuple[str, str, bytes]:
        """(meta JSON, checksum, safetensors bytes) of one capsule: host bytes for the object store."""
        with self.engine.store.reading(name, namespace) as (meta, tensors):
            cpu = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
        checksum = tensors_checksum(cpu)
        return meta.replace(checksum=checksum).to_json(), checksum, st_save(cpu)

    def import_capsule(self, payload: tuple[str, str, bytes], tier: str = "gpu", pin: bool = False,
                       namespace: str | None = None) -> dict:
        """Store a capsule exported by export_capsule; with `namespace`, refuse one of another namespace."""
        meta_json, checksum, blob = payload
        meta = CapsuleMeta.from_json(meta_json)
        self._check_namespace(meta, namespace)
        tensors = st_load(blob)
        if tensors_checksum(tensors) != checksum:
            raise CorruptCapsuleError(f"capsule {meta.name!r} changed in transit (checksum mismatch)")
        ref = self.engine.store.put(meta.replace(checksum=checksum), tensors, tier=tier, pin=pin)
        if pin:
            self._persist(meta.name, meta.namespace)
        return {"name": ref.name, "tier": ref.tier, "nbytes": ref.nbytes, "boundary": ref.boundary}

    def export_to_dir(self, name: str, directory: str, namespace: str = "default") -> str:
        with self.engine.store.reading(name, namespace) as (meta, tensors):
            path, _ = write_capsule_with_meta(directory, meta, tensors)
        return str(path)

    def import_from_file(self, path: str, tier: str = "gpu", pin: bool = False, namespace: str | None = None) -> dict:
        meta, tensors = read_capsule(path, self.engine.fingerprint, LAYOUT_VERSION)
        self._check_namespace(meta, namespace)
        ref = self.engine.store.put(meta, tensors, tier=tier, pin=pin)
        if pin:
            self._persist(meta.name, meta.namespace)
        return {"name": ref.name, "tier": ref.tier, "nbytes": ref.nbytes, "boundary": ref.boundary}

    # ------------------------------------------------------------------ control
    def last_call(self) -> float:
        """Milliseconds the last engine-group call spent inside the actor."""
        return getattr(self, "last_call_ms", float("nan"))

    def ping(self) -> dict:
        return {"worker": self.index, "pid": os.getpid(), "reloaded": list(self.reloaded)}

    def interrupt(self, sid: int, call_id=None) -> bool:
        if call_id is not None:
            job = self._jobs.get(call_id)
            if job is not None:
                self.scheduler.cancel(job)
            else:
                self._early.add(call_id)
        try:
            s = self.scheduler.session(sid)
        except SessionClosedError:
            return False
        target = call_id if call_id is not None else self._running.get(id(s))
        if target is not None:
            self._interrupts[id(s)] = target
        return True

    def tokens(self, sid: int) -> list[int]:
        return list(self._get(sid).tokens)

    def list_capsules(self, namespace: str | None = None) -> list[dict]:
        """The capsules of `namespace` (None: of every namespace; the orchestrator's resync only)."""
        return [{"name": i.name, "namespace": i.namespace, "tier": i.tier, "pinned": i.pinned,
                 "nbytes": i.nbytes, "boundary": i.meta.boundary, "worker": self.index}
                for i in self.engine.store.list(namespace)]

    def stats(self) -> dict:
        return {"worker": self.index, "free_slots": self.engine.free_slots, "slots": self.engine.config.slots,
                "sessions": self.scheduler.session_count, "queued": self.scheduler.queued, "decode_steps": self.scheduler.steps, "capsules": len(self.engine.store.list()),
                "store": self.engine.store.stats()}

    def tokenize(self, text: str) -> list[int]:
        return self.engine.tokenize(text)

    def detokenize(self, tokens: list[int]) -> str:
        return self.engine.detokenize(tokens)


def read_capsule_meta_name(path: Path) -> tuple[str, str]:
    from capsulert.capsule_store import read_header

    meta, _ = read_header(path)
    return meta.namespace, meta.name
