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
from tests.orchestrator.lifeline_process import serve

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture
def process(request):
    """A stand-in worker process (lifeline_process.serve), spawned."""
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=serve, args=(there, getattr(request, "param", None)), daemon=True)
    p.start()
    assert here.poll(60), "the stand-in process did not start"
    address, token = here.recv()
    yield p, tuple(address), token
    if p.is_alive():
        p.kill()
    p.join(10)


async def test_a_watch_sees_its_process_exit_at_once(process):
    p, address, token = process
    seen = []
    watch = ProcessWatch(3, p.pid, address, lambda w, pid: seen.append((w, pid)), token)
    other = ProcessWatch(3, p.pid, address, lambda w, pid: seen.append(("other", pid)), token)
    await asyncio.wait_for(asyncio.gather(watch.connected, other.connected), 10)
    assert not watch.exited.done() and seen == []
    t0 = time.monotonic()
    os.kill(p.pid, signal.SIGKILL)
    await asyncio.wait_for(asyncio.gather(watch.exited, other.exited), 10)
    assert time.monotonic() - t0 < 0.5  # the kernel ends the connection with the process; Ray takes ~0.4-1 s
    assert sorted(seen, key=str) == sorted([(3, p.pid), ("other", p.pid)], key=str)


async def test_a_closed_watch_reports_nothing_and_the_process_serves_new_ones(process):
    p, address, token = process
    seen = []
    first = ProcessWatch(0, p.pid, address, lambda w, pid: seen.append("first"), token)
    await asyncio.wait_for(first.connected, 10)
    first.close()  # an orchestrator that lets go of a process (it closed, or the worker restarted)
    await asyncio.sleep(0.2)
    assert seen == [] and not first.exited.done() and p.is_alive()
    second = ProcessWatch(0, p.pid, address, lambda w, pid: seen.append("second"), token)
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
        watch = ProcessWatch(5, 1234, ("127.0.0.1", port), lambda w, pid: seen.append(pid), b"token")
        await asyncio.wait_for(watch.task, 10)
    assert seen == [] and not watch.exited.done() and not watch.connected.done()
    assert "worker 5: its lifeline" in caplog.text and "seen through Ray only" in caplog.text


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def settle(pid: int, want: int, within_s: float) -> int:
    deadline = time.monotonic() + within_s
    while descriptors(pid) > want and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return descriptors(pid)


@pytest.mark.parametrize("process", [96], indirect=True)
async def test_a_hostile_client_costs_bounded_descriptors_and_never_ends_the_lifeline(process):
    """Anyone who can reach the node can connect. Garbage, silence and a connection flood used to cost one
    descriptor each without bound (~20,000 ended the lifeline thread with EMFILE, and the worker's disk writes
    then failed): now a connection is held only with the process's token, the rest are closed (garbage at
    once, silence after the handshake time), their number is bounded, and a failed accept is retried. With
    96 descriptors the flood makes accepts fail too."""
    from capsulert.worker.lifeline import HANDSHAKE_S, MAX_HELD, MAX_PENDING

    p, address, token = process
    await asyncio.sleep(0.2)
    baseline = descriptors(p.pid)
    seen = []
    watch = ProcessWatch(0, p.pid, address, lambda w, pid: seen.append(pid), token)
    await asyncio.wait_for(watch.connected, 10)
    hostile = []
    for i in range(400):
        c = socket.socket()
        c.setblocking(False)
        try:
            c.connect_ex(address)
        except OSError:
            pass
        hostile.append(c)
        if i % 2:
            try:
                c.send(b"GET / HTTP/1.1\r\n\r\n" * 4)
            except OSError:
                pass
        if i % 50 == 0:
            assert descriptors(p.pid) <= baseline + 1 + MAX_PENDING + MAX_HELD
            await asyncio.sleep(0)
    wrong = ProcessWatch(1, p.pid, address, lambda w, pid: seen.append(("wrong", pid)), bytes(len(token)))
    # a wrong token is closed before the worker's HELD byte: a refused handshake, not the process's death; the
    # watch tries again, then leaves the process to Ray
    await asyncio.wait_for(wrong.task, 10 + 3 * HANDSHAKE_S)
    assert not wrong.exited.done() and not wrong.connected.done()
    for c in hostile:
        c.close()
    # every hostile connection gone within the handshake time: back to the baseline and the one held watch
    assert await settle(p.pid, baseline + 1, HANDSHAKE_S + 5) == baseline + 1
    assert seen == [] and not watch.exited.done() and p.is_alive()
    late = ProcessWatch(2, p.pid, address, lambda w, pid: seen.append(("late", pid)), token)
    await asyncio.wait_for(late.connected, 10)  # the lifeline still accepts and holds
    os.kill(p.pid, signal.SIGKILL)
    await asyncio.wait_for(asyncio.gather(watch.exited, late.exited), 10)
    assert sorted(seen, key=str) == sorted([p.pid, ("late", p.pid)], key=str)


class RefusingLifeline:
    """A lifeline stand-in on this event loop: it closes its first `refuse` connections before saying HELD
    (what the worker does to a token that came after its handshake time), then holds the next."""

    def __init__(self, refuse: int, exit_on_refusal: bool = False):
        self.refuse, self.held, self.exit_on_refusal = refuse, [], exit_on_refusal

    async def start(self) -> tuple[str, int]:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[:2]

    async def _conn(self, reader, writer) -> None:
        from capsulert.worker.lifeline import HELD, TOKEN_BYTES

        await reader.readexactly(TOKEN_BYTES)
        if self.refuse:
            self.refuse -= 1
            if self.exit_on_refusal:
                self.server.close()  # no longer listening: the next connect is refused
            writer.close()
            return
        writer.write(HELD)
        self.held.append(writer)


async def test_a_token_refused_for_lateness_is_not_taken_for_the_processs_death():
    """An orchestrator's event loop held up past the worker's handshake time (a test's synchronous engine call
    did it on the 2-core box) got its lifeline closed before the token was read: the watch took that for the
    process's death, and a live worker's calls failed with WorkerLost. An end before HELD is now answered by
    connecting again; only an end after it, or a refused connect, is a death."""
    lifeline = RefusingLifeline(refuse=2)
    address = await lifeline.start()
    seen = []
    watch = ProcessWatch(0, 4321, address, lambda w, pid: seen.append(pid), bytes(16))
    await asyncio.wait_for(watch.connected, 10)
    assert seen == [] and not watch.exited.done() and lifeline.refuse == 0
    lifeline.held[0].close()  # the process's end
    await asyncio.wait_for(watch.exited, 10)
    assert seen == [4321]


async def test_a_refused_token_then_a_refused_connect_is_the_processs_death():
    """The process died during the handshake: its connection ends before HELD and its port refuses the next."""
    lifeline = RefusingLifeline(refuse=1, exit_on_refusal=True)
    address = await lifeline.start()
    seen = []
    watch = ProcessWatch(1, 4321, address, lambda w, pid: seen.append(pid), bytes(16))
    await asyncio.wait_for(watch.exited, 10)
    assert seen == [4321] and not watch.connected.done()
