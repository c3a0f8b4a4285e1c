"""Triton version of the in-chunk gate cumsum (reference: capsulert.kernels.gate_cumsum.chunk_gate_cumsum_ref).

One program a (row b, chunk) adds the chunk's gates of every head in token order, fp32, so the cumsum at a
padded chunk's last row equals the one at its last real token (padding gates are 0): a batched prefill, a
graph's bucketed piece and a piece alone give each row's chunk the same decay (gate_cumsum.py). It replaces
fla's chunk_local_cumsum, whose tl.cumsum scan associates by position (on an H100 the padded last row differed
from the last real one in 78 of 200 random chunks).

CUDA-graph capturable: the grid depends on shapes only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gate_cumsum_kernel(g_ptr, out_ptr, T, H, sg_b, sg_t, so_b, so_t, scale,
                        CHUNK: tl.constexpr, BH: tl.constexpr, HAS_SCALE: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
    offs_h = tl.arange(0, BH)
    mh = offs_h < H
    acc = tl.zeros([BH], dtype=tl.float32)
    for i in range(CHUNK):
        t = c * CHUNK + i
        m = mh & (t < T)
        acc += tl.load(g_ptr + b * sg_b + t * sg_t + offs_h, mask=m, other=0.0).to(tl.float32)
        val = acc * scale if HAS_SCALE else acc
        tl.store(out_ptr + b * so_b + t * so_t + offs_h, val, mask=m)


def _launch(g: torch.Tensor, out: torch.Tensor, chunk: int, scale: float | None) -> None:
    B, T, H = g.shape
    grid = (B, triton.cdiv(T, chunk))
    _gate_cumsum_kernel[grid](g, out, T, H, g.stride(0), g.stride(1), out.stride(0), out.stride(1),
                              1.0 if scale is None else scale, CHUNK=chunk, BH=triton.next_power_of_2(H),
                              HAS_SCALE=scale is not None)


def chunk_gate_cumsum(g: torch.Tensor, chunk: int, scale: float | None = None) -> torch.Tensor:
    """g [B, T, H] -> fp32 [B, T, H]: the in-chunk cumsum added in token order, times `scale` when given."""
    g = g if g.stride(-1) == 1 else g.contiguous()
    out = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    _launch(g, out, chunk, scale)
    return out
