"""WorkerActor: the Ray actor that owns one Engine (through its WorkerCore), and how a typed request reaches it.

The actor has one entry point, `execute(request, call_id)`, and its streaming twin `stream` (a Ray
streaming generator). Which Ray concurrency group a call runs in follows from the request's lane:
session requests wait on the step scheduler in a group of many threads (the scheduler's loop thread is
the one that drives the engine, batching every caller's decode); store requests run one at a time; control
requests (stats, listing, health, token reads, interrupts) have their own group, so they answer while a
long prefill, decode or capsule copy runs; worker-to-worker transfers (verbs.TransferRequest), which block
until the peer runs its half, have theirs too. Callers use `send` and `send_stream`, never a method name.

Logs: the actor sends the `capsulert` logger to its stderr at the level the orchestrator passes (the
driver's, or OrchestratorConfig.worker_log_level); Ray forwards that stream to the driver (log_to_driver).
Progress bars are off in a worker unless its EngineConfig asks for them (progress=True).
"""
from __future__ import annotations

from dataclasses import fields, replace

import ray

from capsulert.errors import InvalidRequestError
from capsulert.logs import setup_logging
from capsulert.worker.core import WorkerCore
from capsulert.worker.lifeline import Lifeline
from capsulert.worker.peer_link import node_address
from capsulert.protocol.requests import CONTROL, SESSION, STORE, TRANSFER, Request

SESSION_GROUP, STORE_GROUP, CONTROL_GROUP, TRANSFER_GROUP = "session", "store", "control", "transfer"
SESSION_CONCURRENCY = 512  # requests in flight per worker (each waits on the scheduler in its own thread)
# the orchestrator runs one move per worker at a time (its send; a receive runs on the link's own listening
# thread, worker/transfers.py); the spare threads serve the connects of a new link and let a send whose peer
# failed finish (by its deadline) without holding up the next move
TRANSFER_CONCURRENCY = 4
_GROUP = {SESSION: SESSION_GROUP, STORE: STORE_GROUP, CONTROL: CONTROL_GROUP, TRANSFER: TRANSFER_GROUP}


def _fetch_inputs(request: Request) -> Request:
    """Fields that arrive as object-store references (another worker's export, weights put once for every
    worker) are fetched here, on the worker: the bytes never pass through the caller."""
    if not isinstance(request, Request):
        return request  # refused by WorkerCore.execute
    refs = {f.name: getattr(request, f.name) for f in fields(request)
            if isinstance(getattr(request, f.name), ray.ObjectRef)}
    return replace(request, **{k: ray.get(v) for k, v in refs.items()}) if refs else request


class WorkerActorBody:
    """The class Ray wraps (pickled by reference): it holds the worker's WorkerCore and offers its two entry
    points as Ray actor methods."""

    def __init__(self, engine_config: dict, persist_dir: str | None = None, torch_threads: int | None = None,
                 worker_index: int = 0, log_level: str = "WARNING"):
        setup_logging(log_level)  # first: the engine's start (model generation, loading) logs too
        if engine_config.get("progress") is None:  # nobody watches a worker's stderr as a terminal
            engine_config = {**engine_config, "progress": False}
        # first too: a process that dies while its engine starts is seen dead at once
        self.lifeline = Lifeline(node_address())
        # which Ray node runs this worker (health() shows it): placement on a cluster is Ray's choice
        self.core = WorkerCore(engine_config, persist_dir, torch_threads, worker_index,
                               node=ray.get_runtime_context().get_node_id(), lifeline=self.lifeline.address,
                               lifeline_token=self.lifeline.token.hex())

    @ray.method(concurrency_group=SESSION_GROUP)
    def execute(self, request: Request, call_id=None):
        return self.core.execute(_fetch_inputs(request), call_id)

    @ray.method(concurrency_group=SESSION_GROUP, num_returns="streaming")
    def stream(self, request: Request, call_id=None):
        yield from self.core.stream(request, call_id)


#: The Ray actor class. Spawn with WorkerActor.options(num_gpus=..., max_restarts=...).remote(engine_config, ...)
WorkerActor = ray.remote(concurrency_groups={SESSION_GROUP: SESSION_CONCURRENCY, STORE_GROUP: 1,
                                             CONTROL_GROUP: 4, TRANSFER_GROUP: TRANSFER_CONCURRENCY})(WorkerActorBody)


def send(handle, request: Request, call_id=None) -> ray.ObjectRef:
    """Submit a typed request to a worker actor; the reference to its reply."""
    if not isinstance(request, Request):
        raise InvalidRequestError(f"a worker runs typed requests (capsulert.protocol.requests), not {request!r:.80}")
    return handle.execute.options(concurrency_group=_GROUP[request.lane]).remote(request, call_id)


def send_stream(handle, request: Request, call_id=None):
    """Submit a Generate or Turn as a stream; a Ray generator of references to its events."""
    return handle.stream.remote(request, call_id)
