"""Attention of a query chunk over the static KV of its slots, plain-torch reference version.

Positions come from the device `pos` buffer, never from Python ints: query t of batch row b sits at
pos[b] + t and sees keys [0, pos[b] + t]. `kv_len` is a static upper bound of the keys read (a shape,
bucketed by the caller); keys beyond a row's own length are masked.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_ref(kv_k, kv_v, slots, start, k, v):
    """kv_* [slots, max_seq, Hkv, D]; k, v [B, T, Hkv, D] written at rows start[b] + t of slot slots[b]."""
    T = k.shape[1]
    rows = start[:, None] + torch.arange(T, device=k.device)
    kv_k.index_put_((slots[:, None].expand_as(rows), rows), k)
    kv_v.index_put_((slots[:, None].expand_as(rows), rows), v)


def output_gate(o, gate):
    """The gated attention's output gate: o * sigmoid(gate), each rounded to o's dtype (the model's semantics,
    as HF computes it); gate [B, T, Hq, D], any strides."""
    return o * torch.sigmoid(gate)


def attention_ref(q, kv_k, kv_v, slots, start, kv_len: int, scale: float, gate=None):
    """q [B, T, Hq, D]; returns [B, T, Hq, D] in q's dtype, times sigmoid(gate) when a gate is given
    (output_gate). GQA: query head h reads kv head h // (Hq/Hkv)."""
    B, T, Hq, D = q.shape
    k = kv_k[slots, :kv_len].transpose(1, 2)  # [B, Hkv, L, D]
    v = kv_v[slots, :kv_len].transpose(1, 2)
    qpos = start[:, None] + torch.arange(T, device=q.device)  # [B, T]
    visible = torch.arange(kv_len, device=q.device)[None, None, :] <= qpos[:, :, None]  # [B, T, L]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=visible[:, None], scale=scale,
                                         enable_gqa=True)
    out = out.transpose(1, 2)
    return out if gate is None else output_gate(out, gate)


def tiled_attention_ref(q, kv_k, kv_v, slots, start, kv_len: int, scale: float, gate=None, tile: int = 64):
    """attention_ref computed so that a query row's bits depend only on its own position and the keys it
    sees, never on how many queries share the call or on `kv_len` (split-invariant prefill, on CPU).

    SDPA's CPU kernels pick their query and key blocking from the lengths, so a row's softmax sums in an
    order that depends on the piece it is computed in. Here queries are padded to whole tiles of `tile`
    absolute positions (at least `tile` GEMM rows: CPU GEMMs take other paths for a few rows); each query
    tile's scores are one GEMM of fixed shape over the keys up to its end, the row maximum is exact, and the
    numerator and the denominator come from one GEMM of the probabilities with [V | 1]. The CPU GEMMs give a
    row the same bits whatever the other rows and however many zero columns trail (tests/kernels), and
    masked keys are exact zeros, so a row computed in a piece of 40 queries equals the row computed in a
    piece of 1024. fp32 inside."""
    B, T, Hq, D = q.shape
    Hkv = kv_k.shape[2]
    rep = Hq // Hkv
    out = torch.empty_like(q)
    for b in range(B):
        a = int(start[b])
        lo, hi = a // tile * tile, -(-(a + T) // tile) * tile  # whole query tiles
        keys = kv_k[slots[b], :hi].float().permute(1, 2, 0)  # [Hkv, D, hi]
        vals = torch.cat([kv_v[slots[b], :hi].float().transpose(0, 1),
                          torch.ones(Hkv, hi, 1, device=q.device)], dim=-1)  # [Hkv, hi, D + 1]
        qt = q.new_zeros(hi - lo, Hq, D, dtype=torch.float32)
        qt[a - lo:a - lo + T] = q[b]
        ot = torch.empty_like(qt)
        for g0 in range(lo, hi, tile):  # one query tile a pass: every GEMM of a tile has one shape
            g1 = g0 + tile
            # [Hkv, rep * tile, D]: the query heads of one kv head stacked into one GEMM
            qg = qt[g0 - lo:g1 - lo].view(tile, Hkv, rep, D).permute(1, 2, 0, 3).reshape(Hkv, rep * tile, D) * scale
            s = qg @ keys[..., :g1]
            qpos = (g0 + torch.arange(tile, device=q.device)).repeat(rep)
            s.masked_fill_(torch.arange(g1, device=q.device)[None, :] > qpos[:, None], float("-inf"))
            p = (s - s.amax(-1, keepdim=True)).exp()
            pv = p @ vals[:, :g1]
            o = pv[..., :D] / pv[..., D:]
            ot[g0 - lo:g1 - lo] = o.view(Hkv, rep, tile, D).permute(2, 0, 1, 3).reshape(tile, Hq, D)
        out[b] = ot[a - lo:a - lo + T].to(q.dtype)
    return out if gate is None else output_gate(out, gate)
