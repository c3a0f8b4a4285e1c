"""HTTP load: many concurrent clients against a small `capsulert serve`, with mixed n and batch prompts.

Issue 29 item 1: with `slots` = 8, a request whose prompts or n needed more sessions than were free used to
wait `slot_wait_s` and get 429 even on an idle server (200 clients: 137 x 200, 51 x 429, 12 streams ended by
an error event). Now requests queue for their sessions; this drives that case and checks every answer:
- each client sends `--requests` requests one after another, all clients at once; a request is a completion
  of 1, 2 or 4 prompts with n of 1, 2, 4 or 8 (prompts x n <= the server's slots), or a chat completion,
  streamed or not, seeded;
- every request must be answered 200 with all of its choices (each prompt x n, each with a finish reason,
  the completion tokens adding up in `usage`), a stream must end with `data: [DONE]` and carry no error
  event; anything else counts as lost (`lost`, with a sample of what went wrong);
- latency is the whole request (a stream: until [DONE]); p50 / p99 / max, and the requests per second.

Loopback only, bounded in clients, requests and time (`--timeout`). Writes bench/out/http_load.json.

    python bench/http_load.py --clients 200 --requests 3              # starts its own server (slots 8, CPU)
    python bench/http_load.py --url http://127.0.0.1:8000 --model default --clients 200
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from common import OUT_DIR, log, machine_info, percentile, print_table, write_json  # noqa: E402

PROMPTS = ["The capsule runtime keeps", "An agent returns to its context", "Once upon a time", "The scheduler",
           "Write a haiku about", "The quick brown fox", "In the beginning", "A hybrid model folds"]
# (prompts, n) of the requests, weighted: mostly one or two sessions, every shape up to the 8 slots
SHAPES = [(1, 1)] * 4 + [(1, 2), (2, 1)] * 2 + [(1, 4), (2, 2), (4, 1), (1, 8), (2, 4), (4, 2)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_request(rng: random.Random, model: str, max_tokens: int, slots: int) -> tuple[str, dict, int]:
    """(path, body, choices expected) of one request of the mix."""
    prompts, n = rng.choice([s for s in SHAPES if s[0] * s[1] <= slots])
    stream = rng.random() < 0.4
    common = {"model": model, "max_tokens": max_tokens, "n": n, "temperature": 0.8, "seed": rng.randrange(1 << 30),
              "stream": stream}
    if prompts == 1 and rng.random() < 0.3:
        body = {**common, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}
        return "/v1/chat/completions", body, n
    batch = [rng.choice(PROMPTS) + f" ({rng.randrange(1000)})" for _ in range(prompts)]
    return "/v1/completions", {**common, "prompt": batch if prompts > 1 else batch[0]}, prompts * n


async def one(http: httpx.AsyncClient, path: str, body: dict, want: int) -> tuple[int, str | None]:
    """(status, what went wrong or None) of one request, every answer checked."""
    if body["stream"]:
        finished = set()
        async with http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                return r.status_code, (await r.aread()).decode()[:200]
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return 200, f"error event: {chunk['error']}"
                for c in chunk.get("choices", ()):
                    if c.get("finish_reason"):
                        finished.add(c["index"])
            if not done or finished != set(range(want)):
                return 200, f"stream ended without [DONE] or choices: {sorted(finished)} of {want}"
        return 200, None
    r = await http.post(path, json=body)
    if r.status_code != 200:
        return r.status_code, r.text[:200]
    out = r.json()
    choices = out.get("choices", [])
    if sorted(c["index"] for c in choices) != list(range(want)) or any(not c.get("finish_reason") for c in choices):
        return 200, f"choices {[c.get('index') for c in choices]} of {want}"
    return 200, None


async def run_load(url: str, model: str, key: str | None = None, clients: int = 200, requests: int = 1,
                   max_tokens: int = 8, slots: int = 8, seed: int = 0, timeout: float = 300.0) -> dict:
    """Every client's requests, all clients at once; the tally (see the module docstring)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    statuses: Counter = Counter()
    latency: list[float] = []
    problems: list[str] = []

    async def client(i: int, http: httpx.AsyncClient) -> None:
        rng = random.Random(seed * 100_003 + i)
        for _ in range(requests):
            path, body, want = make_request(rng, model, max_tokens, slots)
            t0 = time.perf_counter()
            try:
                status, problem = await one(http, path, body, want)
            except httpx.HTTPError as e:
                status, problem = 0, f"{type(e).__name__}: {e}"
            latency.append(time.perf_counter() - t0)
            statuses[status] += 1
            if problem is not None or status != 200:
                problems.append(f"{status} {path} n={body['n']}: {problem}")

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=timeout) as http:
        await asyncio.wait_for(asyncio.gather(*(client(i, http) for i in range(clients))), timeout)
    wall = time.perf_counter() - t0
    total = clients * requests
    return {"clients": clients, "requests": total, "ok": total - len(problems), "lost": len(problems),
            "statuses": {str(k): v for k, v in sorted(statuses.items())}, "problems": problems[:10],
            "p50_s": percentile(latency, 50), "p99_s": percentile(latency, 99), "max_s": max(latency),
            "wall_s": wall, "requests_per_s": total / wall}


@contextmanager
def server(model_dir: str | None, slots: int, max_inflight: int, work: Path) -> Iterator[str]:
    """A `capsulert serve` subprocess on a free loopback port (CPU, one worker); its URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "capsulert.cli", "serve", "--model", model_dir or "default", "--served-model-name",
           "load", "--port", str(port), "--device", "cpu", "--slots", str(slots), "--max-seq", "512",
           "--prefill-chunk", "128", "--torch-threads", "1", "--max-inflight", str(max_inflight),
           "--log-level", "WARNING"]
    with open(work / "server.log", "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"capsulert serve exited: {(work / 'server.log').read_text()[-2000:]}")
            try:
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("capsulert serve did not start within 300 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(subprocess.signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="a running server (default: start one: CPU, one worker, --slots)")
    ap.add_argument("--model", default="load", help="the model id the server serves")
    ap.add_argument("--key", help="API key, when the server has --keys")
    ap.add_argument("--model-dir", help="checkpoint of the server this starts (default: the default model)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-inflight", type=int, default=512)
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--requests", type=int, default=1, help="per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    kw = dict(clients=args.clients, requests=args.requests, max_tokens=args.max_tokens, slots=args.slots,
              seed=args.seed)
    if args.url:
        res = asyncio.run(run_load(args.url, args.model, args.key, **kw))
    else:
        with tempfile.TemporaryDirectory() as work, server(args.model_dir, args.slots, args.max_inflight,
                                                           Path(work)) as url:
            log(f"server up at {url}")
            res = asyncio.run(run_load(url, "load", **kw))
    print_table([res], ["clients", "requests", "ok", "lost", "p50_s", "p99_s", "max_s", "wall_s", "requests_per_s"])
    for p in res["problems"]:
        print("  ", p)
    write_json(OUT_DIR / "http_load.json", {"machine": machine_info("cpu"), "args": vars(args), "result": res})
    return 0 if res["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
