"""Shared helpers for the benchmarks in bench/: timing, tables, JSON and PNG output, machine info.

Kept small on purpose; every benchmark imports it as `from common import ...` (bench/ is put on
sys.path by running `python bench/<name>.py`) or `from bench.common import ...`.
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from capsulert.config.engine import EngineConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = REPO_ROOT / "bench" / "out"


# the benches' --tail-replay choices as EngineConfig.tail_replay values (auto: the engine's default)
TAIL_REPLAY = {"auto": EngineConfig.model_fields["tail_replay"].default, "on": True, "off": False}


def log(msg: str) -> None:
    """Progress line on stderr (flushed), prefixed with the wall-clock time."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cuda_sync(device: Any = None) -> None:
    """torch.cuda.synchronize when the device is CUDA; a no-op on CPU (and when torch is absent)."""
    if device is None or str(device).startswith("cuda"):
        try:
            import torch
        except ImportError:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()


def timeit(fn: Callable[[], Any], warmup: int = 1, iters: int = 3, *,
           sync: Callable[[], None] | None = None,
           after: Callable[[Any], None] | None = None,
           cpu_ms: list[float] | None = None) -> list[float]:
    """Call fn warmup + iters times; return the iters wall times in milliseconds.

    `sync` (e.g. torch.cuda.synchronize) runs inside the timed region after fn, so asynchronous work
    is counted. `after(result)` runs outside the timed region after every call (warm-ups included):
    checks, closing sessions, freeing memory. If `cpu_ms` is a list, the process CPU time of each timed
    call (ms, all threads) is appended to it: on a shared machine, wall >> cpu means the call waited
    for a core.
    """
    times = []
    for i in range(warmup + iters):
        c0, t0 = time.process_time(), time.perf_counter()
        result = fn()
        if sync is not None:
            sync()
        dt = (time.perf_counter() - t0) * 1e3
        dc = (time.process_time() - c0) * 1e3
        if after is not None:
            after(result)
        if i >= warmup:
            times.append(dt)
            if cpu_ms is not None:
                cpu_ms.append(dc)
    return times


def percentile(xs: Sequence[float], q: float) -> float:
    """q in [0, 100], linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        a = abs(v)
        if a >= 100:
            return f"{v:.0f}"
        if a >= 10:
            return f"{v:.1f}"
        if a >= 0.1:
            return f"{v:.2f}"
        return f"{v:.3g}"
    return str(v)


def format_table(rows: Iterable[Mapping[str, Any]], columns: Sequence[str | tuple[str, str]]) -> str:
    """A GitHub-markdown table (pads columns, so it also reads well in a terminal).

    columns: keys, or (key, header) pairs. Missing keys print as "-"; floats get 3 significant-ish digits.
    """
    cols = [(c, c) if isinstance(c, str) else c for c in columns]
    body = [[_fmt(r.get(k, "-")) for k, _ in cols] for r in rows]
    heads = [h for _, h in cols]
    widths = [max([len(h)] + [len(b[i]) for b in body]) for i, h in enumerate(heads)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(heads), sep] + [line(b) for b in body])


def print_table(rows: Iterable[Mapping[str, Any]], columns: Sequence[str | tuple[str, str]], file=None) -> str:
    """Print format_table(rows, columns) to file (default stdout) and return the text."""
    text = format_table(list(rows), columns)
    print(text, file=file or sys.stdout, flush=True)
    return text


def write_json(path: str | Path, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    return path


def plot_lines(path: str | Path, x: Sequence[float], series: Mapping[str, Sequence[float]], xlabel: str,
               ylabel: str, logy: bool = False, logx: bool = False, title: str | None = None) -> Path:
    """One PNG with a line (with markers) per series over the shared x values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name, ys in series.items():
        ax.plot(list(x), list(ys), marker="o", label=name)
    if logx:
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(x))
        ax.set_xticklabels([str(v) for v in x])
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_info(device: str = "cpu") -> dict[str, Any]:
    """Where the numbers came from: CPU model and count, GPU name, torch version, commit, UTC date."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": git_commit(),
        "cpu": cpu,
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
    }
    if hasattr(os, "getloadavg"):
        info["loadavg_1_5_15"] = [round(v, 2) for v in os.getloadavg()]
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if str(device).startswith("cuda") and torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return info


def hf_causal_lm(engine):
    """HF transformers' CausalLM for the engine's model (Qwen3_5ForCausalLM, or Qwen3_5MoeForCausalLM for an
    MoE config), in eval mode, on the engine's device and dtype, its parameters the engine's own weight tensors
    (no copy: a 35B MoE's weights fit once on an H200, not twice). Built on the meta device, so nothing is
    allocated or initialised before the weights are assigned; the rotary table (the one buffer no state dict
    holds) is then built on the device."""
    import torch
    import transformers

    cfg = engine.model_cfg
    config_cls, model_cls = ((transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM) if cfg.is_moe
                             else (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM))
    hf_cfg = config_cls(**{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        model = model_cls(hf_cfg)
    # transformers' Qwen3.5 has no MTP head: the engine's mtp.* weights have no place there
    weights = {k: v for k, v in engine.model_weights.items() if not k.startswith("mtp.")}
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if cfg.tie_word_embeddings else set()), (
        missing, unexpected)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.device(engine.device):
        model.model.rotary_emb = type(model.model.rotary_emb)(hf_cfg)
    return model.eval()
