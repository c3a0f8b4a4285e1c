"""Probe: which dense GEMM of the Qwen3.5-MoE decode step changes a row's bits with the row count, under the
engine's CUDA numerics (cuBLASLt, 1-byte workspace)? For every weight shape the 35B-A3B decode step runs
through F.linear, rows 1..64 computed alone against the same rows of one 64-row GEMM (the padded decode
path's shape), and the prefill pieces of the engine's start-up check against one 1024-row GEMM. Writes moe_gemm_rows.json to $OUT (or the current directory).

    python bench/probes/moe_gemm_rows.py"""
import json
import os

import torch
import torch.nn.functional as F

from capsulert.engine.numerics import CUDA_PIECES, configure_cuda, first_split_variant_piece

configure_cuda()
H = 2048
SHAPES = {  # name: (out, in) at the 35B-A3B shape
    "gdn_in": (12352, H), "out_proj": (H, 4096), "attn_in": (9216, H), "o_proj": (H, 4096),
    "moe_in": (1280, H), "shared_down": (H, 512), "shared_gate": (1, H), "shared_gate_pad8": (8, H),
    "moe_in_plus_gate8": (1288, H), "router": (256, H), "lm_head": (248320, H),
}
g = torch.Generator(device="cuda").manual_seed(0)
out = {}
for name, (n, k) in SHAPES.items():
    w = (torch.randn(n, k, generator=g, device="cuda") * k ** -0.5).to(torch.bfloat16)
    x = torch.randn(64, k, generator=g, device="cuda").to(torch.bfloat16)
    full = F.linear(x, w)
    bad = [m for m in range(1, 65) if not torch.equal(F.linear(x[:m], w), full[:m])]
    piece = first_split_variant_piece(w, 1024, CUDA_PIECES)  # the prefill pieces the engine's start-up check uses
    out[name] = {"decode_rows": bad, "prefill_piece": piece}
    print(f"{name:>18} {n}x{k}: rows whose bits differ from the 64-row GEMM: {bad or 'none'}; "
          f"first prefill piece differing from a 1024-row GEMM: {piece}", flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "moe_gemm_rows.json"), "w"), indent=1)
