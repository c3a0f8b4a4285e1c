"""Worker restart: how long a killed worker takes to come back, and how fast its callers learn of the death.

One orchestrator with one worker (a disk_dir, so pinned capsules are persisted); per round: `--callers`
sessions each run a long generate, the worker process is SIGKILLed, and the benchmark measures
- `worker_lost_s`: kill (process gone) to the last in-flight caller's WorkerLost (target: < 1 s);
- `restart_s`: kill to the worker answering again (a health ping), the figure issue 29 asks for on the H200
  (target: <= 5 s with warm compile caches; the first round warms them when there are none);
- `seen_restart_s`: the orchestrator's own measure, its death seen to the new process answering;
- `started_s`: the new process's engine start (engine load, CUDA graph capture, pinned reload); the rest
  of `restart_s` is Ray's: noticing the death, handing the actor to a worker process, importing capsulert.
Writes bench/out/worker_restart.json.

    python bench/worker_restart.py --device cpu --rounds 2                       # the CPU box
    python bench/worker_restart.py --device cuda --model random:capsulert/configs/models/qwen3_5-9b-shape.yaml \\
        --slots 64 --max-seq 8192 --rounds 3                                      # the H200
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import OUT_DIR, log, machine_info, print_table, write_json  # noqa: E402

from capsulert.errors import WorkerLost  # noqa: E402
from capsulert.orchestrator import Orchestrator  # noqa: E402
from capsulert.protocol.sampling import SamplingParams  # noqa: E402

PROMPT = "A worker dies in the middle of a decode step; how long until its callers know, and until it is back? "


async def _gone(pid: int) -> None:
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        await asyncio.sleep(0.005)


async def one_round(orch: Orchestrator, callers: int, max_new: int) -> dict:
    sessions = await asyncio.gather(*(orch.open(PROMPT) for _ in range(callers)))
    running = [asyncio.ensure_future(s.generate(max_new, SamplingParams(ignore_eos=True))) for s in sessions]
    await asyncio.sleep(0.5)
    pid = (await orch.health())[0]["pid"]
    os.kill(pid, signal.SIGKILL)
    await _gone(pid)
    t0 = time.monotonic()
    outcomes = await asyncio.gather(*running, return_exceptions=True)
    lost_s = time.monotonic() - t0
    [h] = await orch.health()  # waits for the restart
    restart_s = time.monotonic() - t0
    return {"callers": callers, "worker_lost": sum(isinstance(o, WorkerLost) for o in outcomes),
            "worker_lost_s": lost_s, "restart_s": restart_s, "seen_restart_s": h["last_restart_s"],
            "started_s": h["started_s"], "reloaded": len(h["reloaded"])}


async def run(args) -> dict:
    disk = tempfile.mkdtemp(prefix="capsulert-restart-")
    engine = {"model": args.model, "device": args.device, "slots": args.slots, "max_seq": args.max_seq,
              "disk_dir": disk}
    cfg = {"engine": engine, "num_workers": 1, "max_restarts": args.rounds + 1, "call_timeout_s": 600,
           "torch_threads": args.torch_threads}
    async with await Orchestrator.start(cfg) as orch:
        s = await orch.open(PROMPT * 8)
        await s.snapshot("restart-bench-pinned", pin=True)  # reloaded by every restart
        await s.close()
        rounds = []
        for i in range(args.rounds):
            r = await one_round(orch, min(args.callers, args.slots), args.max_new)
            log(f"round {i}: callers lost after {r['worker_lost_s']:.2f} s, back after {r['restart_s']:.2f} s "
                f"(its start: {r['started_s']:.2f} s)")
            rounds.append(r)
    return {"machine": machine_info(args.device), "args": vars(args), "rounds": rounds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", default="default")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--max-seq", type=int, default=2048)
    ap.add_argument("--callers", type=int, default=30)
    ap.add_argument("--max-new", type=int, default=1500, help="tokens each caller's generate asks for")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--torch-threads", type=int, default=None)
    args = ap.parse_args()
    res = asyncio.run(run(args))
    print_table(res["rounds"], ["callers", "worker_lost", "worker_lost_s", "restart_s", "seen_restart_s",
                                "started_s", "reloaded"])
    write_json(OUT_DIR / "worker_restart.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
