"""The step scheduler: the one prefill and decode driver over an Engine, run by the worker process
(worker/core.py) and in-process by AsyncEngine (sessions/local.py). Requests in, one queue, batched steps."""
