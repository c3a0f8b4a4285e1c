"""Worker logs reach the driver: a `capsulert` record a Ray worker logs at WARNING (a capsule dropped because
no slower tier has room) appears on the driver's stderr, prefixed by Ray with the worker process; INFO
records (the worker's start) appear too once the driver's `capsulert` logger is at INFO, and not before.

The driver is a process of its own: this suite's Ray is started without log forwarding (conftest.py), and
the orchestrator forwards worker output of a Ray it starts itself."""
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from capsulert.engine.engine import Engine

PROMPT = "The harbour master counts the boats that come back before the storm. " * 4
ENGINE = dict(device="cpu", slots=2, max_seq=512, prefill_chunk=128)
WAIT_S = 120

DRIVER = textwrap.dedent('''
    import asyncio, logging, sys
    from capsulert import Orchestrator

    level, model, budget, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    logging.getLogger("capsulert").setLevel(level)  # what the user configures in the driver

    async def main():
        engine = dict(model=model, **%r, capsule_budgets={"device": budget, "host": 0})
        async with await Orchestrator.start(dict(engine=engine, local_num_cpus=1, torch_threads=1)) as orch:
            s = await orch.open(prompt)
            await s.snapshot("first")
            await s.snapshot("second")  # no room for both and nowhere to move the first: it is dropped
            print("TRIGGERED", flush=True)
            sys.stdin.readline()  # the test has read what it waited for

    asyncio.run(main())
''' % ENGINE)


@pytest.fixture(scope="module")
def one_capsule_bytes(default_model_dir) -> int:
    """The gpu budget that holds exactly one capsule of PROMPT."""
    eng = Engine.from_config(dict(model=str(default_model_dir), **ENGINE))
    s = eng.open()
    s.append(PROMPT)
    nbytes = s.snapshot("probe").nbytes
    eng.close()
    return nbytes


def run_driver(level: str, model_dir, budget: int, wanted: str) -> str:
    """Run the driver; its stderr up to the line holding `wanted` (or all of it after WAIT_S)."""
    env = {**os.environ, "RAY_DEDUP_LOGS": "0"}
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, level, str(model_dir), str(budget), PROMPT],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and proc.poll() is None and not any(wanted in line for line in err):
            time.sleep(0.2)
        proc.stdin.write("\n")
        proc.stdin.flush()
        out, _ = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    assert "TRIGGERED" in out, "".join(err)[-4000:]
    return "".join(err)


@pytest.mark.parametrize("level", ["WARNING", "INFO"])
def test_worker_records_reach_the_driver(default_model_dir, one_capsule_bytes, level):
    err = run_driver(level, default_model_dir, one_capsule_bytes, "dropped capsule default/first")
    dropped = [line for line in err.splitlines() if "dropped capsule default/first" in line]
    assert dropped, err[-4000:]
    assert "WARNING capsulert.capsule_store.store" in dropped[0] and "pid=" in dropped[0]  # Ray's process prefix
    ready = [line for line in err.splitlines() if "INFO capsulert.worker.core: worker 0 ready" in line]
    assert bool(ready) == (level == "INFO"), err[-4000:]  # logged before the warning: it would be there
