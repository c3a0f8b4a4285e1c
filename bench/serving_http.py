"""The HTTP side of `bench/serving.py --http`: the agent workload through `capsulert serve` with the
official openai client (async), and the same requests through the async API for comparison.

Each request mirrors what the server does for it (capsulert/serve/generation.py), the same calls to the
worker, so the difference is the HTTP path (client, HTTP server, FastAPI, JSON / SSE; plus Ray Serve's
proxy with ServerOptions.direct_ingress=False) and nothing else. Both paths run at once, each with a worker
of its own on the same device (the server's, and an orchestrator of this process), and the one-at-a-time
requests alternate between them (API, HTTP, API, ...), so drift over time (clocks, other load) falls on
both alike; the concurrent sweeps run one path after the other.
- streamed: restore the agent's capsule, append its turn, stream the tokens and close, in one request to the
  worker (`restore_append_stream`; `completions.create(stream=True, capsule=...)`);
- whole: the same, not streamed (`restore_append_generate`; `completions.create(capsule=...)`).
The one-at-a-time requests also go through a third path, the same HTTP requests from a plain httpx client
(JSON in, JSON or SSE lines out, no openai client): HTTP minus raw is what the openai client itself costs
(building the request, parsing the answer into its types), raw minus API what the server and the transport
cost.
"""
from __future__ import annotations

import asyncio
import socket
import statistics
import time

from common import OUT_DIR, log, machine_info, percentile, print_table, write_json

from capsulert.worker.sampler import SamplingParams
from capsulert.worker.verbs import FinalEvent

PARAMS = SamplingParams(ignore_eos=True)
MODEL = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- server
def start_server(engine_cfg: dict, threads: int, max_inflight: int) -> str:
    """`capsulert serve` in this process (local Ray + Ray Serve); its base URL."""
    from capsulert.serve.options import ServerOptions
    from capsulert.serve.runner import setup_logging, start

    port = free_port()
    opts = ServerOptions.build(engine=engine_cfg, served_model_name=MODEL, port=port, torch_threads=threads,
                               call_timeout_s=3600, max_inflight=max_inflight, log_level="WARNING")
    setup_logging("WARNING")
    start(opts)
    return f"http://127.0.0.1:{port}/v1"


def stop_server() -> None:
    from capsulert.serve.runner import stop

    stop()


def client(base_url: str):
    import httpx
    import openai

    # one connection per concurrent agent, kept alive: the benchmark measures requests, not TCP handshakes
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=3600,
                              http_client=openai.DefaultAsyncHttpxClient(limits=limits))


async def make_capsules(cl, contexts: list[list[int]]) -> None:
    """Capsule agent{i} = context i, made through the server (max_tokens = 0: prefill and snapshot)."""
    for i, ctx in enumerate(contexts):
        await cl.completions.create(model=MODEL, prompt=ctx, max_tokens=0, extra_body={"snapshot_as": f"agent{i}"})


# ---------------------------------------------------------------------------------------------- agents
async def http_stream(cl, name: str, turn: list[int], gen: int) -> dict:
    t0 = time.perf_counter()
    stream = await cl.completions.create(model=MODEL, prompt=turn, max_tokens=gen, temperature=0, stream=True,
                                         extra_body={"capsule": name, "ignore_eos": True, "return_token_ids": True})
    stamps, tokens = [], []
    async for chunk in stream:
        for c in chunk.choices:
            ids = c.model_extra.get("token_ids") or []
            stamps += [time.perf_counter()] * len(ids)
            tokens += ids
    end = time.perf_counter()
    itl = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:]) if b > a]
    return {"ttft_ms": (stamps[0] - t0) * 1e3, "itl_ms": itl, "tokens": tokens, "wall_ms": (end - t0) * 1e3}


async def http_whole(cl, name: str, turn: list[int], gen: int) -> dict:
    t0 = time.perf_counter()
    r = await cl.completions.create(model=MODEL, prompt=turn, max_tokens=gen, temperature=0,
                                    extra_body={"capsule": name, "ignore_eos": True, "return_token_ids": True})
    return {"tokens": r.choices[0].model_extra["token_ids"], "wall_ms": (time.perf_counter() - t0) * 1e3}


def raw_client(base_url: str):
    import httpx

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    return httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits)


def _body(name: str, turn: list[int], gen: int, stream: bool) -> dict:
    return {"model": MODEL, "prompt": turn, "max_tokens": gen, "temperature": 0, "stream": stream,
            "capsule": name, "ignore_eos": True, "return_token_ids": True}


async def raw_stream(rc, name: str, turn: list[int], gen: int) -> dict:
    import json

    t0 = time.perf_counter()
    tokens = []
    async with rc.stream("POST", "/completions", json=_body(name, turn, gen, True)) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    tokens += c.get("token_ids") or []
    return {"tokens": tokens, "wall_ms": (time.perf_counter() - t0) * 1e3}


async def raw_whole(rc, name: str, turn: list[int], gen: int) -> dict:
    t0 = time.perf_counter()
    r = await rc.post("/completions", json=_body(name, turn, gen, False))
    r.raise_for_status()
    return {"tokens": r.json()["choices"][0]["token_ids"], "wall_ms": (time.perf_counter() - t0) * 1e3}


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


async def concurrent(agent, target, names, turns, gen: int) -> dict:
    """All agents at once: aggregate tokens/s, TTFT and per-agent tokens."""
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(agent(target, nm, tn, gen) for nm, tn in zip(names, turns)))
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


async def main_http(args) -> int:
    import torch

    from capsulert.orchestrator import Orchestrator

    torch.set_num_threads(args.threads)
    chunk, n_max = args.prefill_chunk, max(args.ns)
    max_seq = -(-(args.context + args.turn + args.gen + 1) // chunk) * chunk
    engine_cfg = dict(model=args.model, device=args.device, slots=n_max + 2, max_seq=max_seq, prefill_chunk=chunk)
    contexts, turns = workload(args, n_max)
    names = [f"agent{i}" for i in range(n_max)]

    log("HTTP: capsulert serve + openai client")
    url = start_server(engine_cfg, args.threads, max_inflight=max(256, 2 * n_max))
    api = {"latency_ms": {}, "tokens": {}, "sweep": {}}
    http = {"latency_ms": {}, "tokens": {}, "sweep": {}}
    raw = {"latency_ms": {}, "tokens": {}}
    try:
        cl, rc = client(url), raw_client(url)
        await make_capsules(cl, contexts)
        log(f"async API: its own worker, {n_max} capsules of {args.context} tokens")
        orch = await Orchestrator.start(dict(engine=engine_cfg, num_workers=1, call_timeout_s=3600,
                                             torch_threads=args.threads))
        try:
            for name, ctx in zip(names, contexts):
                s = await orch.open(ctx)
                await s.snapshot(name)
                await s.close()
            for path, (on_api, on_http, on_raw) in {"stream": (api_stream, http_stream, raw_stream),
                                                    "whole": (api_whole, http_whole, raw_whole)}.items():
                got = await alternate({"api": (on_api, orch), "http": (on_http, cl), "raw": (on_raw, rc)}, names,
                                      turns, args.gen, args.requests)
                for side, key in ((api, "api"), (http, "http"), (raw, "raw")):
                    side["latency_ms"][path], side["tokens"][path] = got[key]
            for n in args.ns:
                log(f"  N={n}")
                api["sweep"][n] = await concurrent(api_stream, orch, names[:n], turns[:n], args.gen)
                http["sweep"][n] = await concurrent(http_stream, cl, names[:n], turns[:n], args.gen)
        finally:
            await orch.close()
        await cl.close()
        await rc.aclose()
    finally:
        stop_server()

    for path in ("stream", "whole"):  # the server answers exactly what the async API does
        assert http["tokens"][path] == api["tokens"][path], f"{path}: HTTP tokens differ from the async API's"
        assert raw["tokens"][path] == api["tokens"][path], f"{path}: raw HTTP tokens differ from the async API's"
    for n in args.ns:
        assert http["sweep"][n]["tokens"] == api["sweep"][n]["tokens"], f"N={n}: HTTP tokens differ"

    # the overhead per request: the median of the paired differences (each HTTP request against the API
    # request just before it), and the difference of the two p50s
    def paired_ms(minus: dict, side: dict, p: str) -> float:
        return statistics.median(h - a for a, h in zip(minus["latency_ms"][p], side["latency_ms"][p]))

    paired = {p: paired_ms(api, http, p) for p in ("stream", "whole")}
    latency = [{"request": path, "api_p50_ms": percentile(api["latency_ms"][path], 50),
                "http_p50_ms": percentile(http["latency_ms"][path], 50),
                "overhead_p50_ms": percentile(http["latency_ms"][path], 50) - percentile(api["latency_ms"][path], 50),
                "paired_overhead_p50_ms": paired[path],
                "server_paired_p50_ms": paired_ms(api, raw, path),  # plain httpx client minus the API
                "client_paired_p50_ms": paired_ms(raw, http, path),  # the openai client minus plain httpx
                "api_p99_ms": percentile(api["latency_ms"][path], 99),
                "http_p99_ms": percentile(http["latency_ms"][path], 99)} for path in ("stream", "whole")]
    sweep = [{"n": n, "api_tokens_per_s": api["sweep"][n]["tokens_per_s"],
              "http_tokens_per_s": http["sweep"][n]["tokens_per_s"],
              "api_ttft_p50_ms": percentile(api["sweep"][n]["ttft_ms"], 50),
              "http_ttft_p50_ms": percentile(http["sweep"][n]["ttft_ms"], 50),
              "api_itl_p50_ms": percentile(api["sweep"][n]["itl_ms"], 50) if api["sweep"][n]["itl_ms"] else float("nan"),
              "http_itl_p50_ms": percentile(http["sweep"][n]["itl_ms"], 50) if http["sweep"][n]["itl_ms"] else float("nan")}
             for n in args.ns]
    print(f"one request at a time ({args.requests} per path; restore {args.context}-token capsule, "
          f"{args.turn}-token turn, {args.gen} tokens):")
    print_table(latency, list(latency[0]))
    print("all agents at once (streamed):")
    print_table(sweep, list(sweep[0]))
    write_json(OUT_DIR / "serving_http.json", {"machine": machine_info(args.device), "args": vars(args),
                                               "latency": latency, "sweep": sweep})
    return 0
