"""Capsule bytes with and without the MTP head's state, computed from the state layout (no GPU, no weights).

A capsule of P tokens holds the slot's capsule views (engine/slot_views.py): the per-token rows [0, P) (the
KV, and with an MTP head its KV), the live recurrent and conv state, the last hidden state and, off the grid,
the grid checkpoint (with a head, the hidden state before the grid point too). The state set is laid out on
torch's meta device, so the numbers are the engine's own shapes and dtypes, for any model shape.

    python bench/capsule_bytes.py                          # the 9B shape, bf16, P = 2048 and 2047
    python bench/capsule_bytes.py --model qwen3_5-35b-a3b-shape --lengths 2048 4096
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from capsulert.config.model import ModelConfig
from capsulert.engine.default_model import REPO_ROOT
from capsulert.engine.runner import GRID
from capsulert.engine.slot_views import capsule_views
from capsulert.engine.state import StateLayout, StateSet


def capsule_nbytes(cfg: ModelConfig, length: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of each tensor of a capsule of `length` tokens of `cfg` (one slot, meta device)."""
    st = StateSet(StateLayout.for_model(cfg, 1, length, dtype, "meta"))
    views = capsule_views(st, 0, length, length // GRID * GRID)
    return {name: t.numel() * t.element_size() for name, t in views.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3_5-9b-shape", help="a config of capsulert/configs/models")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 2047])
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    cfg = ModelConfig.from_file(REPO_ROOT / "capsulert" / "configs" / "models" / f"{args.model}.yaml")
    dtype = getattr(torch, args.dtype)
    plain = dataclasses.replace(cfg, mtp_num_hidden_layers=0)
    print(f"{args.model}, {args.dtype}: capsule bytes without and with the MTP head's state\n")
    print("| P | without MTP | with MTP | MTP KV | MTP seed at the grid point | increase |")
    print("|---|---|---|---|---|---|")
    for P in args.lengths:
        without, with_mtp = capsule_nbytes(plain, P, dtype), capsule_nbytes(cfg, P, dtype)
        a, b = sum(without.values()), sum(with_mtp.values())
        kv = with_mtp.get("mtp_k", 0) + with_mtp.get("mtp_v", 0)
        print(f"| {P} | {a:,} ({a / 2**20:.1f} MiB) | {b:,} ({b / 2**20:.1f} MiB) | {kv:,} | "
              f"{with_mtp.get('grid_hidden', 0):,} | +{100 * (b - a) / a:.2f}% |")


if __name__ == "__main__":
    main()
