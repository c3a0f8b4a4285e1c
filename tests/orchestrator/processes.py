"""Killing a worker process from a test: a kill is only sent by ray.kill or os.kill, and a call made right
after it can still reach the live process; tests that need the worker gone wait until its pid is gone."""
import asyncio
import os
import signal
import time


async def kill_and_wait(pid: int, timeout_s: float = 30) -> None:
    """SIGKILL a worker process and wait until it is gone (Ray may then restart the actor in a new one)."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"worker pid {pid} did not die")
