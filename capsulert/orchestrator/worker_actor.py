"""WorkerActor: the Ray actor that owns one Engine (a WorkerCore).

Typed requests (worker/verbs.py) run in the group "serve": each call hands its request to the worker's
step scheduler and waits, so many callers' generates share decode steps (the scheduler's loop thread is
the one that drives the engine). The one-call chained verbs run in "gpu" (size 1, so they never
interleave with each other); stats, listing, health, token reads and interrupts run in "control", so they
answer while a long prefill or decode runs (interrupt reaches a running generate at its next token).
"""
from __future__ import annotations

import time

import ray

from capsulert.orchestrator.worker_core import WorkerCore

GPU, CONTROL, SERVE = "gpu", "control", "serve"
SERVE_CONCURRENCY = 512  # requests in flight per worker (each waits on the scheduler in its own thread)

_GPU_METHODS = ("open", "append", "restore", "restore_into",
                "restore_append_generate", "fork", "fork_append_generate", "snapshot", "close", "close_many",
                "delete", "promote", "demote", "export_capsule", "import_capsule", "export_to_dir",
                "import_from_file", "update_weights", "rebuild")
_CONTROL_METHODS = ("ping", "last_call", "interrupt", "tokens", "list_capsules", "stats", "tokenize", "detokenize")


def _grouped(name: str, group: str):
    fn = getattr(WorkerCore, name)

    if name == "stream_request":
        def method(self, *args, **kwargs):
            yield from fn(self, *args, **kwargs)
        method.__name__ = name
        method.__doc__ = fn.__doc__
        return ray.method(concurrency_group=group, num_returns="streaming")(method)
    if group == GPU:
        def method(self, *args, **kwargs):  # remember how long the engine work took (bench: transport cost)
            t0 = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                self.last_call_ms = (time.perf_counter() - t0) * 1e3
    else:
        def method(self, *args, **kwargs):
            return fn(self, *args, **kwargs)

    method.__name__ = name
    method.__doc__ = fn.__doc__
    return ray.method(concurrency_group=group)(method)


_body = {n: _grouped(n, GPU) for n in _GPU_METHODS}
_body.update({n: _grouped(n, CONTROL) for n in _CONTROL_METHODS})
_body.update({n: _grouped(n, SERVE) for n in ("submit_request", "stream_request")})
_GroupedCore = type("WorkerActor", (WorkerCore,), _body)
_GroupedCore.__module__ = __name__
_GroupedCore.__qualname__ = "_GroupedCore"  # pickled by reference

#: The Ray actor class. Spawn with WorkerActor.options(num_gpus=..., max_restarts=...).remote(engine_config, ...)
WorkerActor = ray.remote(concurrency_groups={GPU: 1, CONTROL: 4, SERVE: SERVE_CONCURRENCY})(_GroupedCore)
