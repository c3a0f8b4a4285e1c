"""The gated delta rule's in-chunk gate cumsum, added in token order: the plain-torch reference.

The chunked rule decays a chunk's state by the cumsum of its log gates at the chunk's last row. A prefill
piece padded with tokens whose gate is 0 (a captured graph's bucket, or the shorter rows of a batched
forward) has that last row past its last real token, and padding must not change a bit: the cumsum there
must equal the one at the last real token. Adding the gates one after another in token order gives that
exactly (x + 0 == x); a parallel scan (torch's CUDA cumsum, fla's chunk_local_cumsum) associates the
additions by position and gives the padded row other last bits (the kernels/triton_gate_cumsum.py doc).
"""
from __future__ import annotations

import torch


def chunk_gate_cumsum_ref(g: torch.Tensor, chunk: int, scale: float | None = None) -> torch.Tensor:
    """g [B, T, H] (fp32 or lower) -> fp32 [B, T, H]: the cumsum of g within each `chunk`-token chunk, added
    in token order in fp32, times `scale` (after the sum) when given."""
    B, T, H = g.shape
    out = torch.empty(B, T, H, dtype=torch.float32, device=g.device)
    acc = torch.zeros(B, -(-T // chunk), H, dtype=torch.float32, device=g.device)
    for i in range(chunk):
        rows = slice(i, T, chunk)  # the i-th row of every chunk
        n = len(range(i, T, chunk))
        if n == 0:
            break
        acc[:, :n] += g[:, rows].float()
        out[:, rows] = acc[:, :n] * scale if scale is not None else acc[:, :n]
    return out
