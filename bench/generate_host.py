"""Host overhead per generated token: Engine.generate's time outside the model, ours and HF transformers'.

On a GPU the host work between a step's result reaching the host and the next step's launch (sampling,
logprobs, token-to-text, stop checks, bookkeeping, the next step's inputs) leaves the GPU idle. This
benchmark measures that work on the CPU, where it is the same Python and the same torch dispatch: every
call of the model's forward and logits (HybridModel.forward / .logits) is timed, and

    host ms per step = (generate wall time - time inside the model) / steps

for `--tokens` new tokens per session at each batch (one step = one token for every session of the batch),
in four modes: greedy, sampling (temperature 0.8, top_p 0.95, a seed per session), greedy with stop
strings (two that never match, so every run makes all its tokens and checks them at every token) and
greedy with logprobs=5. Every mode sets ignore_eos: runs of the same length.

The split by phase (sampling, logprobs, text, stops, inputs, other) comes from a second run of the same
generate under cProfile: each function's own time goes to the phase of its module and function (builtins
and torch's Python wrappers to the phase of their callers), and the shares are scaled to the host time
measured without the profiler. The profiler inflates Python-heavy phases more than the torch ops, so the
split is a guide and the measured total is the number. "inputs" is the tensor building for the next step
(stacking the logits block, the decode step's token and slot tensors, the grid bookkeeping); "other" is the
loop's own bookkeeping (results, events, stop checks of the engine: max_seq, interrupts).

The peer: HF transformers' `generate` on the same model (bench/common.py's hf_causal_lm: Qwen3_5ForCausalLM
on the engine's own weight tensors), the same prompts, batch and number of tokens, greedy (do_sample=False)
or sampling (temperature 0.8, top_p 0.95, top_k 0), stop strings through its `stop_strings` (a
PreTrainedTokenizerFast over the model's tokenizer.json) and logprobs through output_scores (the raw
logits of every step kept, then log_softmax; HF's loop keeps them, the log_softmax runs after the loop and
is counted too); its forward (which includes the LM head) is timed the same way and subtracted. HF's loop
does not detokenize (ours does, for the result's text and the events), and its forward batches the rows
where ours runs each row alone on the CPU (batch invariance): the forward is subtracted on both sides.

    python bench/generate_host.py                          # b = 1, 8, 64; ours and HF
    python bench/generate_host.py --skip-hf --tag after    # ours only; bench/out/generate_host_after.json
    python bench/generate_host.py --batches 1 --modes greedy,sample --repeats 5

Writes bench/out/generate_host[_<tag>].json and .png (host ms per step against the batch).
"""
from __future__ import annotations

import argparse
import cProfile
import inspect
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common import OUT_DIR, hf_causal_lm, log, machine_info, median, plot_lines, print_table, write_json  # noqa: E402

MODES = ("greedy", "sample", "stops", "logprobs")
PHASES = ("sampling", "logprobs", "text", "stops", "inputs", "other")
NEVER = ("<|never one|>", "never two!")  # stop strings that never match: every token is checked
PROMPT_TOKENS = 72  # off the 64-token grid: a generate of 128 crosses two grid points per session
COLUMNS = [("impl", "impl"), ("mode", "mode"), ("batch", "batch"), ("tokens", "tokens"),
           ("wall_ms_per_step", "wall ms/step"), ("model_ms_per_step", "model ms/step"),
           ("host_ms_per_step", "host ms/step"), ("host_ms_per_token", "host ms/token")] + [
           (f"{p}_ms", f"{p} ms") for p in PHASES]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help='"default" (embedded model) or an HF checkpoint directory')
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 8, 64])
    p.add_argument("--tokens", type=int, default=128, help="new tokens per session (batch >= 64: --tokens-large)")
    p.add_argument("--tokens-large", type=int, default=32,
                   help="new tokens per session at batch >= 64 (each CPU step runs every row alone: ~0.4 s)")
    p.add_argument("--modes", type=lambda s: [x for x in s.split(",") if x], default=list(MODES))
    p.add_argument("--repeats", type=int, default=3, help="timed generate calls per cell (median)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's default)")
    p.add_argument("--skip-hf", action="store_true", help="measure ours only")
    p.add_argument("--no-profile", action="store_true", help="totals only (no cProfile run per cell)")
    p.add_argument("--tag", default="", help="suffix of the output files (before / after runs side by side)")
    p.add_argument("--out", type=Path, default=OUT_DIR)
    args = p.parse_args(argv)
    if unknown := set(args.modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    if args.repeats < 1 or args.tokens < 1 or args.tokens_large < 1 or not args.batches:
        p.error("--repeats, --tokens, --tokens-large and --batches must be positive")
    return args


class Clock:
    """Seconds spent inside the wrapped callables (nested calls counted once)."""

    def __init__(self):
        self.seconds = 0.0
        self._depth = 0

    def wrap(self, fn):
        def timed(*a, **kw):
            if self._depth:
                return fn(*a, **kw)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
                self._depth -= 1
        return timed


def model_clock(engine) -> Clock:
    """Time everything the model computes in this (CPU) engine: its forward and its logits."""
    clock = Clock()
    model = engine.model
    model.forward, model.logits = clock.wrap(model.forward), clock.wrap(model.logits)
    return clock


def params_for(mode: str, i: int, logprobs: int = 5):
    from capsulert.protocol.sampling import SamplingParams

    kw = dict(ignore_eos=True)
    if mode == "sample":
        kw.update(temperature=0.8, top_p=0.95, seed=1000 + i)
    elif mode == "stops":
        kw.update(stop=NEVER)
    elif mode == "logprobs":
        kw.update(logprobs=logprobs)
    return SamplingParams(**kw)


def prompts(engine, batch: int) -> list[list[int]]:
    from capsulert.engine.default_model import CORPUS_PATH

    ids = engine.tokenize(CORPUS_PATH.read_text(encoding="utf-8"))
    return [ids[(i * 37) % (len(ids) - PROMPT_TOKENS):][:PROMPT_TOKENS] for i in range(batch)]


# ------------------------------------------------------------------ phases (cProfile)
def _qualnames() -> dict[tuple[str, int], str]:
    """(file, first line) -> qualified name, for the functions of the decode loop's modules."""
    import importlib

    out = {}
    for name in ("decoding", "sampler", "stops", "token_codec", "engine", "runner", "session_table", "grammar", "model"):
        mod = importlib.import_module(f"capsulert.engine.{name}")
        for obj in vars(mod).values():
            members = [obj] + ([m for m in vars(obj).values()] if inspect.isclass(obj) else [])
            for m in members:
                fn = getattr(m, "fget", None) or getattr(m, "__func__", None) or m
                code = getattr(fn, "__code__", None)
                if code is not None and code.co_filename.endswith(f"capsulert/engine/{name}.py"):
                    out[(code.co_filename, code.co_firstlineno)] = fn.__qualname__
    return out


_ENGINE_INPUTS = {"pad_logits", "decode", "slot_ids", "decode_groups", "logits_rows", "rederive_grid_points",
                  "decode_rederiving", "step"}
_LOGPROB_OPS = ("log_softmax", "topk", "gather")


def _classify(key, qual: dict, callers_of) -> str | None:
    """The phase of a function's own time; None: its callers' phase."""
    file, line, name = key
    q = qual.get((file, line), "")
    if file.endswith("engine/model.py"):
        return None if name == "pad_rows" else "model"
    if "capsulert/kernels/" in file or file.endswith(("engine/moe.py", "engine/graphs.py", "engine/state.py")):
        return "model"
    if file.endswith("engine/sampler.py"):
        return "logprobs" if "logprob" in name else "sampling"
    if file.endswith("engine/stops.py"):
        return "text" if q.startswith("TextStream") else "stops"
    if file.endswith("engine/token_codec.py") or name == "detokenize":
        return "text"
    if file.endswith("engine/grammar.py"):
        return "sampling"  # the constraint's mask (no mode of this benchmark is constrained)
    if file.endswith(("engine/engine.py", "engine/runner.py", "engine/session_table.py")):
        return "inputs" if name in _ENGINE_INPUTS else "other"
    if file.endswith("engine/decoding.py"):
        return "inputs" if "input" in name else "other"
    if file == "~" and any(op in name for op in _LOGPROB_OPS):
        # the sampler computes the logprobs inline: its log_softmax, topk and gather outside the draw
        if any(c[0].endswith("engine/sampler.py") and c[2] != "_draw" for c in callers_of(key)):
            return "logprobs"
    return None


def profile_phases(run) -> dict[str, float]:
    """Seconds per phase of run() under cProfile (each function's own time, builtins to their callers)."""
    prof = cProfile.Profile()
    prof.runcall(run)
    stats = pstats.Stats(prof).stats
    qual = _qualnames()
    phases = dict.fromkeys(PHASES + ("model",), 0.0)
    callers_of = lambda k: stats.get(k, (0, 0, 0, 0, {}))[4]  # noqa: E731
    memo: dict = {}

    def attribute(key, t: float, depth: int = 0) -> None:
        if key not in memo:
            memo[key] = _classify(key, qual, callers_of)
        phase, callers = memo[key], callers_of(key)
        if phase is not None or not callers or depth > 40:
            phases[phase or "other"] += t
            return
        col = 2 if sum(v[2] for v in callers.values()) > 0 else 0  # by the own time per caller, else by calls
        total = sum(v[col] for v in callers.values())
        for c, v in callers.items():
            attribute(c, t * v[col] / total, depth + 1)

    for key, (_, _, tt, _, _) in stats.items():
        if tt:
            attribute(key, tt)
    return phases


# ------------------------------------------------------------------ ours
def bench_ours(engine, clock: Clock, mode: str, batch: int, tokens: int, args) -> dict:
    ids = prompts(engine, batch)
    params = [params_for(mode, i) for i in range(batch)]

    def one(n: int, profiled: bool = False) -> tuple[float, float, int]:
        sessions = [engine.open(prompt=p) for p in ids]
        try:
            m0, t0 = clock.seconds, time.perf_counter()
            if profiled:
                out = []
                phases = profile_phases(lambda: out.extend(engine.generate(sessions, n, params)))
            else:
                out, phases = engine.generate(sessions, n, params), None
            wall, model = time.perf_counter() - t0, clock.seconds - m0
        finally:
            for s in sessions:
                s.close()
        steps = max(len(r) for r in out)
        assert steps == n, f"{mode} b={batch}: {steps} steps, expected {n} (ignore_eos and no stop match)"
        return wall, model, phases

    one(min(tokens, 8))  # warm-up: first use of every shape and the tokenizer
    walls, models = [], []
    for _ in range(args.repeats):
        w, m, _ = one(tokens)
        walls.append(w)
        models.append(m)
    hosts = [w - m for w, m in zip(walls, models)]
    row = {"impl": "ours", "mode": mode, "batch": batch, "tokens": tokens,
           "wall_ms_per_step": median(walls) * 1e3 / tokens, "model_ms_per_step": median(models) * 1e3 / tokens,
           "host_ms_per_step": median(hosts) * 1e3 / tokens, "samples_host_ms_per_step": [h * 1e3 / tokens for h in hosts]}
    row["host_ms_per_token"] = row["host_ms_per_step"] / batch
    if not args.no_profile:
        _, _, phases = one(tokens, profiled=True)
        host = sum(v for k, v in phases.items() if k != "model")
        row["profile_s"] = phases
        for p in PHASES:
            row[f"{p}_ms"] = row["host_ms_per_step"] * phases[p] / host if host else float("nan")
    return row


# ------------------------------------------------------------------ HF
def hf_setup(engine, model_dir: Path | None):
    import transformers

    transformers.logging.set_verbosity_error()
    hf = hf_causal_lm(engine)
    hf.generation_config.eos_token_id = None  # every run makes all its tokens, as ours with ignore_eos
    hf.generation_config.pad_token_id = 0
    tok = None
    if model_dir is not None and (model_dir / "tokenizer.json").is_file():
        tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    clock = Clock()
    hf.forward = clock.wrap(hf.forward)
    return hf, tok, clock


def bench_hf(engine, hf, tok, clock: Clock, mode: str, batch: int, tokens: int, args) -> dict | None:
    if mode == "stops" and tok is None:
        return None
    ids = torch.tensor(prompts(engine, batch), device=engine.device)
    kw: dict = dict(do_sample=False, max_new_tokens=tokens, min_new_tokens=0, attention_mask=torch.ones_like(ids))
    if mode == "sample":
        kw.update(do_sample=True, temperature=0.8, top_p=0.95, top_k=0)
    elif mode == "stops":
        kw.update(stop_strings=list(NEVER), tokenizer=tok)
    elif mode == "logprobs":
        kw.update(output_scores=True, return_dict_in_generate=True)

    def one(n: int) -> tuple[float, float]:
        kw["max_new_tokens"] = n
        m0, t0 = clock.seconds, time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, **kw)
            if mode == "logprobs":  # what ours returns per token: the chosen token's logprob and the top 5
                logp = torch.log_softmax(torch.stack(out.scores, 1).float(), -1)
                logp.gather(-1, out.sequences[:, ids.shape[1]:, None]).tolist()
                torch.topk(logp, 5, -1)[0].tolist()
        wall, model = time.perf_counter() - t0, clock.seconds - m0
        seq = out.sequences if mode == "logprobs" else out
        assert seq.shape[1] - ids.shape[1] == n, f"HF {mode} b={batch}: {seq.shape[1] - ids.shape[1]} tokens"
        return wall, model

    one(min(tokens, 8))
    walls, models = zip(*[one(tokens) for _ in range(args.repeats)])
    hosts = [w - m for w, m in zip(walls, models)]
    row = {"impl": "HF", "mode": mode, "batch": batch, "tokens": tokens,
           "wall_ms_per_step": median(walls) * 1e3 / tokens, "model_ms_per_step": median(models) * 1e3 / tokens,
           "host_ms_per_step": median(hosts) * 1e3 / tokens, "samples_host_ms_per_step": [h * 1e3 / tokens for h in hosts]}
    row["host_ms_per_token"] = row["host_ms_per_step"] / batch
    return row


# ------------------------------------------------------------------ main
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from capsulert.engine.engine import Engine

    tokens_of = {b: args.tokens if b < 64 else args.tokens_large for b in args.batches}
    longest = max(PROMPT_TOKENS + t for t in tokens_of.values())
    chunk = 128
    engine = Engine.from_config(dict(model=args.model, device="cpu", slots=max(args.batches),
                                     max_seq=-(-longest // chunk) * chunk + chunk, prefill_chunk=chunk))
    clock = model_clock(engine)
    hf = None
    if not args.skip_hf:
        from capsulert.engine.default_model import ensure_default_model

        model_dir = ensure_default_model() if args.model == "default" else Path(args.model)
        hf = hf_setup(engine, model_dir)
    rows = []
    for batch in args.batches:
        for mode in args.modes:
            log(f"ours {mode} b={batch} x {tokens_of[batch]} tokens")
            rows.append(bench_ours(engine, clock, mode, batch, tokens_of[batch], args))
            if hf is not None:
                log(f"HF {mode} b={batch}")
                row = bench_hf(engine, *hf, mode, batch, tokens_of[batch], args)
                if row is not None:
                    rows.append(row)
    print_table(rows, COLUMNS)
    stem = "generate_host" + (f"_{args.tag}" if args.tag else "")
    write_json(args.out / f"{stem}.json", {"machine": machine_info("cpu"), "args": vars(args) | {"out": str(args.out)},
                                           "rows": rows})
    series = {f"{impl} {mode}": [next((r["host_ms_per_step"] for r in rows if r["impl"] == impl and r["mode"] == mode
                                       and r["batch"] == b), float("nan")) for b in args.batches]
              for impl in ("ours", "HF") for mode in args.modes if any(r["impl"] == impl and r["mode"] == mode for r in rows)}
    try:
        plot_lines(args.out / f"{stem}.png", args.batches, series, "batch (sessions per step)",
                   "host ms per step (outside the model)", logx=True, logy=True,
                   title="generate: host time per step outside the model (CPU)")
    except ImportError:
        log("matplotlib is not installed: no plot")
    log(f"wrote {args.out / stem}.json / .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
