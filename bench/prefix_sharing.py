"""Prefix-sharing benchmark: memory of capsules that share a prefix, and automatic prefix reuse on a
multi-turn chat trace (issue 17).

1. Memory. N capsules share an L-token prefix, each with its own T-token tail (an agent fleet on one
   system prompt). Store bytes (the block store: each prefix block once, and each grid-state block, the
   recurrent + conv state at a grid point, once) vs the per-capsule copies (sum of the capsules' whole
   sizes) vs the unique bytes (the shared prefix's KV once, the state at a grid point once per distinct
   prefix up to it, plus everything else of each capsule: its tail KV, its live state past the grid point
   and its last hidden state). Also best-of-8: 8 branches forked from one B-token context (16k; --quick 2k), each 32
   tokens further (all on the grid point B), against one capsule, kept as full capsules and as replay
   capsules (snapshot mode "replay": the state at the grid point and the tokens; restore re-runs the 32
   decode steps), with the time to restore one branch either way.
2. Chat trace. C conversations x K turns on a shared S-token system prompt; every turn resends the
   whole history (system + earlier user messages and answers) plus a U-token user message and generates
   R tokens; conversations take turns round-robin. Three ways to serve it:
   - cold:   prefix cache off, every turn prefills its whole prompt;
   - prefix: prefix cache on (what `capsulert serve` does): the engine restores the longest cached grid
             prefix of the prompt and prefills the rest;
   - named:  the client keeps a named capsule per conversation and restores it, appending the new message
             (the best a client that manages capsules itself can do).
   TTFT = until the next-token logits of the prompt are ready (open + prefill, or restore + append).
   Hit rate: prompt tokens served from the prefix cache over prompt tokens. Memory: store bytes after.

Writes bench/out/prefix_sharing.json, bench/out/prefix_sharing_ttft.png (TTFT per turn) and
bench/out/prefix_sharing_memory.png (store bytes vs N), and prints the tables.

    python bench/prefix_sharing.py --quick          # CPU, default model, ~1-2 min on 2 cores
    python bench/prefix_sharing.py                  # the issue's sizes: 100 x 8k prefix, 16 x 8 turns on 2k
    python bench/prefix_sharing.py --device cuda --model random:capsulert/configs/models/qwen3_5-9b-shape.yaml
    python bench/prefix_sharing.py --quick --http   # the chat trace through `capsulert serve` (openai client)
    python bench/prefix_sharing.py --replay         # full vs replay capsules: largest fleet, best-of-8
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common import OUT_DIR, cuda_sync, log, machine_info, plot_lines, print_table, write_json  # noqa: E402

from capsulert.engine.engine import Engine  # noqa: E402
from capsulert.engine.slot_views import capsule_views  # noqa: E402
from capsulert.protocol.sampling import SamplingParams  # noqa: E402

GREEDY = SamplingParams(ignore_eos=True)
MODES = ("cold", "prefix", "named")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes for a CPU run in ~1-2 min")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default="default", help="'default', a checkpoint dir or random:<shape YAML>")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU (default 1: a shared small box)")
    p.add_argument("--out", default=str(OUT_DIR))
    p.add_argument("--replay", action="store_true",
                   help="only full against replay capsules: the largest agent fleet and best-of-8, with restore "
                        "times (CUDA graphs on CUDA)")
    p.add_argument("--http", action="store_true",
                   help="the chat trace only, through `capsulert serve` with the openai client (prefix_sharing_http.py)")
    return p.parse_args(argv)


def sizes(args) -> dict:
    if args.quick:
        return dict(chunk=128, prefix=2048, tail=64, ns=[1, 4, 16, 32], best_of=2048, system=1024, user=32,
                    answer=16, conversations=8, turns=6)
    return dict(chunk=256, prefix=8192, tail=256, ns=[1, 10, 50, 100], best_of=16384, system=2048, user=64,
                answer=32, conversations=16, turns=8)


def make_engine(args, cfg: dict, max_seq: int, prefix_cache: bool, graphs: bool = False) -> Engine:
    return Engine.from_config(dict(model=args.model, device=args.device, slots=9, max_seq=max_seq,
                                   prefill_chunk=cfg["chunk"], prefix_cache=prefix_cache, prefix_cache_bytes=None,
                                   cuda_graphs=graphs and args.device == "cuda"))


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n,), generator=g).tolist()


# ---------------------------------------------------------------------------------------------- memory
def memory(args, cfg: dict) -> list[dict]:
    rows = [agents(args, cfg, n, "full") for n in cfg["ns"]]
    return rows + best_of_rows(args, cfg)


def agents(args, cfg: dict, n: int, mode: str) -> dict:
    """n capsules on one L-token prefix, each its own T-token tail (fork + append + snapshot of `mode`)."""
    L, T = cfg["prefix"], cfg["tail"]
    eng = make_engine(args, cfg, -(-(L + T + 32) // cfg["chunk"]) * cfg["chunk"], prefix_cache=False,
                      graphs=args.replay)
    vocab = eng.model_cfg.vocab_size
    s = eng.open()
    s.append(tokens(L, 1, vocab))
    s.snapshot("base")
    s.close()
    copies, want = 0, {}
    for i in range(n):
        b = eng.fork("base", 1)[0]
        b.append(tokens(T, 100 + i, vocab))
        b.snapshot(f"agent{i}", mode=mode)
        copies += sum(t.nbytes for t in capsule_views(eng.state, b.slot, L + T, (L + T) // cfg["chunk"] * cfg["chunk"]).values())
        if i < 8:
            want[i] = b.generate(4, GREEDY).tokens  # what the agent does next: a restore must do the same
        b.close()
    eng.store.delete("base")
    stored = eng.store.stats()["gpu"]["bytes"]
    unique = unique_bytes(eng, L)
    unique_kv = prefix_kv_bytes(eng, L + n * T)  # the KV of the unique tokens: the prefix once, every tail
    restore_ms = restore_times(eng, [f"agent{i}" for i in want], want, mode)
    eng.close()
    log(f"memory N={n} ({mode}): store {stored / 2**20:.1f} MB, per-capsule copies {copies / 2**20:.1f} MB, "
        f"unique {unique / 2**20:.1f} MB, unique tokens' KV {unique_kv / 2**20:.1f} MB, restore {restore_ms:.1f} ms")
    return dict(case=f"{n} agents" + (f" ({mode})" if mode != "full" else ""), n=n, mode=mode,
                store_mb=stored / 2**20, copies_mb=copies / 2**20, unique_mb=unique / 2**20,
                store_over_unique=stored / unique, copies_over_store=copies / stored, unique_kv_mb=unique_kv / 2**20,
                store_over_unique_kv=stored / unique_kv, restore_ms=restore_ms)


def restore_times(eng: Engine, names: list[str], want: dict, mode: str) -> float:
    """Median ms to restore each capsule (a replay capsule re-runs its tokens), each checked to continue as
    its session did."""
    times = []
    for i, name in enumerate(names):
        cuda_sync(eng.device)
        t0 = time.perf_counter()
        r = eng.restore(name)
        cuda_sync(eng.device)
        times.append((time.perf_counter() - t0) * 1e3)
        assert r.generate(4, GREEDY).tokens == want[i], f"{name} restored from a {mode} capsule went elsewhere"
        r.close()
    return statistics.median(times)


def best_of_rows(args, cfg: dict) -> list[dict]:
    B = cfg["best_of"]
    eng = make_engine(args, cfg, -(-(B + 32) // cfg["chunk"]) * cfg["chunk"], prefix_cache=False, graphs=args.replay)
    rows = [best_of_8(eng, B, eng.model_cfg.vocab_size, mode) for mode in ("full", "replay")]
    eng.close()
    return rows


def prefix_kv_bytes(eng: Engine, L: int) -> int:
    """Bytes of the attention KV of L tokens: what each capsule beyond the first held again before."""
    kv = eng.state.kv_k
    return 2 * L * kv[:, 0, 0].numel() * kv.element_size()


def grid_state_bytes(eng: Engine) -> int:
    """Bytes of one copy of the recurrent + conv state (what a grid-state block holds)."""
    return eng.state.ssm[:, 0].nbytes + eng.state.conv[:, 0].nbytes


def unique_bytes(eng: Engine, L: int) -> int:
    """The bytes of the store's capsules, each piece of content once: the shared L-token prefix's KV once,
    the state at a grid point once per distinct token prefix up to it (a pure function of those tokens),
    everything else (tail KV, live state past the grid point, last hidden state) per capsule."""
    infos = eng.store.list()
    grids = [i.meta.tokens[:i.meta.grid_pos] for i in infos if i.meta.grid_pos]
    return (sum(i.meta.nbytes for i in infos) - (len(infos) - 1) * prefix_kv_bytes(eng, L)
            - (len(grids) - len(set(grids))) * grid_state_bytes(eng))


def best_of_8(eng: Engine, L: int, vocab: int, mode: str) -> dict:
    """8 branches of one L-token context, 32 sampled tokens each, kept as capsules of `mode`: against one
    capsule; and the time to restore a branch (median of 8; a replay capsule re-runs its 32 decode steps)."""
    s = eng.open()
    s.append(tokens(L, 2, vocab))
    one = s.snapshot("ctx")
    s.close()
    want, curve = {}, [eng.store.stats()["gpu"]["bytes"] / 2**20]
    for i, b in enumerate(eng.fork("ctx", 8)):
        b.generate(32, SamplingParams(temperature=0.8, seed=i, ignore_eos=True))
        b.snapshot(f"branch{i}", mode=mode)
        curve.append(eng.store.stats()["gpu"]["bytes"] / 2**20)
        want[i] = b.generate(4, GREEDY).tokens  # what the branch does next: a restore must do the same
        b.close()
    eng.store.delete("ctx")
    stored = eng.store.stats()["gpu"]["bytes"]
    unique = unique_bytes(eng, L)
    ms = restore_times(eng, [f"branch{i}" for i in range(8)], want, mode)
    for i in range(8):
        eng.store.delete(f"branch{i}")
    log(f"best-of-8 ({mode}): store {stored / 2**20:.1f} MB = {stored / one.nbytes:.2f} x one capsule; "
        f"restore a branch {ms:.1f} ms")
    return dict(case=f"best-of-8 branches ({mode})", n=8, store_mb=stored / 2**20, copies_mb=8 * one.nbytes / 2**20,
                unique_mb=unique / 2**20, store_over_unique=stored / unique, copies_over_store=8 * one.nbytes / stored,
                store_over_one=stored / one.nbytes, restore_ms=ms, store_mb_with_context=curve)


# ------------------------------------------------------------------------------------------------ chat
def chat(args, cfg: dict) -> tuple[list[dict], dict]:
    C, K = cfg["conversations"], cfg["turns"]
    longest = cfg["system"] + K * (cfg["user"] + cfg["answer"])
    max_seq = -(-(longest + cfg["chunk"]) // cfg["chunk"]) * cfg["chunk"]
    per_turn: dict[str, list[list[float]]] = {}
    summary = {}
    answers = {}
    for mode in MODES:
        eng = make_engine(args, cfg, max_seq, prefix_cache=mode == "prefix")
        vocab = eng.model_cfg.vocab_size
        system = tokens(cfg["system"], 3, vocab)
        history = [list(system) for _ in range(C)]
        ttft = [[] for _ in range(K)]
        prompt_tokens = cached_tokens = 0
        outs = []
        warm = eng.open(namespace=None)  # one prefill first: the first measured turn pays no warm-up
        warm.append(tokens(cfg["chunk"] + 7, 9, vocab))
        warm.close()
        for k in range(K):
            for c in range(C):
                user = tokens(cfg["user"], 1000 * c + k, vocab)
                prompt = history[c] + user
                before = eng.store.stats()["prefix"]["hit_tokens"]
                cuda_sync(args.device)
                t0 = time.perf_counter()
                if mode == "named" and k > 0:
                    s = eng.restore(f"conv{c}")
                    s.append(user)
                else:
                    s = eng.open(prompt=prompt, namespace="default" if mode == "prefix" else None)
                s.logits()
                cuda_sync(args.device)
                ttft[k].append((time.perf_counter() - t0) * 1e3)
                prompt_tokens += len(prompt)
                cached_tokens += eng.store.stats()["prefix"]["hit_tokens"] - before
                answer = s.generate(cfg["answer"], GREEDY)
                outs.append(list(answer))
                history[c] = prompt + list(answer)
                if mode == "named":
                    if k > 0:
                        eng.store.delete(f"conv{c}")
                    s.snapshot(f"conv{c}")
                s.close()
        answers[mode] = outs
        per_turn[mode] = ttft
        later = [t for turn in ttft[1:] for t in turn]
        summary[mode] = dict(mode=mode, ttft_turn1_ms=statistics.median(ttft[0]),
                             ttft_later_ms=statistics.median(later), hit_rate=cached_tokens / prompt_tokens,
                             store_mb=eng.store.stats()["gpu"]["bytes"] / 2**20,
                             prefix_entries=eng.store.stats()["prefix"]["entries"])
        log(f"chat {mode:6s}: TTFT turn 1 {summary[mode]['ttft_turn1_ms']:.1f} ms, later turns "
            f"{summary[mode]['ttft_later_ms']:.1f} ms, hit rate {summary[mode]['hit_rate']:.2f}, "
            f"store {summary[mode]['store_mb']:.1f} MB")
        eng.close()
    assert answers["prefix"] == answers["cold"] == answers["named"], "the modes must answer identically"
    rows = [summary[m] for m in MODES]
    named = summary["named"]["ttft_later_ms"]
    for r in rows:
        r["later_over_named"] = r["ttft_later_ms"] / named
    medians = {m: [statistics.median(t) for t in per_turn[m]] for m in MODES}
    return rows, medians


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    cfg = sizes(args)
    t_start = time.perf_counter()
    log(f"device={args.device} model={args.model} sizes={cfg}")
    if args.http:
        return main_http(args, cfg, t_start)
    if args.replay:
        return main_replay(args, cfg, t_start)
    mem = memory(args, cfg)
    print_table(mem, [("case", "case"), ("store_mb", "store MB"), ("copies_mb", "per-capsule copies MB"),
                      ("unique_mb", "unique MB"), ("store_over_unique", "store / unique"),
                      ("copies_over_store", "copies / store")])
    rows, medians = chat(args, cfg)
    print_table(rows, [("mode", "mode"), ("ttft_turn1_ms", "TTFT turn 1 ms"), ("ttft_later_ms", "TTFT turns 2+ ms"),
                       ("later_over_named", "turns 2+ / named"), ("hit_rate", "hit rate"), ("store_mb", "store MB"),
                       ("prefix_entries", "prefix entries")])
    out = Path(args.out)
    turns = list(range(1, cfg["turns"] + 1))
    plot_lines(out / "prefix_sharing_ttft.png", turns, {m: medians[m] for m in MODES}, xlabel="turn",
               ylabel="TTFT median (ms)", title=f"{cfg['conversations']} conversations, system prompt "
                                                f"{cfg['system']} tokens, history resent each turn")
    agents = [r for r in mem if r["case"].endswith("agents")]
    plot_lines(out / "prefix_sharing_memory.png", [r["n"] for r in agents],
               {"block store": [r["store_mb"] for r in agents], "per-capsule copies": [r["copies_mb"] for r in agents],
                "unique bytes": [r["unique_mb"] for r in agents]}, xlabel="capsules sharing the prefix",
               ylabel="MB", logx=True, title=f"{cfg['prefix']}-token shared prefix, {cfg['tail']}-token tails")
    write_json(out / "prefix_sharing.json", {"machine": machine_info(args.device), "params": {**vars(args), **cfg},
                                             "memory": mem, "chat": rows, "ttft_per_turn_ms": medians,
                                             "wall_s": round(time.perf_counter() - t_start, 1)})
    log(f"wrote {out / 'prefix_sharing.json'} and two PNGs in {time.perf_counter() - t_start:.0f} s")
    return 0


def main_replay(args, cfg: dict, t_start: float) -> int:
    n = max(cfg["ns"])
    fleet = [agents(args, cfg, n, mode) for mode in ("full", "replay")]
    best = best_of_rows(args, cfg)
    print_table(fleet, [("case", "case"), ("store_mb", "store MB"), ("copies_mb", "per-capsule copies MB"),
                        ("unique_kv_mb", "unique tokens' KV MB"), ("store_over_unique_kv", "store / unique KV"),
                        ("restore_ms", "restore an agent ms")])
    print_table(best, [("case", "case"), ("store_mb", "store MB"), ("copies_mb", "per-capsule copies MB"),
                       ("store_over_one", "store / one capsule"), ("restore_ms", "restore a branch ms")])
    out = Path(args.out)
    copies = [best[0]["copies_mb"] / 8 * (k + 1) for k in range(9)]
    plot_lines(out / "prefix_sharing_replay.png", list(range(9)),
               {"full capsules": best[0]["store_mb_with_context"], "replay capsules": best[1]["store_mb_with_context"],
                "per-capsule copies": copies}, xlabel="branches kept", ylabel="store MB (context + branches)",
               title=f"best-of-8 of a {cfg['best_of']}-token context, 32 tokens per branch")
    write_json(out / "prefix_sharing_replay.json", {"machine": machine_info(args.device),
                                                    "params": {**vars(args), **cfg}, "agents": fleet, "best_of": best,
                                                    "wall_s": round(time.perf_counter() - t_start, 1)})
    log(f"wrote {out / 'prefix_sharing_replay.json'} and .png in {time.perf_counter() - t_start:.0f} s")
    return 0


def main_http(args, cfg: dict, t_start: float) -> int:
    from prefix_sharing_http import MODES as HTTP_MODES
    from prefix_sharing_http import chat_http

    vocab = make_engine(args, cfg, cfg["chunk"], False).model_cfg.vocab_size
    rows, medians = chat_http(args, cfg, vocab, tokens)
    print_table(rows, [("mode", "mode"), ("ttft_turn1_ms", "TTFT turn 1 ms"), ("ttft_later_ms", "TTFT turns 2+ ms"),
                       ("later_over_named", "turns 2+ / named"), ("hit_rate", "hit rate")])
    out = Path(args.out)
    plot_lines(out / "prefix_sharing_http_ttft.png", list(range(1, cfg["turns"] + 1)),
               {m: medians[m] for m in HTTP_MODES}, xlabel="turn", ylabel="TTFT median (ms), HTTP",
               title=f"{cfg['conversations']} conversations through capsulert serve, history resent each turn")
    write_json(out / "prefix_sharing_http.json", {"machine": machine_info(args.device), "params": {**vars(args), **cfg},
                                                  "chat": rows, "ttft_per_turn_ms": medians,
                                                  "wall_s": round(time.perf_counter() - t_start, 1)})
    log(f"wrote {out / 'prefix_sharing_http.json'} in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
