"""The HTTP side of `bench/serving.py --http`: the agent workload through capsulert's HTTP server with the
official openai client, and the same requests through the async API, both on one worker.

This process is the server, as a `capsulert serve` replica is with its own HTTP server (the default,
ServerOptions.direct_ingress): one orchestrator with one worker, the app (capsulert/serve/app.py) built on
it by the replica's own code (deployment.server_state) and served by uvicorn on this process's event loop
(ingress.DirectIngress; uvloop when installed, as in a Ray Serve replica). The async API path calls that
same orchestrator; the HTTP clients run in a process of their own (serving_http_client.py), driven over a
pipe, as clients are. So both paths reach the same worker, on one GPU as on a CPU box (before, the API had
an orchestrator and a worker of its own, which waited forever for a second GPU on a one-GPU host), and
their difference is the HTTP path alone: client, HTTP server, FastAPI, JSON / SSE.
- streamed: restore the agent's capsule, append its turn, stream the tokens and close, in one request to the
  worker (`restore_append_stream`; `completions.create(stream=True, capsule=...)`);
- whole: the same, not streamed (`restore_append_generate`; `completions.create(capsule=...)`).
The one-at-a-time requests alternate between the paths (API, HTTP, raw, lean, API, ...), so drift over time
falls on all alike. The HTTP requests come from three clients (serving_http_client.py): the official openai
client (path "http", the headline), httpx (path "raw", what the openai client is built on) and a minimal
HTTP/1.1 client ("lean", the least a client costs). Each one's overhead is the median of its requests' paired
differences with the API request before them. Where it goes is measured inside the server too
(serving_http_timing.py): from the moment the app has the whole request to its last byte written, minus the
worker call it made, is the server's own work; the client's wall time minus that span is the client and the
loopback (both processes read the same monotonic clock). The concurrent sweeps run one path after the other.
"""
from __future__ import annotations

import asyncio
import json
import socket
import statistics
import sys
import time
from pathlib import Path

from common import OUT_DIR, log, machine_info, percentile, print_table, write_json
from serving_http_timing import ServerClock, TimedOrchestrator

from capsulert.protocol.sampling import SamplingParams
from capsulert.protocol.results import FinalEvent

PARAMS = SamplingParams(ignore_eos=True)
MODEL = "bench"
CLIENT = "from serving_http_client import main; main()"  # run with bench/ as the working directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- server
async def start_server(engine_cfg: dict, threads: int, max_inflight: int, clock: ServerClock):
    """The orchestrator (one worker) and the HTTP app on it, served on a free loopback port in this event
    loop, timed by `clock`: (orchestrator, its HTTP server, base URL)."""
    from capsulert.orchestrator import Orchestrator
    from capsulert.serve.app import build_app
    from capsulert.serve.deployment import server_state
    from capsulert.serve.ingress import DirectIngress
    from capsulert.config.server import ServerOptions

    opts = ServerOptions.build(
        orchestrator=dict(engine=engine_cfg, torch_threads=threads, call_timeout_s=3600, max_queued=max_inflight),
        served_model_name=MODEL, port=free_port(), log_level="WARNING")
    orch = await Orchestrator.start(opts.orchestrator_config())
    try:
        app = clock.app(build_app(server_state(opts, TimedOrchestrator(orch, clock))))
        http = await DirectIngress.start(app, opts.host, opts.port, access_log=False)
    except BaseException:
        await orch.close()
        raise
    return orch, http, f"http://{opts.host}:{opts.port}/v1"


class Clients:
    """The HTTP clients' process (serving_http_client.py): one JSON command per line in, one answer out."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    @classmethod
    async def start(cls, base_url: str) -> "Clients":
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, base_url, MODEL,
                                                    cwd=Path(__file__).resolve().parent, limit=1 << 26,
                                                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        return cls(proc)

    async def ask(self, **command) -> dict:
        self.proc.stdin.write(json.dumps(command).encode() + b"\n")
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the HTTP clients' process ended (exit status {await self.proc.wait()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"HTTP client: {answer['error']}")
        return answer

    async def close(self) -> None:
        if self.proc.returncode is None:
            self.proc.stdin.close()
            await self.proc.wait()


CLIENTS = {"http": "openai", "raw": "httpx", "lean": "lean"}  # path -> the client that sends its requests
TIMES = ("server_ms", "server_before_ms", "server_after_ms", "client_ms")  # where an HTTP request's time went


def http_path(clients: Clients, path: str, kind: str, clock: ServerClock):
    """An agent (like api_stream) whose requests the clients' process sends (path: a key of CLIENTS), with
    where its time went in the server: `server_ms` (the server's own work) and `client_ms` (the client and
    the loopback: its wall time outside entered -> sent)."""
    async def agent(_, name: str, turn: list[int], gen: int) -> dict:
        clock.reset()
        res = await clients.ask(op="one", path=path, kind=kind, name=name, turn=turn, gen=gen)
        before, after = clock.own_ms()
        return {**res, "server_ms": before + after, "server_before_ms": before, "server_after_ms": after,
                "client_ms": (res["t1"] - res["t0"] - (clock.sent - clock.entered)) * 1e3}
    return agent


# ---------------------------------------------------------------------------------------------- agents
async def api_stream(orch, name: str, turn: list[int], gen: int) -> dict:
    t0 = time.perf_counter()
    stamps, tokens = [], []
    async for ev in orch.restore_append_stream(name, turn, gen, PARAMS):
        if isinstance(ev, FinalEvent):
            continue
        stamps.append(time.perf_counter())
        tokens.append(ev.token)
    end = time.perf_counter()
    itl = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
    return {"ttft_ms": (stamps[0] - t0) * 1e3, "itl_ms": itl, "tokens": tokens, "wall_ms": (end - t0) * 1e3}


async def api_whole(orch, name: str, turn: list[int], gen: int) -> dict:
    t0 = time.perf_counter()
    res = await orch.restore_append_generate(name, turn, gen, PARAMS)
    return {"tokens": list(res), "wall_ms": (time.perf_counter() - t0) * 1e3}


async def api_sweep(orch, names, turns, gen: int) -> dict:
    """All agents at once through the async API: aggregate tokens/s, TTFT and per-agent tokens."""
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(api_stream(orch, nm, tn, gen) for nm, tn in zip(names, turns)))
    wall = time.perf_counter() - t0
    return {"tokens_per_s": len(names) * gen / wall, "ttft_ms": [o["ttft_ms"] for o in outs],
            "itl_ms": [x for o in outs for x in o["itl_ms"]], "tokens": [o["tokens"] for o in outs]}


# ------------------------------------------------------------------------------------------------ main
def workload(args, n: int) -> tuple[list[list[int]], list[list[int]]]:
    """n contexts and n turns of random token ids (the same as bench/serving.py's)."""
    import torch

    g = torch.Generator().manual_seed(0)
    contexts = [torch.randint(10, 4000, (args.context,), generator=g).tolist() for _ in range(n)]
    turns = [torch.randint(10, 4000, (args.turn,), generator=g).tolist() for _ in range(n)]
    return contexts, turns


async def alternate(paths: dict, names, turns, gen: int, requests: int) -> dict:
    """`requests` requests per path, one at a time, alternating between the paths (after one warm-up
    request each): {path: {"wall_ms": [...], "tokens": [...], and the HTTP paths' TIMES}}."""
    for agent, target in paths.values():
        await agent(target, names[0], turns[0], gen)
    out = {p: {} for p in paths}
    for i in range(requests):
        k = i % len(names)
        for p, (agent, target) in paths.items():
            res = await agent(target, names[k], turns[k], gen)
            for key in ("wall_ms", "tokens", *TIMES):
                if key in res:
                    out[p].setdefault(key, []).append(res[key])
    return out


async def measure(args, orch, clients: Clients, clock: ServerClock, names, turns) -> dict:
    """{path: {"latency_ms": {kind: [...]}, "tokens": {kind: [...]}, ...}} for the API and every client, and
    the concurrent sweeps of the API and the openai client."""
    sides = {p: {"latency_ms": {}, "tokens": {}, **{t: {} for t in TIMES}} for p in ("api", *CLIENTS)}
    for kind, on_api in (("stream", api_stream), ("whole", api_whole)):
        paths = {"api": (on_api, orch), **{p: (http_path(clients, p, kind, clock), None) for p in CLIENTS}}
        got = await alternate(paths, names, turns, args.gen, args.requests)
        for p, side in sides.items():
            side["latency_ms"][kind], side["tokens"][kind] = got[p]["wall_ms"], got[p]["tokens"]
            for t in TIMES if p != "api" else ():
                side[t][kind] = got[p][t]
    sides["api"]["sweep"], sides["http"]["sweep"] = {}, {}
    for n in args.ns:
        log(f"  N={n}")
        sides["api"]["sweep"][n] = await api_sweep(orch, names[:n], turns[:n], args.gen)
        sides["http"]["sweep"][n] = await clients.ask(op="sweep", names=names[:n], turns=turns[:n], gen=args.gen)
    return sides


async def main_http(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    chunk, n_max = args.prefill_chunk, max(args.ns)
    max_seq = -(-(args.context + args.turn + args.gen + 1) // chunk) * chunk
    engine_cfg = dict(model=args.model, device=args.device, slots=n_max + 2, max_seq=max_seq, prefill_chunk=chunk)
    contexts, turns = workload(args, n_max)
    names = [f"agent{i}" for i in range(n_max)]

    log("the HTTP server and the async API on one worker; the openai client in a process of its own")
    clock = ServerClock()
    orch, server, url = await start_server(engine_cfg, args.threads, max(256, 2 * n_max), clock)
    try:
        clients = await Clients.start(url)
        try:
            await clients.ask(op="capsules", contexts=contexts)  # agent{i} = context i, made through the server
            got = await measure(args, orch, clients, clock, names, turns)
        finally:
            await clients.close()
    finally:
        await server.stop()
        await orch.close()
    return report(args, **got)


def report(args, api: dict, http: dict, raw: dict, lean: dict) -> int:
    sides = {"http": http, "raw": raw, "lean": lean}
    for kind in ("stream", "whole"):  # the server answers exactly what the async API does, to every client
        for p, side in sides.items():
            assert side["tokens"][kind] == api["tokens"][kind], f"{kind}: {CLIENTS[p]} tokens differ from the API's"
    for n in args.ns:
        assert http["sweep"][n]["tokens"] == api["sweep"][n]["tokens"], f"N={n}: HTTP tokens differ"

    # the overhead per request: the median of the paired differences (each HTTP request against the API
    # request just before it), and the difference of the two p50s
    def paired_ms(minus: dict, side: dict, p: str) -> float:
        return statistics.median(h - a for a, h in zip(minus["latency_ms"][p], side["latency_ms"][p]))

    def p50(xs):
        return percentile(xs, 50) if xs else float("nan")

    latency = [{"request": kind, "api_p50_ms": p50(api["latency_ms"][kind]),
                "http_p50_ms": p50(http["latency_ms"][kind]),
                "overhead_p50_ms": p50(http["latency_ms"][kind]) - p50(api["latency_ms"][kind]),
                "paired_overhead_p50_ms": paired_ms(api, http, kind),
                "server_paired_p50_ms": paired_ms(api, raw, kind),  # httpx minus the API
                "client_paired_p50_ms": paired_ms(raw, http, kind),  # the openai client minus httpx
                "api_p99_ms": percentile(api["latency_ms"][kind], 99),
                "http_p99_ms": percentile(http["latency_ms"][kind], 99)} for kind in ("stream", "whole")]
    # every client's overhead, and where it went: the server's own work, the client and the loopback
    by_client = [{"request": kind, "client": CLIENTS[p], "p50_ms": p50(side["latency_ms"][kind]),
                  "paired_overhead_p50_ms": paired_ms(api, side, kind),
                  "server_own_p50_ms": p50(side["server_ms"][kind]),
                  "before_call_p50_ms": p50(side["server_before_ms"][kind]),
                  "after_call_p50_ms": p50(side["server_after_ms"][kind]),
                  "client_and_loopback_p50_ms": p50(side["client_ms"][kind]),
                  "p99_ms": percentile(side["latency_ms"][kind], 99)}
                 for kind in ("stream", "whole") for p, side in sides.items()]
    sweep = [{"n": n, "api_tokens_per_s": api["sweep"][n]["tokens_per_s"],
              "http_tokens_per_s": http["sweep"][n]["tokens_per_s"],
              "api_ttft_p50_ms": p50(api["sweep"][n]["ttft_ms"]), "http_ttft_p50_ms": p50(http["sweep"][n]["ttft_ms"]),
              "api_itl_p50_ms": p50(api["sweep"][n]["itl_ms"]), "http_itl_p50_ms": p50(http["sweep"][n]["itl_ms"])}
             for n in args.ns]
    print(f"one request at a time ({args.requests} per path; restore {args.context}-token capsule, "
          f"{args.turn}-token turn, {args.gen} tokens), the official openai client:")
    print_table(latency, list(latency[0]))
    print("the same requests from each client: overhead over the API, and where it went (the server's own work, "
          "before and after its worker call; the client and the loopback)")
    print_table(by_client, list(by_client[0]))
    print("all agents at once (streamed):")
    print_table(sweep, list(sweep[0]))
    write_json(Path(args.out or OUT_DIR) / "serving_http.json",
               {"machine": machine_info(args.device), "args": vars(args), "latency": latency, "by_client": by_client,
                "sweep": sweep})
    return 0


def run(args) -> int:
    """main_http on uvloop when it is installed (a Ray Serve replica's loop), else asyncio's. What capsulert
    refuses (no GPU for the worker, a bad model, ...) is one line on stderr and exit status 1."""
    from capsulert.errors import CapsuleRTError

    try:
        import uvloop
        loop_run = uvloop.run
    except ImportError:
        loop_run = asyncio.run
    try:
        return loop_run(main_http(args))
    except CapsuleRTError as e:
        print(f"serving.py --http: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
