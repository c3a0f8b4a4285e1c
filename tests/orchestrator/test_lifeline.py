"""A worker process's lifeline (worker/lifeline.py) and the orchestrator's watch of it
(orchestrator/lifeline.py): the watch sees the process exit in milliseconds, and nothing else ends it."""
import asyncio
import logging
import multiprocessing
import os
import signal
import socket
import time

import pytest

from capsulert.orchestrator.lifeline import ProcessWatch
from capsulert.worker.lifeline import Lifeline

pytestmark = pytest.mark.asyncio(loop_scope="session")


def _serve(conn) -> None:
    """A stand-in worker process: it holds a lifeline and does nothing else."""
    lifeline = Lifeline("127.0.0.1")
    conn.send(lifeline.address)
    time.sleep(600)


@pytest.fixture
def process():
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=_serve, args=(there,), daemon=True)
    p.start()
    assert here.poll(60), "the stand-in process did not start"
    yield p, tuple(here.recv())
    if p.is_alive():
        p.kill()
    p.join(10)


async def test_a_watch_sees_its_process_exit_at_once(process):
    p, address = process
    seen = []
    watch = ProcessWatch(3, p.pid, address, lambda w, pid: seen.append((w, pid)))
    other = ProcessWatch(3, p.pid, address, lambda w, pid: seen.append(("other", pid)))
    await asyncio.wait_for(asyncio.gather(watch.connected, other.connected), 10)
    assert not watch.exited.done() and seen == []
    t0 = time.monotonic()
    os.kill(p.pid, signal.SIGKILL)
    await asyncio.wait_for(asyncio.gather(watch.exited, other.exited), 10)
    assert time.monotonic() - t0 < 0.5  # the kernel ends the connection with the process; Ray takes ~0.4-1 s
    assert sorted(seen, key=str) == sorted([(3, p.pid), ("other", p.pid)], key=str)


async def test_a_closed_watch_reports_nothing_and_the_process_serves_new_ones(process):
    p, address = process
    seen = []
    first = ProcessWatch(0, p.pid, address, lambda w, pid: seen.append("first"))
    await asyncio.wait_for(first.connected, 10)
    first.close()  # an orchestrator that lets go of a process (it closed, or the worker restarted)
    await asyncio.sleep(0.2)
    assert seen == [] and not first.exited.done() and p.is_alive()
    second = ProcessWatch(0, p.pid, address, lambda w, pid: seen.append("second"))
    await asyncio.wait_for(second.connected, 10)
    os.kill(p.pid, signal.SIGKILL)
    await asyncio.wait_for(second.exited, 10)
    assert seen == ["second"]


async def test_an_unreachable_lifeline_is_logged_and_never_reports_an_exit(caplog):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    seen = []
    with caplog.at_level(logging.WARNING, logger="capsulert.orchestrator.lifeline"):
        watch = ProcessWatch(5, 1234, ("127.0.0.1", port), lambda w, pid: seen.append(pid))
        await asyncio.wait_for(watch.task, 10)
    assert seen == [] and not watch.exited.done() and not watch.connected.done()
    assert "worker 5: its lifeline" in caplog.text and "seen through Ray only" in caplog.text
