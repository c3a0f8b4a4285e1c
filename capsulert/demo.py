"""The main job (`make demo`): load the embedded default model (random weights; `--model DIR` runs a real
Qwen3.5 checkpoint instead), prefill a long shared prompt once, snapshot it, answer turns by restore +
append, fork branches and roll one back, checking every result against a cold prefill and printing cold vs
capsule time-to-first-token. Long steps (the default model's first generation, loading, long prefills) show
progress bars on a terminal, and capsulert's log records (the Ray worker's too) go to stderr."""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

import torch

from capsulert.logs import setup_logging
from capsulert.model_notice import random_weights_notice
from capsulert.engine.default_model import CORPUS_PATH
from capsulert.engine.engine import Engine

TURNS = [
    " Question: what does the recurrent state remember?",
    " Question: why restore instead of prefilling again?",
    " Question: how many branches can share one prefix?",
]


def ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="short prompt and few tokens (used by the test suite)")
    ap.add_argument("--model", default="default",
                    help="a Qwen3.5 checkpoint directory (HF format); default: the embedded model, random weights")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--cache-dir", default=None, help="where the default model is generated (default ~/.cache/capsulert)")
    ap.add_argument("--no-orchestrator", action="store_true", help="skip the Ray orchestrator part")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="progress bars for long steps (default: when stderr is a terminal)")
    ap.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                    help="capsulert's log records on stderr (default: %(default)s)")
    args = ap.parse_args(argv)
    setup_logging(args.log_level)
    prompt_tokens, new_tokens = (300, 8) if args.quick else (1500, 24)
    notice = random_weights_notice(args.model)
    if notice:
        print(f"note: {notice}\n")

    t0 = time.perf_counter()
    eng = Engine.from_config(model=args.model, device=args.device, cache_dir=args.cache_dir, slots=8, max_seq=4096, prefill_chunk=256,
                             progress=args.progress)
    print(f"engine: {'default model' if args.model == 'default' else args.model} on {eng.device} ({eng.dtype}), {eng.config.slots} slots, "
          f"state set {eng.state.nbytes / 2**20:.1f} MiB, loaded in {ms(t0):.0f} ms")

    text = CORPUS_PATH.read_text()
    prefix = eng.tokenize(text)[:prompt_tokens]
    s = eng.open()
    t0 = time.perf_counter()
    s.append(prefix)
    cold_prefix_ms = ms(t0)
    answer = s.generate(new_tokens)
    print(f"prompt: {len(prefix)} tokens prefilled in {cold_prefix_ms:.1f} ms")
    print(f"generated: {eng.detokenize(answer)!r}")
    s.close()

    shared = eng.open()
    shared.append(prefix)
    t0 = time.perf_counter()
    ref = shared.snapshot("shared-prompt", pin=True)
    print(f"snapshot 'shared-prompt': {ref.nbytes / 2**20:.2f} MiB in {ms(t0):.2f} ms")
    shared.close()

    ok = True
    print(f"\n{'turn':<6}{'cold TTFT ms':>14}{'capsule TTFT ms':>17}{'speed-up':>10}  match")
    for i, turn in enumerate(TURNS):
        suffix = eng.tokenize(turn)
        cold = eng.open()
        t0 = time.perf_counter()
        cold_logits = cold.append(prefix + suffix)
        cold_ms = ms(t0)
        t0 = time.perf_counter()
        warm = eng.restore("shared-prompt")
        warm_logits = warm.append(suffix)
        warm_ms = ms(t0)
        same = torch.equal(cold_logits, warm_logits) and cold.generate(new_tokens) == warm.generate(new_tokens)
        ok &= same
        print(f"{i:<6}{cold_ms:>14.1f}{warm_ms:>17.1f}{cold_ms / warm_ms:>9.1f}x  {'bitwise' if same else 'MISMATCH'}")
        cold.close()
        warm.close()

    branches = eng.fork("shared-prompt", 3)
    outs = eng.generate(branches, new_tokens)
    for b, turn in zip(branches, TURNS):
        b.append(turn)
    print(f"\nfork: 3 branches from 'shared-prompt' decoded together: {len(outs)} x {new_tokens} tokens")

    b = branches[0]
    b.snapshot("branch0-turn")
    before = b.generate(new_tokens)
    b.restore("branch0-turn")  # roll back
    after = b.generate(new_tokens)
    ok &= before == after
    print(f"rollback: re-generated after restoring 'branch0-turn': {'identical' if before == after else 'MISMATCH'}")
    for br in branches:
        br.close()
    print(f"\ncapsules: {[(c.meta.name, c.tier, c.pinned) for c in eng.store.list()]}")
    if not args.no_orchestrator:
        expected = []
        for turn in TURNS:
            r = eng.restore("shared-prompt")
            r.append(turn)
            expected.append(r.generate(new_tokens))
            r.close()
        ok &= asyncio.run(orchestrator_part(args, prefix, expected, new_tokens))
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


async def orchestrator_part(args, prefix: list[int], expected: list[list[int]], new_tokens: int) -> bool:
    """The same turns through the async API: a Ray worker actor owns an engine; each turn is one call."""
    from capsulert.orchestrator import Orchestrator, best_of_n
    from capsulert.protocol.sampling import SamplingParams

    t0 = time.perf_counter()
    config = dict(engine=dict(model=args.model, device=args.device, cache_dir=args.cache_dir, slots=8, max_seq=4096, prefill_chunk=256,
                              progress=args.progress), local_num_cpus=2)
    async with await Orchestrator.start(config) as orch:
        print(f"\norchestrator: Ray worker actor up in {ms(t0):.0f} ms")
        s = await orch.open(prefix)
        await s.snapshot("shared-prompt", pin=True)
        await s.close()
        same = True
        for i, turn in enumerate(TURNS):
            t0 = time.perf_counter()
            toks = await orch.restore_append_generate("shared-prompt", turn, new_tokens)
            match = toks == expected[i]
            same &= match
            print(f"turn {i}: restore + append + generate in one actor call, {ms(t0):.1f} ms, "
                  f"{'same tokens as in-process' if match else 'MISMATCH'}")
        t0 = time.perf_counter()
        cands = await best_of_n(orch, "shared-prompt", TURNS[0], 4, new_tokens,
                                SamplingParams(temperature=0.9, seed=3), lambda c: len(set(c.tokens)))
        print(f"best-of-4 through the orchestrator: {ms(t0):.1f} ms; best: {cands[0].text!r}")
    return same


if __name__ == "__main__":
    sys.exit(main())
