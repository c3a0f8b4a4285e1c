"""Speculative decode: per-token latency against plain decode at batch 1 and 8, for forced acceptance (the
oracle drafter proposing the plain run's own tokens: 100%, and every j-th drafted position corrupted for lower
rates), k = 1..3, and the n-gram and MTP drafters' acceptance and latency. Every speculating run is checked to give
bitwise the plain run's tokens and logprobs. Peer column: HF transformers' `generate` on the same weights,
plain and with its prompt lookup (`prompt_lookup_num_tokens=k`), at batch 1.

(transformers 5 refuses assisted generation, prompt lookup included, for stateful models such as Qwen3.5:
the bench then reports HF's plain decode only, and says so.)

The n-gram and MTP acceptance here is on the model the bench runs: on random weights (the default model, the
9B shape) it says how often prompt lookup or a random MTP head guesses a random model's continuation, and
predicts nothing about a trained model or a trained head. Prints a table, writes bench/out/speculate.json and
bench/out/speculate.png.

    .venv/bin/python bench/speculate.py --device cpu --quick          # CPU, default model
    python bench/speculate.py                                         # CUDA, the Qwen3.5-9B shape
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from common import OUT_DIR, cuda_sync, hf_causal_lm, log, machine_info, plot_lines, print_table, write_json  # noqa: E402

from capsulert.engine.default_model import CORPUS_PATH, REPO_ROOT  # noqa: E402
from capsulert.engine.drafters import OracleDrafter  # noqa: E402
from capsulert.engine.engine import Engine  # noqa: E402
from capsulert.protocol.sampling import MAX_SPECULATE, SamplingParams  # noqa: E402

SHAPE = REPO_ROOT / "capsulert" / "configs" / "models" / "qwen3_5-9b-shape.yaml"
COLUMNS = [("drafter", "drafter"), ("corrupt_every", "corrupt j"), ("k", "k"), ("batch", "b"),
           ("ms_per_token", "ms/token"), ("vs_plain", "x plain"), ("acceptance", "accepted"),
           ("tokens_per_step", "tokens/step"), ("peer_ms_per_token", "HF ms/token")]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default=None, help="default: the default model on CPU, the 9B shape on CUDA")
    p.add_argument("--context", type=int, default=2048, help="prompt tokens")
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per session")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--ks", type=int, nargs="+", default=list(range(1, MAX_SPECULATE + 1)))
    p.add_argument("--corrupt-every", type=int, nargs="+", default=[0, 4, 2],
                   help="oracle drafts corrupted at every j-th position (0: none, 100%% acceptance)")
    p.add_argument("--skip-hf", action="store_true", help="no peer column")
    p.add_argument("--per-position-verify", action="store_true",
                   help="verify one decode step per fed position (the reference path) instead of one forward")
    p.add_argument("--quick", action="store_true", help="a short context and generation (CPU smoke run)")
    p.add_argument("--out", default=str(OUT_DIR / "speculate.json"))
    args = p.parse_args()
    if args.quick:
        args.context, args.tokens = 128, 16
    return args


def prompts(engine: Engine, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` tokens: the corpus with a tokenizer, seeded random ids without one."""
    if engine.tokenizer is not None:
        ids = engine.tokenize(CORPUS_PATH.read_text())
        return [(ids * (1 + (length * (i + 1)) // len(ids)))[i * 37:i * 37 + length] for i in range(n)]
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, engine.model_cfg.vocab_size, (length,), generator=g).tolist() for _ in range(n)]


def generate(engine: Engine, ps: list[list[int]], n: int, sampling: SamplingParams):
    """Open, prefill, then time the generate alone; the results and ms per generated token of a session."""
    sessions = []
    for p in ps:
        s = engine.open()
        s.append(p)
        sessions.append(s)
    cuda_sync(engine.device)
    t0 = time.perf_counter()
    res = engine.generate(sessions, n, [sampling] * len(sessions))
    cuda_sync(engine.device)
    ms = (time.perf_counter() - t0) * 1e3 / n
    for s in sessions:
        s.close()
    return res, ms


def same(a, b) -> bool:
    return all(list(x) == list(y) and x.logprobs == y.logprobs for x, y in zip(a, b))


def bench_peer(engine: Engine, prompt: list[int], n: int, ks: list[int]) -> tuple[dict[int, float], str]:
    """HF generate ms per token at batch 1: plain (key 0) and with prompt lookup of k tokens where HF runs it;
    and why it does not where it refuses."""
    hf = hf_causal_lm(engine)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    ids = torch.tensor([prompt], device=engine.device)
    out, why = {}, ""
    for k in [0, *ks]:
        kw = dict(max_new_tokens=n, do_sample=False, min_new_tokens=n)
        if k:
            kw["prompt_lookup_num_tokens"] = k
        try:
            with torch.inference_mode():
                hf.generate(ids, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
                cuda_sync(engine.device)
                t0 = time.perf_counter()
                hf.generate(ids, **kw)
                cuda_sync(engine.device)
        except ValueError as e:  # transformers 5 refuses assisted generation for hybrid (stateful) models
            why = f"HF prompt lookup: {e}"
            log(why)
            continue
        out[k] = (time.perf_counter() - t0) * 1e3 / n
    return out, why


def main() -> None:
    args = parse_args()
    model = args.model or ("default" if args.device == "cpu" else f"random:{SHAPE}")
    top = max(args.batches)
    chunk = 256 if args.device == "cpu" else 1024
    max_seq = -(-(args.context + args.tokens + 64) // chunk) * chunk  # a whole number of prefill chunks
    engine = Engine.from_config(model=model, device=args.device, slots=top, speculate_slots=top, max_seq=max_seq,
                                prefill_chunk=chunk)
    engine.runner.verify_in_one_forward = not args.per_position_verify
    log(f"engine: {model} on {engine.device}, {engine.dtype}, verify "
        + ("per position" if args.per_position_verify else "in one forward"))
    greedy = SamplingParams(ignore_eos=True)
    drafters = ["ngram", "mtp"] if engine.runner.has_mtp else ["ngram"]
    rows = []
    peer: dict[int, float] = {}
    peer_note = "HF peer not run (--skip-hf)"
    if not args.skip_hf:
        peer, peer_note = bench_peer(engine, prompts(engine, 1, args.context)[0], args.tokens, args.ks)
    for b in args.batches:
        ps = prompts(engine, b, args.context)
        generate(engine, ps, 2, greedy)  # warm-up
        plain, plain_ms = generate(engine, ps, args.tokens, greedy)
        rows.append(dict(drafter="plain", corrupt_every="", k=0, batch=b, ms_per_token=plain_ms, vs_plain=1.0,
                         acceptance="", tokens_per_step=1.0, peer_ms_per_token=peer.get(0) if b == 1 else None))
        log(f"b={b} plain: {plain_ms:.2f} ms/token")
        for j in args.corrupt_every:
            engine.drafters.install(OracleDrafter([p + list(r) for p, r in zip(ps, plain)], corrupt_every=j))
            for k in args.ks:
                res, ms = generate(engine, ps, args.tokens,
                                   SamplingParams(ignore_eos=True, speculate=k, speculate_drafter="oracle"))
                assert same(res, plain), "speculative output differs from plain decode"
                rows.append(_row("oracle", j, k, b, ms, plain_ms, res, args.tokens))
                log(f"b={b} oracle j={j} k={k}: {ms:.2f} ms/token, acceptance {rows[-1]['acceptance']:.2f}")
        for drafter in drafters:
            for k in args.ks:
                res, ms = generate(engine, ps, args.tokens,
                                   SamplingParams(ignore_eos=True, speculate=k, speculate_drafter=drafter))
                assert same(res, plain), "speculative output differs from plain decode"
                row = _row(drafter, "", k, b, ms, plain_ms, res, args.tokens)
                if drafter == "ngram":
                    row["peer_ms_per_token"] = peer.get(k) if b == 1 else None
                rows.append(row)
                log(f"b={b} {drafter} k={k}: {ms:.2f} ms/token, acceptance {row['acceptance']:.2f}")
    print_table(rows, COLUMNS)
    note = ("ngram and mtp acceptance are measured on random weights: they predict nothing about a trained model "
            "or a trained MTP head. Peer: HF transformers generate, plain (k = 0) and prompt_lookup_num_tokens = k, batch 1. "
            + peer_note)
    print(note)
    write_json(args.out, dict(machine=machine_info(args.device), model=model, context=args.context,
                              tokens=args.tokens, note=note, rows=rows))
    series = {}
    for b in args.batches:
        for j in args.corrupt_every:
            series[f"oracle b={b} j={j or 'none'}"] = [next(r["vs_plain"] for r in rows if r["drafter"] == "oracle"
                                                           and r["batch"] == b and r["corrupt_every"] == j
                                                           and r["k"] == k) for k in args.ks]
        for drafter in drafters:
            series[f"{drafter} b={b}"] = [next(r["vs_plain"] for r in rows if r["drafter"] == drafter
                                               and r["batch"] == b and r["k"] == k) for k in args.ks]
    plot_lines(Path(args.out).with_suffix(".png"), args.ks, series, "k (drafts per step)",
               "time per token / plain decode's", title=f"speculative decode, {model} on {args.device}")


def _row(drafter, j, k, b, ms, plain_ms, res, tokens) -> dict:
    drafted = sum(r.drafted for r in res)
    accepted = sum(r.accepted for r in res)
    steps = sum(len(r) for r in res) - accepted  # every step commits one sampled token and its accepted drafts
    return dict(drafter=drafter, corrupt_every=j, k=k, batch=b, ms_per_token=ms, vs_plain=ms / plain_ms,
                acceptance=accepted / drafted if drafted else 0.0, tokens_per_step=tokens * len(res) / steps,
                peer_ms_per_token=None)


if __name__ == "__main__":
    main()
