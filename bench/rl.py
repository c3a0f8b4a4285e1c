"""RL rollouts: episode resets/s and steps/s with E envs through the orchestrator (EpisodeDriver, envs
spread over the workers, steps batched by each worker's step scheduler) against the same work in-process
(Engine: the envs restored in place in one batched restore, one batched append of the observations and a
batched generate over the envs, and the same with a restore and an append per env, the way before batching; the
in-process rows also give the ms per step spent in the appends and in the generate), plus the time of a weight update and of a
start-capsule rebuild. Prints a table, writes bench/out/rl.json and bench/out/rl.png. `--no-batch-prefill`
runs the workers' prefill one forward per session, a chunk a step (SchedulerConfig.batch_prefill=False: the
orchestrated baseline, the way before batching); `--with-baseline` runs that
baseline too, in the same run, and reports the batched rate over it. The orchestrated rows also give the workers'
prefill forwards and decode steps per env step (a crowd's env step: one forward, then --gen decode steps).
`--context` sets where the envs' grid points fall: at the default 1000 every one ends an observation's append;
at e.g. 1012 every fourth env step's generate reaches one (each env re-derives its last 64 tokens there).

    .venv/bin/python bench/rl.py --quick                 # CPU, default model
    python bench/rl.py --device cuda --model random:capsulert/configs/models/qwen3_5-9b-shape.yaml
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from common import OUT_DIR, TAIL_REPLAY, cuda_sync, log, machine_info, plot_lines, print_table, write_json  # noqa: E402

from capsulert.orchestrator import EpisodeDriver, Orchestrator  # noqa: E402
from capsulert.engine.engine import Engine  # noqa: E402
from capsulert.protocol.sampling import SamplingParams  # noqa: E402

PARAMS = SamplingParams(ignore_eos=True)


def in_process(engine: Engine, envs: int, resets: int, steps: int, obs: list[int], gen: int,
               one_by_one: bool = False) -> dict:
    """Resets and steps of `envs` sessions forked from c0: the envs reset together (one batched restore,
    Engine.restore_into_many) and a step appends the observation to every env (one batched append) and
    generates for all; with one_by_one a restore and an append per env, the way before batching."""
    sessions = engine.fork("c0", envs)
    dev = engine.device.type
    # one untimed reset and step first: a path's first call at a shape pays its one-time costs (kernel compiles
    # of the batched forward's shapes on CUDA), which a two-step timing would otherwise mostly measure
    _steps(engine, sessions, 1, obs, gen, one_by_one)
    _resets(engine, sessions, len(sessions), one_by_one)
    cuda_sync(dev)
    t0 = time.perf_counter()
    _resets(engine, sessions, resets, one_by_one)
    cuda_sync(dev)
    reset_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    parts = _steps(engine, sessions, steps, obs, gen, one_by_one)
    step_s = time.perf_counter() - t0
    for s in sessions:
        s.close()
    return {"resets_per_s": resets / reset_s, "steps_per_s": steps * envs / step_s,
            "append_ms_per_step": parts["append"] / steps * 1e3, "generate_ms_per_step": parts["generate"] / steps * 1e3}


def _resets(engine: Engine, sessions: list, resets: int, one_by_one: bool) -> None:
    envs = len(sessions)
    for r in range(0, resets, envs):
        group = sessions[:min(envs, resets - r)]
        if one_by_one:
            for s in group:
                s.restore("c0")
        else:
            engine.restore_into_many(group, ["c0"] * len(group))


def _steps(engine: Engine, sessions: list, steps: int, obs: list[int], gen: int, one_by_one: bool) -> dict:
    """`steps` env steps; the seconds spent in the appends and in the generates (the device synchronized
    after each: an append waits for its prefill anyway)."""
    dev, spent = engine.device.type, {"append": 0.0, "generate": 0.0}
    for _ in range(steps):
        t0 = time.perf_counter()
        if one_by_one:
            for s in sessions:
                s.append(obs)
        else:
            engine.append_many(sessions, [obs] * len(sessions))
        cuda_sync(dev)
        t1 = time.perf_counter()
        engine.generate(sessions, gen, [PARAMS] * len(sessions))
        cuda_sync(dev)
        spent["append"] += t1 - t0
        spent["generate"] += time.perf_counter() - t1
    return spent


async def orchestrated(orch, envs: int, resets: int, steps: int, obs: list[int], gen: int) -> dict:
    async with EpisodeDriver(orch, "c0", n_envs=envs, max_new_tokens=gen, sampling=PARAMS) as drv:
        # untimed, as in_process: a reset and a step pay the workers' one-time costs at these shapes
        await asyncio.gather(*(drv.reset(i) for i in range(envs)))
        await asyncio.gather(*(drv.step(i, obs) for i in range(envs)))
        t0 = time.perf_counter()
        for r in range(0, resets, envs):  # the envs reset concurrently, as a driver's env loops do
            await asyncio.gather(*(drv.reset(i) for i in range(min(envs, resets - r))))
        reset_s = time.perf_counter() - t0
        before = await loop_counts(orch)
        t0 = time.perf_counter()
        for _ in range(steps):
            await asyncio.gather(*(drv.step(i, obs) for i in range(envs)))
        step_s = time.perf_counter() - t0
        after = await loop_counts(orch)
    # the workers' step loops per env step: one prefill forward and `gen` decode steps where the envs' turns
    # are one crowd (a forward per env without batched prefill)
    per_step = {f"{k}_per_env_step": (after[k] - before[k]) / steps for k in after}
    return {"resets_per_s": resets / reset_s, "steps_per_s": steps * envs / step_s, **per_step}


async def loop_counts(orch) -> dict:
    """The prefill forwards and decode steps every worker's step loop has run."""
    rows = await orch.stats()
    return {k: sum(r[k] for r in rows) for k in ("prefill_forwards", "decode_steps")}


def update_times(engine) -> dict:
    """update_weights from tensors on the engine's device and (on CUDA) from pinned host memory, each against
    the floor: one plain batched copy of the same tensors into the same buffers."""
    dev = engine.device.type
    sources = {"device": {k: v.detach().clone() for k, v in engine.model_weights.items()}}
    if dev == "cuda":
        sources["host"] = {k: v.to("cpu").pin_memory() for k, v in sources["device"].items()}
    out = {"bytes": sum(t.numel() * t.element_size() for t in sources["device"].values())}
    for where, weights in sources.items():
        dsts, srcs = list(engine.model_weights.values()), [weights[k] for k in engine.model_weights]
        for label, fn in (("copy", lambda: torch._foreach_copy_(dsts, srcs, non_blocking=True)),
                          ("update", lambda: engine.update_weights(weights))):
            times = []
            for _ in range(3):
                cuda_sync(dev)
                t0 = time.perf_counter()
                fn()
                cuda_sync(dev)
                times.append((time.perf_counter() - t0) * 1e3)
            out[f"{label}_from_{where}_ms"] = min(times)
        out[f"update_over_copy_from_{where}"] = out[f"update_from_{where}_ms"] / out[f"copy_from_{where}_ms"]
    del sources
    return out


async def start_orchestrator(cfg: dict, args, c0: list[int], batch_prefill: bool):
    """An orchestrator over args.workers workers holding the pinned start capsule c0."""
    orch = await Orchestrator.start(dict(engine={**cfg, "scheduler": {"batch_prefill": batch_prefill}},
                                         num_workers=args.workers, call_timeout_s=3600, torch_threads=args.threads))
    s = await orch.open(c0)
    await s.snapshot("c0", pin=True)
    await s.close()
    return orch


async def main(args) -> int:
    torch.set_num_threads(args.threads)
    cfg = dict(model=args.model, device=args.device, slots=max(args.envs) + 2, max_seq=args.max_seq,
               prefill_chunk=args.prefill_chunk, tail_replay=TAIL_REPLAY[args.tail_replay])
    log("in-process engine")
    engine = Engine.from_config(cfg)
    vocab = min(4000, engine.codec.vocab_size)  # the same ids on every model with 4,000 or more
    g = torch.Generator().manual_seed(0)
    c0 = torch.randint(10, vocab, (args.context,), generator=g).tolist()
    obs = torch.randint(10, vocab, (8,), generator=g).tolist()
    s = engine.open()
    s.append(c0)
    s.snapshot("c0", pin=True)
    s.close()
    update_ms = update_times(engine)
    log("weight update: " + ", ".join(f"{k} {v:.2f}" for k, v in update_ms.items() if k != "bytes"))
    if args.device == "cuda":  # the update's source copies are freed; give their cached blocks to the workers
        torch.cuda.empty_cache()
    cuda_sync(args.device)
    t0 = time.perf_counter()
    engine.rebuild("c0")
    cuda_sync(args.device)
    rebuild_ms = (time.perf_counter() - t0) * 1e3
    rows = []
    # --no-batch-prefill: the workers run each session's prefill piece as its own forward (the way before
    # batching), the baseline of the orchestrated steps/s; --with-baseline runs it too, after the default
    baseline = {}
    if args.with_baseline:
        orch = await start_orchestrator(cfg, args, c0, batch_prefill=False)
        try:
            for envs in args.envs:
                log(f"E={envs}: orchestrated, one forward per session's prefill piece")
                baseline[envs] = await orchestrated(orch, envs, args.resets, args.steps, obs, args.gen)
                log(f"E={envs}: {baseline[envs]['steps_per_s']:.2f} steps/s")
        finally:
            await orch.close()
    orch = await start_orchestrator(cfg, args, c0, batch_prefill=not args.no_batch_prefill)
    try:
        for envs in args.envs:
            log(f"E={envs}")
            local = in_process(engine, envs, args.resets, args.steps, obs, args.gen)
            alone = in_process(engine, envs, args.resets, args.steps, obs, args.gen, one_by_one=True)
            remote = await orchestrated(orch, envs, args.resets, args.steps, obs, args.gen)
            log(f"E={envs}: " + "; ".join(f"{name} {r['resets_per_s']:.1f} resets/s, {r['steps_per_s']:.2f} steps/s"
                                         for name, r in (("in-process", local), ("one by one", alone),
                                                         ("orchestrated", remote))))
            rows.append({"envs": envs, "resets_per_s_inprocess": local["resets_per_s"],
                         "append_ms_per_step_inprocess": local["append_ms_per_step"],
                         "append_ms_per_step_one_by_one": alone["append_ms_per_step"],
                         "generate_ms_per_step_inprocess": local["generate_ms_per_step"],
                         "resets_per_s_inprocess_one_by_one": alone["resets_per_s"],
                         "resets_batched_over_one_by_one": local["resets_per_s"] / alone["resets_per_s"],
                         "steps_per_s_inprocess_one_by_one": alone["steps_per_s"],
                         "steps_batched_over_one_by_one": local["steps_per_s"] / alone["steps_per_s"],
                         "resets_per_s_orch": remote["resets_per_s"],
                         "resets_orch_over_inprocess": remote["resets_per_s"] / local["resets_per_s"],
                         "steps_per_s_inprocess": local["steps_per_s"], "steps_per_s_orch": remote["steps_per_s"],
                         "steps_orch_over_inprocess": remote["steps_per_s"] / local["steps_per_s"],
                         "forwards_per_env_step_orch": remote["prefill_forwards_per_env_step"],
                         "decode_steps_per_env_step_orch": remote["decode_steps_per_env_step"]})
            if envs in baseline:
                rows[-1].update({"steps_per_s_orch_one_forward_each": baseline[envs]["steps_per_s"],
                                 "forwards_per_env_step_one_forward_each":
                                     baseline[envs]["prefill_forwards_per_env_step"],
                                 "decode_steps_per_env_step_one_forward_each":
                                     baseline[envs]["decode_steps_per_env_step"],
                                 "steps_orch_batched_over_one_forward_each":
                                     remote["steps_per_s"] / baseline[envs]["steps_per_s"]})
    finally:
        await orch.close()
    print_table(rows, list(rows[0]))
    print(f"weight update (in place, {update_ms['bytes'] / 1e6:.0f} MB): "
          + ", ".join(f"{k} {v:.2f}" for k, v in update_ms.items() if k != "bytes")
          + f"; start-capsule rebuild ({args.context} tokens): {rebuild_ms:.1f} ms")
    write_json(OUT_DIR / "rl.json", {"machine": machine_info(args.device), "args": vars(args), "rows": rows,
                                      "update_weights": update_ms, "rebuild_ms": rebuild_ms})
    plot_lines(OUT_DIR / "rl.png", [r["envs"] for r in rows],
               {"resets/s in-process": [r["resets_per_s_inprocess"] for r in rows],
                "resets/s orchestrator": [r["resets_per_s_orch"] for r in rows],
                "steps/s in-process": [r["steps_per_s_inprocess"] for r in rows],
                "steps/s orchestrator": [r["steps_per_s_orch"] for r in rows]},
               "envs", "per second", logx=True, logy=True, title=f"RL rollouts, {args.device}")
    return 0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--envs", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--resets", type=int, default=640)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--max-seq", type=int, default=2048)
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="CPU-sized: fewer resets and steps")
    ap.add_argument("--no-batch-prefill", action="store_true",
                    help="the orchestrator's workers run one forward per session's prefill piece (the baseline)")
    ap.add_argument("--tail-replay", choices=("auto", "on", "off"), default="auto",
                    help="EngineConfig.tail_replay (auto: the engine's default, on): on, the envs' appends replay their "
                    "kept tails instead of re-running them")
    ap.add_argument("--with-baseline", action="store_true",
                    help="also run the orchestrated steps with one forward per session's prefill piece, in this "
                    "run (one more orchestrator start), and report the batched rate over it")
    args = ap.parse_args(argv)
    if args.quick:
        args.resets, args.steps, args.context = 256, 2, 500
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
