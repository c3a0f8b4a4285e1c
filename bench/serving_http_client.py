"""The HTTP clients of `bench/serving.py --http`, in a process of their own (as clients are), driven by
serving_http.py over stdin / stdout, one JSON command per line and one JSON answer per line:

    {"op": "capsules", "contexts": [[ids...], ...]}            capsule agent{i} = context i (snapshot_as)
    {"op": "one", "path": "http"|"raw"|"lean", "kind": "stream"|"whole", "name", "turn", "gen"}
                                                               one request, timed (`t0`, `t1`: its start and
                                                               end on the machine's monotonic clock)
    {"op": "sweep", "names", "turns", "gen"}                   every agent at once (streamed, openai client)

The clients (paths), each on kept-alive connections, each sending the same request and reading the same
answer (JSON decoded, its token ids taken):
- http: the official openai client (async), what users run;
- raw: httpx (what the openai client is built on), JSON in, JSON or SSE lines out;
- lean: a minimal HTTP/1.1 client on one asyncio connection (the request in one write, the response read as
  the server frames it): what a client costs at least, so HTTP minus lean is what the server and the
  loopback cost.

Started as `python -c "from serving_http_client import main; main()" BASE_URL MODEL` in bench/.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from urllib.parse import urlsplit


def _timed(t0: float, t1: float) -> dict:
    """A request's wall time, and its start and end on the monotonic clock (the server's stamps use it too)."""
    return {"wall_ms": (t1 - t0) * 1e3, "t0": t0, "t1": t1}


def clients(base_url: str):
    import httpx
    import openai

    # one connection per concurrent agent, kept alive: the benchmark measures requests, not TCP handshakes
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    return (openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=3600,
                               http_client=openai.DefaultAsyncHttpxClient(limits=limits)),
            httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits))


class LeanHTTP:
    """HTTP/1.1 on one kept-alive connection to base_url's host: POST a JSON body in one write, read the
    response as the server frames it (Content-Length, or chunked for a stream)."""

    def __init__(self, base_url: str):
        url = urlsplit(base_url)
        self.host, self.port, self.prefix = url.hostname, url.port, url.path.rstrip("/")
        self.reader = self.writer = None

    async def post(self, path: str, payload: dict) -> tuple[int, bytes]:
        """(status, whole body) of a non-streamed request."""
        await self._send(path, payload)
        status, length = await self._head()
        return status, await self.reader.readexactly(length)

    async def post_stream(self, path: str, payload: dict):
        """The body's chunks of a streamed (chunked) response, as they arrive."""
        await self._send(path, payload)
        status, _ = await self._head()
        if status != 200:
            raise RuntimeError(f"HTTP {status}")
        while True:
            size = int(await self.reader.readuntil(b"\r\n"), 16)
            chunk = await self.reader.readexactly(size + 2)
            if size == 0:
                return
            yield chunk[:-2]

    async def _send(self, path: str, payload: dict) -> None:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 26)
        body = json.dumps(payload).encode()
        self.writer.write(f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        await self.writer.drain()

    async def _head(self) -> tuple[int, int]:
        """The status and Content-Length (-1: chunked) of the response."""
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = -1
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        return int(lines[0].split()[1]), length

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Agents:
    def __init__(self, base_url: str, model: str):
        self.cl, self.rc = clients(base_url)
        self.lean = LeanHTTP(base_url)
        self.model = model

    def _extra(self, name: str) -> dict:
        return {"capsule": name, "ignore_eos": True, "return_token_ids": True}

    async def capsules(self, contexts: list[list[int]]) -> dict:
        for i, ctx in enumerate(contexts):  # max_tokens = 0: prefill and snapshot
            await self.cl.completions.create(model=self.model, prompt=ctx, max_tokens=0,
                                             extra_body={"snapshot_as": f"agent{i}"})
        return {"made": len(contexts)}

    async def http_stream(self, name: str, turn: list[int], gen: int) -> dict:
        t0 = time.perf_counter()
        stream = await self.cl.completions.create(model=self.model, prompt=turn, max_tokens=gen, temperature=0,
                                                  stream=True, extra_body=self._extra(name))
        stamps, tokens = [], []
        async for chunk in stream:
            for c in chunk.choices:
                ids = c.model_extra.get("token_ids") or []
                stamps += [time.perf_counter()] * len(ids)
                tokens += ids
        end = time.perf_counter()
        itl = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:]) if b > a]
        return {"ttft_ms": (stamps[0] - t0) * 1e3, "itl_ms": itl, "tokens": tokens, **_timed(t0, end)}

    async def http_whole(self, name: str, turn: list[int], gen: int) -> dict:
        t0 = time.perf_counter()
        r = await self.cl.completions.create(model=self.model, prompt=turn, max_tokens=gen, temperature=0,
                                             extra_body=self._extra(name))
        return {"tokens": r.choices[0].model_extra["token_ids"], **_timed(t0, time.perf_counter())}

    def _body(self, name: str, turn: list[int], gen: int, stream: bool) -> dict:
        return {"model": self.model, "prompt": turn, "max_tokens": gen, "temperature": 0, "stream": stream,
                **self._extra(name)}

    async def raw_stream(self, name: str, turn: list[int], gen: int) -> dict:
        t0 = time.perf_counter()
        tokens = []
        async with self.rc.stream("POST", "/completions", json=self._body(name, turn, gen, True)) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        tokens += c.get("token_ids") or []
        return {"tokens": tokens, **_timed(t0, time.perf_counter())}

    async def raw_whole(self, name: str, turn: list[int], gen: int) -> dict:
        t0 = time.perf_counter()
        r = await self.rc.post("/completions", json=self._body(name, turn, gen, False))
        r.raise_for_status()
        return {"tokens": r.json()["choices"][0]["token_ids"], **_timed(t0, time.perf_counter())}

    async def lean_stream(self, name: str, turn: list[int], gen: int) -> dict:
        t0 = time.perf_counter()
        tokens, rest = [], b""
        async for chunk in self.lean.post_stream("/completions", self._body(name, turn, gen, True)):
            *events, rest = (rest + chunk).split(b"\n\n")
            for event in events:
                if event.startswith(b"data: {"):
                    for c in json.loads(event[6:])["choices"]:
                        tokens += c.get("token_ids") or []
        return {"tokens": tokens, **_timed(t0, time.perf_counter())}

    async def lean_whole(self, name: str, turn: list[int], gen: int) -> dict:
        t0 = time.perf_counter()
        status, body = await self.lean.post("/completions", self._body(name, turn, gen, False))
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {body[:200]!r}")
        return {"tokens": json.loads(body)["choices"][0]["token_ids"], **_timed(t0, time.perf_counter())}

    async def one(self, path: str, kind: str, name: str, turn: list[int], gen: int) -> dict:
        return await getattr(self, f"{path}_{kind}")(name, turn, gen)

    async def sweep(self, names: list[str], turns: list[list[int]], gen: int) -> dict:
        """All agents at once (streamed): aggregate tokens/s, TTFT and per-agent tokens."""
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(self.http_stream(nm, tn, gen) for nm, tn in zip(names, turns)))
        wall = time.perf_counter() - t0
        return {"tokens_per_s": len(names) * gen / wall, "ttft_ms": [o["ttft_ms"] for o in outs],
                "itl_ms": [x for o in outs for x in o["itl_ms"]], "tokens": [o["tokens"] for o in outs]}


async def serve_commands(base_url: str, model: str) -> None:
    agents = Agents(base_url, model)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        command = json.loads(line)
        try:
            answer = await getattr(agents, command.pop("op"))(**command)
        except Exception as e:  # the driver raises it, naming it
            answer = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    await agents.cl.close()
    await agents.rc.aclose()
    await agents.lean.close()


def main() -> None:
    asyncio.run(serve_commands(sys.argv[1], sys.argv[2]))
