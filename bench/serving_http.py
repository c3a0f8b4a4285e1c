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
The one-at-a-time requests alternate between the paths (API, HTTP, raw, API, ...), so drift over time falls
on all alike; the third path is the same HTTP requests from a plain httpx client (JSON in, JSON or SSE lines
out): HTTP minus raw is what the openai client itself costs, raw minus API what the server and the
transport cost. The concurrent sweeps run one path after the other.
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
async def start_server(engine_cfg: dict, threads: int, max_inflight: int):
    """The orchestrator (one worker) and the HTTP app on it, served on a free loopback port in this event
    loop: (orchestrator, its HTTP server, base URL)."""
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
        http = await DirectIngress.start(build_app(server_state(opts, orch)), opts.host, opts.port, access_log=False)
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


def http_path(clients: Clients, path: str, kind: str):
    """An agent (like api_stream) whose requests the clients' process sends: path "http" (openai) or "raw"."""
    async def agent(_, name: str, turn: list[int], gen: int) -> dict:
        return await clients.ask(op="one", path=path, kind=kind, name=name, turn=turn, gen=gen)
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
    request each): {path: (wall times in ms, tokens)}."""
    for agent, target in paths.values():
        await agent(target, names[0], turns[0], gen)
    out = {p: ([], []) for p in paths}
    for i in range(requests):
        k = i % len(names)
        for p, (agent, target) in paths.items():
            res = await agent(target, names[k], turns[k], gen)
            out[p][0].append(res["wall_ms"])
            out[p][1].append(res["tokens"])
    return out


async def measure(args, orch, clients: Clients, names, turns) -> dict:
    api = {"latency_ms": {}, "tokens": {}, "sweep": {}}
    http = {"latency_ms": {}, "tokens": {}, "sweep": {}}
    raw = {"latency_ms": {}, "tokens": {}}
    for kind, on_api in (("stream", api_stream), ("whole", api_whole)):
        got = await alternate({"api": (on_api, orch), "http": (http_path(clients, "http", kind), None),
                               "raw": (http_path(clients, "raw", kind), None)}, names, turns, args.gen, args.requests)
        for side, key in ((api, "api"), (http, "http"), (raw, "raw")):
            side["latency_ms"][kind], side["tokens"][kind] = got[key]
    for n in args.ns:
        log(f"  N={n}")
        api["sweep"][n] = await api_sweep(orch, names[:n], turns[:n], args.gen)
        http["sweep"][n] = await clients.ask(op="sweep", names=names[:n], turns=turns[:n], gen=args.gen)
    return {"api": api, "http": http, "raw": raw}


async def main_http(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    chunk, n_max = args.prefill_chunk, max(args.ns)
    max_seq = -(-(args.context + args.turn + args.gen + 1) // chunk) * chunk
    engine_cfg = dict(model=args.model, device=args.device, slots=n_max + 2, max_seq=max_seq, prefill_chunk=chunk)
    contexts, turns = workload(args, n_max)
    names = [f"agent{i}" for i in range(n_max)]

    log("the HTTP server and the async API on one worker; the openai client in a process of its own")
    orch, server, url = await start_server(engine_cfg, args.threads, max_inflight=max(256, 2 * n_max))
    try:
        clients = await Clients.start(url)
        try:
            await clients.ask(op="capsules", contexts=contexts)  # agent{i} = context i, made through the server
            got = await measure(args, orch, clients, names, turns)
        finally:
            await clients.close()
    finally:
        await server.stop()
        await orch.close()
    return report(args, **got)


def report(args, api: dict, http: dict, raw: dict) -> int:
    for path in ("stream", "whole"):  # the server answers exactly what the async API does
        assert http["tokens"][path] == api["tokens"][path], f"{path}: HTTP tokens differ from the async API's"
        assert raw["tokens"][path] == api["tokens"][path], f"{path}: raw HTTP tokens differ from the async API's"
    for n in args.ns:
        assert http["sweep"][n]["tokens"] == api["sweep"][n]["tokens"], f"N={n}: HTTP tokens differ"

    # the overhead per request: the median of the paired differences (each HTTP request against the API
    # request just before it), and the difference of the two p50s
    def paired_ms(minus: dict, side: dict, p: str) -> float:
        return statistics.median(h - a for a, h in zip(minus["latency_ms"][p], side["latency_ms"][p]))

    def p50(xs):
        return percentile(xs, 50) if xs else float("nan")

    latency = [{"request": path, "api_p50_ms": percentile(api["latency_ms"][path], 50),
                "http_p50_ms": percentile(http["latency_ms"][path], 50),
                "overhead_p50_ms": percentile(http["latency_ms"][path], 50) - percentile(api["latency_ms"][path], 50),
                "paired_overhead_p50_ms": paired_ms(api, http, path),
                "server_paired_p50_ms": paired_ms(api, raw, path),  # plain httpx client minus the API
                "client_paired_p50_ms": paired_ms(raw, http, path),  # the openai client minus plain httpx
                "api_p99_ms": percentile(api["latency_ms"][path], 99),
                "http_p99_ms": percentile(http["latency_ms"][path], 99)} for path in ("stream", "whole")]
    sweep = [{"n": n, "api_tokens_per_s": api["sweep"][n]["tokens_per_s"],
              "http_tokens_per_s": http["sweep"][n]["tokens_per_s"],
              "api_ttft_p50_ms": p50(api["sweep"][n]["ttft_ms"]), "http_ttft_p50_ms": p50(http["sweep"][n]["ttft_ms"]),
              "api_itl_p50_ms": p50(api["sweep"][n]["itl_ms"]), "http_itl_p50_ms": p50(http["sweep"][n]["itl_ms"])}
             for n in args.ns]
    print(f"one request at a time ({args.requests} per path; restore {args.context}-token capsule, "
          f"{args.turn}-token turn, {args.gen} tokens):")
    print_table(latency, list(latency[0]))
    print("all agents at once (streamed):")
    print_table(sweep, list(sweep[0]))
    write_json(Path(args.out or OUT_DIR) / "serving_http.json", {"machine": machine_info(args.device),
                                                               "args": vars(args), "latency": latency, "sweep": sweep})
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
