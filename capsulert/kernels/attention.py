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


def attention_ref(q, kv_k, kv_v, slots, start, kv_len: int, scale: float):
    """q [B, T, Hq, D]; returns [B, T, Hq, D] in q's dtype. GQA: query head h reads kv head h // (Hq/Hkv)."""
    B, T, Hq, D = q.shape
    k = kv_k[slots, :kv_len].transpose(1, 2)  # [B, Hkv, L, D]
    v = kv_v[slots, :kv_len].transpose(1, 2)
    qpos = start[:, None] + torch.arange(T, device=q.device)  # [B, T]
    visible = torch.arange(kv_len, device=q.device)[None, None, :] <= qpos[:, :, None]  # [B, T, L]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=visible[:, None], scale=scale,
                                         enable_gqa=True)
    return out.transpose(1, 2)
