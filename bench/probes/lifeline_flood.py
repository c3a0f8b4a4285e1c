"""A hostile client against a worker's lifeline (capsulert/worker/lifeline.py): decode speed and the worker's
descriptors, undisturbed and under a flood of connections and garbage.

A stand-in worker process holds a Lifeline and an engine on the default model (CPU, one torch thread) and
decodes on request; this process floods the lifeline with FLOOD connections (non-blocking connects in
batches, half of them sending garbage, every batch closed after the next opens) and measures.

    python bench/probes/lifeline_flood.py [--flood 20000] [--tokens 64] [--control]

--control floods a listener of this process instead (it accepts and closes at once): the same client load
on the box, none of it at the worker, to tell the lifeline's cost from the flood's own.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import threading
import time


def worker(conn, tokens: int) -> None:
    import torch

    torch.set_num_threads(1)
    from capsulert.engine.engine import Engine
    from capsulert.protocol.sampling import SamplingParams
    from capsulert.worker.lifeline import Lifeline

    lifeline = Lifeline("127.0.0.1")
    eng = Engine.from_config(dict(model="default", device="cpu", slots=2, max_seq=1024, prefill_chunk=128))
    conn.send(lifeline.address)
    while conn.recv() == "decode":
        s = eng.open()
        s.append(list(range(1, 65)))
        t0 = time.perf_counter()
        s.generate(tokens, SamplingParams(ignore_eos=True))
        conn.send(tokens / (time.perf_counter() - t0))
        s.close()


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def flood(address, total: int, stop: threading.Event) -> None:
    batch, opened = [], 0
    while opened < total and not stop.is_set():
        for _ in range(500):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(address)
            batch.append(c)
            opened += 1
        time.sleep(0.05)
        for i, c in enumerate(batch):
            try:
                if i % 2:
                    c.send(b"\x16\x03\x01garbage" * 8)
            except OSError:
                pass
            c.close()
        batch = []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flood", type=int, default=20000)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--control", action="store_true")
    args = ap.parse_args()
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=worker, args=(there, args.tokens), daemon=True)
    p.start()
    address = tuple(here.recv())

    def rate() -> float:
        here.send("decode")
        return here.recv()
    rate()  # warm
    base_fd = descriptors(p.pid)
    quiet = [rate() for _ in range(3)]
    stop = threading.Event()
    target = address
    if args.control:
        dummy = socket.create_server(("127.0.0.1", 0), backlog=64)
        target = dummy.getsockname()

        def drain():
            while not stop.is_set():
                try:
                    dummy.accept()[0].close()
                except OSError:
                    return
        threading.Thread(target=drain, daemon=True).start()
    th = threading.Thread(target=flood, args=(target, args.flood, stop))
    t_flood = time.perf_counter()
    th.start()
    loud, peak = [], base_fd
    while th.is_alive():
        loud.append(rate())
        peak = max(peak, descriptors(p.pid))
    flood_s = time.perf_counter() - t_flood
    t0 = time.perf_counter()
    while descriptors(p.pid) > base_fd and time.perf_counter() - t0 < 30:
        time.sleep(0.05)
    back_s = time.perf_counter() - t0
    print(f"decode tok/s undisturbed: {sorted(quiet)[1]:.1f} (runs {', '.join(f'{r:.1f}' for r in quiet)})")
    print(f"decode tok/s under the flood of {args.flood} connections{' (control: at another listener)' if args.control else ''} over {flood_s:.1f} s: median "
          f"{sorted(loud)[len(loud) // 2]:.1f} ({len(loud)} runs, min {min(loud):.1f})")
    print(f"worker descriptors: baseline {base_fd}, peak during the flood {peak}, back to baseline "
          f"{back_s:.2f} s after it ended (now {descriptors(p.pid)})")
    here.send("stop")
    p.join(10)


if __name__ == "__main__":
    main()
