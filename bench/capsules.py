"""Capsule benchmark: time-to-first-token with and without a capsule, ours and HF transformers side by side.

For each prefix length P (real text from capsulert/data/corpus.txt, through the engine's tokenizer) and a
32-token suffix that continues it:

- ours cold:          open a session, append(prefix + suffix), logits ready
- ours capsule:       restore(capsule of the prefix) + append(suffix), logits ready; checked bitwise equal
                      to ours cold on every call (the benchmark fails loudly otherwise)
- snapshot / restore: each alone; capsule MB; restore bandwidth = capsule bytes / restore time
- HF cold:            transformers Qwen3_5ForCausalLM, or Qwen3_5MoeForCausalLM for an MoE checkpoint (same
                      checkpoint directory), forward of prefix + suffix
- HF prefix-kept:     prefix prefilled once; per call copy.deepcopy(past_key_values) + forward the suffix

Medians over --repeats timed calls after one warm-up each. Writes bench/out/capsules.json and
bench/out/capsules.png (TTFT vs prefix length, log-log) and prints a markdown table.

    python bench/capsules.py --device cpu            # 512 ... 8192
    python bench/capsules.py --quick                 # 512, 1024; 1 repeat
    python bench/capsules.py --device cuda --model /models/Qwen3.5-9B --lengths 2048,4096,8192,16384
    python bench/capsules.py --off-grid --prefill-chunk 1024   # turns that end anywhere (ratios to the first)
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common import OUT_DIR, TAIL_REPLAY, cuda_sync, log, machine_info, median, plot_lines, print_table, timeit, write_json  # noqa: E402

DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192)
QUICK_LENGTHS = (512, 1024)
# capsule ends on and off the 64-token grid and the old 1024 one: resuming should cost the same everywhere
OFF_GRID_LENGTHS = (2048, 2049, 2560, 3000, 3071, 4096, 4500)
CHUNK = 256

COLUMNS = [
    ("prefix", "prefix tok"),
    ("ours_cold_ms", "ours cold ms"),
    ("ours_capsule_ms", "ours capsule ms"),
    ("ours_speedup", "cold/capsule"),
    ("snapshot_ms", "snapshot ms"),
    ("restore_ms", "restore ms"),
    ("capsule_mb", "capsule MB"),
    ("restore_gbps", "restore GB/s"),
    ("hf_cold_ms", "HF cold ms"),
    ("hf_kept_ms", "HF prefix-kept ms"),
    ("hf_cold_vs_ours", "HF cold/ours cold"),
    ("hf_kept_vs_ours", "HF kept/ours capsule"),
    ("capsule_vs_first", "capsule/first"),
    ("bitwise", "bitwise exact"),
]


def _label(key: str) -> str:
    return {"ours_cold_ms": "ours cold", "ours_capsule_ms": "ours capsule", "hf_cold_ms": "HF cold",
            "hf_kept_ms": "HF prefix-kept"}.get(key, key)


class ExactnessError(AssertionError):
    pass


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", default="default", help='"default" (embedded model) or an HF checkpoint directory')
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",") if x],
                   help=f"comma-separated prefix lengths (default {','.join(map(str, DEFAULT_LENGTHS))})")
    p.add_argument("--quick", action="store_true", help=f"lengths {QUICK_LENGTHS}, 1 repeat")
    p.add_argument("--off-grid", action="store_true", help=f"lengths {OFF_GRID_LENGTHS}")
    p.add_argument("--prefill-chunk", type=int, default=CHUNK, help="the longest prefill piece (multiple of 64)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per measurement (default 3; --quick 1)")
    p.add_argument("--suffix", type=int, default=32, help="suffix tokens appended after the prefix")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: 1 on CPU, see bench/RESULTS.md; 0 = torch's default)")
    p.add_argument("--skip-hf", action="store_true", help="measure ours only")
    p.add_argument("--tail-replay", choices=("auto", "on", "off"), default="auto",
                   help="EngineConfig.tail_replay (auto: the engine's default, on)")
    p.add_argument("--out", type=Path, default=OUT_DIR, help="output directory (capsules.json, capsules.png)")
    args = p.parse_args(argv)
    if args.lengths is None:
        args.lengths = list(OFF_GRID_LENGTHS if args.off_grid else QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.threads is None:
        args.threads = 1 if args.device == "cpu" else 0
    if any(n <= 0 for n in args.lengths) or args.suffix <= 0 or args.repeats <= 0:
        p.error("lengths, --suffix and --repeats must be positive")
    return args


def corpus_tokens(engine, need: int) -> list[int]:
    from capsulert.engine.default_model import CORPUS_PATH

    text = CORPUS_PATH.read_text(encoding="utf-8")
    reps = 1
    while True:
        ids = engine.tokenize("\n\n".join([text] * reps))
        if len(ids) >= need:
            return ids[:need]
        reps *= 2


def model_dir(model: str) -> Path:
    if model == "default":
        from capsulert.engine.default_model import ensure_default_model

        return ensure_default_model()
    return Path(model)


def hf_class_name(moe: bool) -> str:
    return "Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"


def load_hf(path: Path, dtype: torch.dtype, device: str, moe: bool):
    """HF's CausalLM of the checkpoint: the MoE class for a Qwen3.5-MoE model, else the dense one."""
    import transformers

    transformers.logging.set_verbosity_error()  # the "falling back to the reference kernel" notes
    model = getattr(transformers, hf_class_name(moe)).from_pretrained(path, dtype=dtype).to(device).eval()
    return model


def bench_length(P: int, args, engine, hf, ids: list[int]) -> dict:
    dev = args.device
    sync = (lambda: cuda_sync(dev)) if dev == "cuda" else None
    warm, reps = 1, args.repeats
    prefix, suffix = ids[:P], ids[P:P + args.suffix]
    full = prefix + suffix
    row: dict = {"prefix": P, "suffix": len(suffix)}
    cpu: dict[str, list[float]] = {}  # process CPU ms per timed call: wall >> cpu means the call waited for a core

    def cpu_of(key: str) -> list[float]:
        return cpu.setdefault(key, [])

    row["samples_cpu"] = cpu
    tag = f"[P={P}]"

    # ---------------- ours cold
    log(f"{tag} ours cold: open + append({P}+{len(suffix)}) x {warm}+{reps}")
    cold_logits: list[torch.Tensor] = []

    def ours_cold():
        s = engine.open()
        return s, s.append(full)

    def close_keep(res):
        s, lg = res
        cold_logits.append(lg.clone())
        s.close()

    t_cold = timeit(ours_cold, warm, reps, sync=sync, after=close_keep, cpu_ms=cpu_of("ours_cold_ms"))
    ref = cold_logits[0]
    for i, lg in enumerate(cold_logits[1:], 1):
        if not torch.equal(lg, ref):
            raise ExactnessError(f"{tag} ours cold is not deterministic: call {i} differs from call 0 "
                                 f"(max |diff| {(lg - ref).abs().max().item():.3g})")

    # ---------------- snapshot
    log(f"{tag} ours snapshot: prefill prefix once, snapshot x {warm}+{reps}")
    s0 = engine.open()
    s0.append(prefix)
    if sync:
        sync()
    n_snap = iter(range(10**6))
    t_snap = timeit(lambda: engine.snapshot(s0, f"bench-snap-{P}-{next(n_snap)}"), warm, reps, sync=sync,
                    after=lambda r: engine.store.delete(r.name), cpu_ms=cpu_of("snapshot_ms"))
    cap = f"bench-prefix-{P}"
    cref = engine.snapshot(s0, cap)
    s0.close()
    nbytes = cref.nbytes
    info_nbytes = engine.store.info(cap).meta.nbytes  # the whole capsule (info.nbytes: what it holds alone)
    if info_nbytes != nbytes:
        raise AssertionError(f"{tag} CapsuleRef.nbytes {nbytes} != store.info meta.nbytes {info_nbytes}")

    # ---------------- restore alone
    log(f"{tag} ours restore alone ({nbytes / 1e6:.1f} MB) x {warm}+{reps}")
    t_restore = timeit(lambda: engine.restore(cap), warm, reps, sync=sync, after=lambda s: s.close(), cpu_ms=cpu_of("restore_ms"))

    # ---------------- ours capsule TTFT (exactness checked on every call, warm-up included)
    log(f"{tag} ours capsule: restore + append({len(suffix)}) x {warm}+{reps}, bitwise check vs cold")
    n_checked = 0

    def ours_capsule():
        s = engine.restore(cap)
        return s, s.append(suffix)

    def check_close(res):
        nonlocal n_checked
        s, lg = res
        s.close()
        if not torch.equal(lg, ref):
            diff = (lg.float() - ref.float()).abs().max().item()
            raise ExactnessError(f"{tag} restore(capsule@{P}) + append({len(suffix)}) logits differ from the cold "
                                 f"prefill of {P + len(suffix)} tokens: max |diff| {diff:.3g} (must be bitwise equal)")
        n_checked += 1

    t_cap = timeit(ours_capsule, warm, reps, sync=sync, after=check_close, cpu_ms=cpu_of("ours_capsule_ms"))
    engine.store.delete(cap)

    row.update(
        ours_cold_ms=median(t_cold), ours_capsule_ms=median(t_cap), snapshot_ms=median(t_snap),
        restore_ms=median(t_restore), capsule_bytes=nbytes, capsule_mb=nbytes / 1e6,
        restore_gbps=nbytes / (median(t_restore) * 1e-3) / 1e9, bitwise=True, bitwise_checks=n_checked,
        samples={"ours_cold_ms": t_cold, "ours_capsule_ms": t_cap, "snapshot_ms": t_snap, "restore_ms": t_restore},
    )
    row["ours_speedup"] = row["ours_cold_ms"] / row["ours_capsule_ms"]
    log(f"{tag} ours: cold {row['ours_cold_ms']:.1f} ms, capsule {row['ours_capsule_ms']:.1f} ms "
        f"({row['ours_speedup']:.1f}x), {n_checked} bitwise checks passed")

    if hf is None:
        return row

    # ---------------- HF cold
    log(f"{tag} HF cold: forward({P}+{len(suffix)}) x {warm}+{reps}")
    x_full = torch.tensor([full], device=dev)
    hf_logits: list[torch.Tensor] = []

    def hf_cold():
        with torch.inference_mode():
            return hf(x_full, use_cache=True, logits_to_keep=1).logits[0, -1]

    t_hf = timeit(hf_cold, warm, reps, sync=sync, after=lambda lg: hf_logits.append(lg.float().clone()), cpu_ms=cpu_of("hf_cold_ms"))
    hf_ref = hf_logits[0]
    oref = ref.float()
    row["hf_parity_rel_err"] = ((hf_ref - oref).abs().max() / oref.abs().max()).item()
    row["hf_parity_argmax"] = bool(hf_ref.argmax() == oref.argmax())

    # ---------------- HF prefix-kept
    log(f"{tag} HF prefix-kept: prefill prefix once; deepcopy(cache) + forward({len(suffix)}) x {warm}+{reps}")
    with torch.inference_mode():
        kept = hf(torch.tensor([prefix], device=dev), use_cache=True, logits_to_keep=1).past_key_values
    x_suf = torch.tensor([suffix], device=dev)
    kept_logits: list[torch.Tensor] = []

    def hf_kept():
        with torch.inference_mode():
            cache = copy.deepcopy(kept)
            return hf(x_suf, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]

    t_kept = timeit(hf_kept, warm, reps, sync=sync, after=lambda lg: kept_logits.append(lg.float().clone()), cpu_ms=cpu_of("hf_kept_ms"))
    t_copy = timeit(lambda: copy.deepcopy(kept), warm, reps, sync=sync, cpu_ms=cpu_of("hf_cache_copy_ms"))
    row["hf_kept_rel_err_vs_hf_cold"] = ((kept_logits[0] - hf_ref).abs().max() / hf_ref.abs().max()).item()
    row.update(hf_cold_ms=median(t_hf), hf_kept_ms=median(t_kept), hf_cache_copy_ms=median(t_copy))
    row["samples"].update(hf_cold_ms=t_hf, hf_kept_ms=t_kept, hf_cache_copy_ms=t_copy)
    row["hf_cold_vs_ours"] = row["hf_cold_ms"] / row["ours_cold_ms"]
    row["hf_kept_vs_ours"] = row["hf_kept_ms"] / row["ours_capsule_ms"]
    log(f"{tag} HF: cold {row['hf_cold_ms']:.1f} ms, prefix-kept {row['hf_kept_ms']:.1f} ms "
        f"(cache copy {row['hf_cache_copy_ms']:.1f} ms); parity rel err {row['hf_parity_rel_err']:.2g}")
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from capsulert.engine.engine import Engine

    lengths = sorted(set(args.lengths))
    chunk = args.prefill_chunk
    max_seq = -(-(max(lengths) + max(args.suffix, chunk)) // chunk) * chunk
    log(f"engine: model={args.model} device={args.device} slots=4 max_seq={max_seq} prefill_chunk={chunk} "
        f"threads={torch.get_num_threads()}")
    engine = Engine.from_config(model=args.model, device=args.device, slots=4, max_seq=max_seq, prefill_chunk=chunk,
                                tail_replay=TAIL_REPLAY[args.tail_replay])
    ids = corpus_tokens(engine, max(lengths) + args.suffix)
    hf = None
    if not args.skip_hf:
        path = model_dir(args.model)
        moe = engine.model_cfg.is_moe
        log(f"HF: {hf_class_name(moe)}.from_pretrained({path}, dtype={engine.dtype})")
        hf = load_hf(path, engine.dtype, args.device, moe)
    info_start = machine_info(args.device)
    log(f"load average at start: {info_start.get('loadavg_1_5_15')}")

    rows = []
    for P in lengths:
        rows.append(bench_length(P, args, engine, hf, ids))
        rows[-1]["capsule_vs_first"] = rows[-1]["ours_capsule_ms"] / rows[0]["ours_capsule_ms"]

    info = machine_info(args.device)
    info["loadavg_1_5_15_start"] = info_start.get("loadavg_1_5_15")
    result = {
        "benchmark": "capsules",
        "command": "python " + " ".join([sys.argv[0]] + (sys.argv[1:] if argv is None else list(argv))),
        "machine": info,
        "config": {"model": args.model, "device": args.device, "dtype": str(engine.dtype).replace("torch.", ""),
                   "slots": 4, "max_seq": max_seq, "prefill_chunk": chunk, "suffix": args.suffix,
                   "repeats": args.repeats, "warmup": 1, "threads": torch.get_num_threads(),
                   "tail_replay": engine.runner.tail_replay,
                   "statistic": "median", "fingerprint": engine.fingerprint,
                   "hf_logits_to_keep": 1},
        "results": rows,
    }
    out = Path(args.out)
    jpath = write_json(out / "capsules.json", result)
    series = {"ours cold": [r["ours_cold_ms"] for r in rows], "ours capsule": [r["ours_capsule_ms"] for r in rows]}
    if hf is not None:
        series["HF cold"] = [r["hf_cold_ms"] for r in rows]
        series["HF prefix-kept"] = [r["hf_kept_ms"] for r in rows]
    ppath = plot_lines(out / "capsules.png", lengths, series, "prefix length (tokens)",
                       f"TTFT ms (prefix + {args.suffix}-token suffix)", logy=True, logx=True,
                       title=f"Capsule TTFT, {args.model} model, {args.device}")
    cols = COLUMNS if hf is not None else [c for c in COLUMNS if not c[0].startswith("hf")]
    print(f"\nCapsule TTFT ({args.model} model, {args.device}, {result['config']['dtype']}, "
          f"median of {args.repeats} after 1 warm-up; suffix {args.suffix} tokens)\n")
    print_table(rows, cols)
    cpu_cols = [c for c in ("ours_cold_ms", "ours_capsule_ms", "hf_cold_ms", "hf_kept_ms") if any(c in r["samples_cpu"] for r in rows)]
    cpu_rows = [{"prefix": r["prefix"], **{c: median(r["samples_cpu"][c]) for c in cpu_cols if c in r["samples_cpu"]},
                 **{c + "/wall": median(r["samples_cpu"][c]) / r[c] for c in cpu_cols if c in r["samples_cpu"]}} for r in rows]
    print("\nProcess CPU time of the same calls (median ms; cpu/wall well below 1 x threads means the call waited "
          "for a core: the machine was busy)\n")
    print_table(cpu_rows, [("prefix", "prefix tok")] + [(c, _label(c) + " cpu ms") for c in cpu_cols]
                + [(c + "/wall", _label(c) + " cpu/wall") for c in cpu_cols])
    if hf is not None:
        worst = max(r["hf_parity_rel_err"] for r in rows)
        print(f"\nHF parity (ours cold vs HF cold logits): max relative error {worst:.2g}; "
              f"greedy token equal: {all(r['hf_parity_argmax'] for r in rows)}")
    log(f"wrote {jpath} and {ppath}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
