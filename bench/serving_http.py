"""The HTTP side of `bench/serving.py --http`: the agent workload through `capsulert serve` with the
official openai client (async), and the same requests through the async API for comparison.

Each request mirrors what the server does for it (capsulert/serve/generation.py), the same calls to the
worker, so the difference is the HTTP path (client, HTTP server, FastAPI, JSON / SSE; plus Ray Serve's
proxy with ServerOptions.direct_ingress=False) and nothing else:
- streamed: restore the agent's capsule, then append its turn + stream the tokens as one streamed turn,
  close (`completions.create(stream=True, capsule=...)`);
- whole: restore, then append + generate as one turn, close (`completions.create(capsule=...)`).
"""
from __future__ import annotations

import asyncio
import socket
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


async def api_stream(orch, name: str, turn: list[int], gen: int) -> dict:
    t0 = time.perf_counter()
    s = await orch.restore(name)
    stamps, tokens = [], []
    async for ev in s.stream_turn(turn, gen, PARAMS):
        if isinstance(ev, FinalEvent):
            continue
        stamps.append(time.perf_counter())
        tokens.append(ev.token)
    await s.close()
    end = time.perf_counter()
    itl = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
    return {"ttft_ms": (stamps[0] - t0) * 1e3, "itl_ms": itl, "tokens": tokens, "wall_ms": (end - t0) * 1e3}


async def api_whole(orch, name: str, turn: list[int], gen: int) -> dict:
    t0 = time.perf_counter()
    s = await orch.restore(name)
    res = await s.turn(turn, gen, PARAMS)
    await s.close()
    return {"tokens": list(res), "wall_ms": (time.perf_counter() - t0) * 1e3}


async def concurrent(agent, target, names, turns, gen: int) -> dict:
    """All agents at once: aggregate tokens/s, TTFT and per-agent tokens."""
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(agent(target, nm, tn, gen) for nm, tn in zip(names, turns)))
    wall = time.perf_counter() - t0
    return {"tokens_per_s": len(names) * gen / wall, "ttft_ms": [o["ttft_ms"] for o in outs],
            "itl_ms": [x for o in outs for x in o["itl_ms"]], "tokens": [o["tokens"] for o in outs]}


async def one_at_a_time(agent, target, names, turns, gen: int, requests: int) -> tuple[list[float], list[list[int]]]:
    """`requests` requests one after another (round robin over the agents): wall times (ms) and tokens."""
    walls, tokens = [], []
    for i in range(requests):
        k = i % len(names)
        out = await agent(target, names[k], turns[k], gen)
        walls.append(out["wall_ms"])
        tokens.append(out["tokens"])
    return walls, tokens


# ------------------------------------------------------------------------------------------------ main
def workload(args, n: int) -> tuple[list[list[int]], list[list[int]]]:
    """n contexts and n turns of random token ids (the same as bench/serving.py's)."""
    import torch

    g = torch.Generator().manual_seed(0)
    contexts = [torch.randint(10, 4000, (args.context,), generator=g).tolist() for _ in range(n)]
    turns = [torch.randint(10, 4000, (args.turn,), generator=g).tolist() for _ in range(n)]
    return contexts, turns


async def measure(agents: dict, target, names, turns, args) -> dict:
    """One warm-up request per path, then the one-at-a-time latencies and the concurrent sweep."""
    out = {"latency_ms": {}, "tokens": {}, "sweep": {}}
    for path, agent in agents.items():
        await agent(target, names[0], turns[0], args.gen)
        out["latency_ms"][path], out["tokens"][path] = await one_at_a_time(agent, target, names, turns, args.gen,
                                                                            args.requests)
    for n in args.ns:
        log(f"  N={n}")
        out["sweep"][n] = await concurrent(agents["stream"], target, names[:n], turns[:n], args.gen)
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

    log(f"async API: {n_max} capsules of {args.context} tokens")
    orch = await Orchestrator.start(dict(engine=engine_cfg, num_workers=1, call_timeout_s=3600,
                                         torch_threads=args.threads))
    try:
        for name, ctx in zip(names, contexts):
            s = await orch.open(ctx)
            await s.snapshot(name)
            await s.close()
        api = await measure({"stream": api_stream, "whole": api_whole}, orch, names, turns, args)
    finally:
        await orch.close()

    log("HTTP: capsulert serve + openai client")
    url = start_server(engine_cfg, args.threads, max_inflight=max(256, 2 * n_max))
    try:
        cl = client(url)
        await make_capsules(cl, contexts)
        http = await measure({"stream": http_stream, "whole": http_whole}, cl, names, turns, args)
        await cl.close()
    finally:
        stop_server()

    for path in ("stream", "whole"):  # the server answers exactly what the async API does
        assert http["tokens"][path] == api["tokens"][path], f"{path}: HTTP tokens differ from the async API's"
    for n in args.ns:
        assert http["sweep"][n]["tokens"] == api["sweep"][n]["tokens"], f"N={n}: HTTP tokens differ"

    latency = [{"request": path, "api_p50_ms": percentile(api["latency_ms"][path], 50),
                "http_p50_ms": percentile(http["latency_ms"][path], 50),
                "overhead_p50_ms": percentile(http["latency_ms"][path], 50) - percentile(api["latency_ms"][path], 50),
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
