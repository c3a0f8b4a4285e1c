"""Reading the step loop's records from a test: a caller's reply goes out during the step that computed it,
and the loop keeps that step's record once the step is over, so a test waits for the records it expects."""
import asyncio
import time
from typing import Any, Callable


def async_read(read: Callable, *args: Any) -> Callable:
    """`read(*args)` as the coroutine function records_when takes (a scheduler's trace, read in-process)."""
    async def call() -> list[dict]:
        return read(*args)
    return call


async def records_when(read: Callable, ready: Callable[[list[dict]], bool], timeout_s: float = 10.0) -> list[dict]:
    """The records `read()` returns (a coroutine function) once `ready(records)` holds, or the last read once
    `timeout_s` has passed (the test's own assertions then say what was missing)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = await read()
        if ready(records) or time.monotonic() > deadline:
            return records
        await asyncio.sleep(0.01)
