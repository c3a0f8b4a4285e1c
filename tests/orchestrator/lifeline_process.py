"""The stand-in worker process of test_lifeline.py, in a module of its own: a spawned process imports the module
of its target, and this one imports only the worker's lifeline (~0.1 s), not the orchestrator that the test
module imports (capsulert.orchestrator: Ray and torch, ~3.3 s of CPU for each process the tests start)."""
import time

from capsulert.worker.lifeline import Lifeline


def serve(conn, nofile=None) -> None:
    """A stand-in worker process: it holds a lifeline and does nothing else (with `nofile`: under that
    many descriptors, so a flood makes its accepts fail)."""
    if nofile is not None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    lifeline = Lifeline("127.0.0.1")
    conn.send((lifeline.address, lifeline.token))
    time.sleep(600)
