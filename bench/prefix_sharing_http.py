"""The chat trace of bench/prefix_sharing.py through `capsulert serve` (`--http`): the same conversations, each
turn a streamed `/v1/completions` request from the official openai client whose prompt is the token ids of
the whole history (system prompt, earlier user messages and the answers exactly as the server returned
them, `return_token_ids`) plus the new user message. Three servers, one per mode:
- cold:   prefix cache off, every request prefills its whole prompt;
- prefix: `capsulert serve` as shipped (prefix cache on): the longest cached grid prefix is restored;
- named:  the client keeps a capsule per conversation through the capsule extensions (turn k sends only the
          new message with `capsule` = the end state of turn k - 1 and `snapshot_as` = turn k's).
TTFT = request sent -> first streamed token. Hit rate = `usage.prompt_tokens_details.cached_tokens` /
`usage.prompt_tokens` over the turns. Every mode must answer every turn with the same tokens (asserted).
"""
from __future__ import annotations

import asyncio
import statistics
import time

from common import log
from serving_http import free_port

MODES = ("cold", "prefix", "named")
MODEL = "bench"


def start_server(engine_cfg: dict, threads: int, max_inflight: int) -> str:
    """`capsulert serve` in this process (local Ray + Ray Serve); its base URL."""
    from capsulert.config.server import ServerOptions
    from capsulert.serve.runner import setup_logging, start

    port = free_port()
    opts = ServerOptions.build(
        orchestrator=dict(engine=engine_cfg, torch_threads=threads, call_timeout_s=3600, max_queued=max_inflight),
        served_model_name=MODEL, port=port, log_level="WARNING")
    setup_logging("WARNING")
    start(opts)
    return f"http://127.0.0.1:{port}/v1"


def stop_server() -> None:
    from capsulert.serve.runner import stop

    stop()


def client(base_url: str):
    import openai

    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=3600)


async def _turn(cl, prompt: list[int], answer: int, body: dict) -> tuple[float, list[int], object]:
    """One streamed request: (TTFT ms, the answer's token ids, the usage)."""
    t0 = time.perf_counter()
    first, got, usage = None, [], None
    stream = await cl.completions.create(model=MODEL, prompt=prompt, max_tokens=answer, temperature=0.0,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True, "return_token_ids": True, **body})
    async for chunk in stream:
        for choice in chunk.choices:
            ids = (choice.model_extra or {}).get("token_ids") or []
            if ids and first is None:
                first = time.perf_counter()
            got += ids
        if chunk.usage is not None:
            usage = chunk.usage
    assert first is not None and len(got) == answer and usage is not None
    return (first - t0) * 1e3, got, usage


async def _mode(mode: str, args, cfg: dict, max_seq: int, vocab: int, tokens) -> tuple[dict, list, list]:
    C, K = cfg["conversations"], cfg["turns"]
    engine = dict(model=args.model, device=args.device, slots=C + 4, max_seq=max_seq, prefill_chunk=cfg["chunk"],
                  prefix_cache=mode == "prefix")
    url = start_server(engine, args.threads or 1, max_inflight=64)
    cl = client(url)
    try:
        await _turn(cl, tokens(cfg["chunk"] + 7, 9, vocab), 2, {})  # warm-up: the first measured turn pays none
        system = tokens(cfg["system"], 3, vocab)
        history = [list(system) for _ in range(C)]
        ttft, answers = [[] for _ in range(K)], []
        prompt_tokens = cached = 0
        for k in range(K):
            for c in range(C):
                user = tokens(cfg["user"], 1000 * c + k, vocab)
                body, prompt = {}, history[c] + user
                if mode == "named":
                    body["snapshot_as"] = f"conv{c}-t{k}"
                    if k:
                        body["capsule"], prompt = f"conv{c}-t{k - 1}", user
                ms, got, usage = await _turn(cl, prompt, cfg["answer"], body)
                ttft[k].append(ms)
                prompt_tokens += usage.prompt_tokens
                cached += usage.prompt_tokens_details.cached_tokens
                history[c] = history[c] + user + got
                answers.append(got)
    finally:
        await cl.close()
        stop_server()
    later = [t for turn in ttft[1:] for t in turn]
    row = dict(mode=mode, ttft_turn1_ms=statistics.median(ttft[0]), ttft_later_ms=statistics.median(later),
               hit_rate=cached / prompt_tokens)
    log(f"chat over HTTP, {mode:6s}: TTFT turn 1 {row['ttft_turn1_ms']:.1f} ms, later turns "
        f"{row['ttft_later_ms']:.1f} ms, hit rate {row['hit_rate']:.2f}")
    return row, [statistics.median(t) for t in ttft], answers


def chat_http(args, cfg: dict, vocab: int, tokens) -> tuple[list[dict], dict]:
    """Rows per mode (TTFT turn 1, turns 2+, their ratio to named, hit rate) and the median TTFT per turn."""
    longest = cfg["system"] + cfg["turns"] * (cfg["user"] + cfg["answer"])
    max_seq = -(-(longest + cfg["chunk"]) // cfg["chunk"]) * cfg["chunk"]
    rows, medians, answers = [], {}, {}
    for mode in MODES:
        row, medians[mode], answers[mode] = asyncio.run(_mode(mode, args, cfg, max_seq, vocab, tokens))
        rows.append(row)
    assert answers["prefix"] == answers["cold"] == answers["named"], "the modes must answer identically"
    named = rows[MODES.index("named")]["ttft_later_ms"]
    for r in rows:
        r["later_over_named"] = r["ttft_later_ms"] / named
    return rows, medians
