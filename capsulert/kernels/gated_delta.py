"""Gated delta rule (the Gated DeltaNet token mixer), plain-torch reference versions.

Shapes (batch B, tokens T, value heads H, key dim K, value dim V), all fp32:
    q, k: [B, T, H, K]  already L2-normalised (q also scaled by K**-0.5) and expanded to the value heads
    v:    [B, T, H, V]
    g:    [B, T, H]     log decay (<= 0): the state is multiplied by exp(g_t) before token t writes
    beta: [B, T, H]     write strength in (0, 1)
    state:[B, H, K, V]  recurrent state before the first token

Per token:  S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q.
The chunked form processes GATED_DELTA_CHUNK tokens at once (WY representation); splitting a sequence at a
multiple of the chunk and carrying the state gives bitwise the same result as one call.
"""
from __future__ import annotations

import torch

from capsulert.kernels.chunk import GATED_DELTA_CHUNK


def recurrent_gated_delta_rule_ref(q, k, v, g, beta, state):
    """Token-by-token form; returns (o [B,T,H,V], final state). The oracle for the chunked form."""
    S = state.clone()
    outs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, None]
        kv_mem = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, dim=1), S


def gated_delta_step_ref(q, k, v, g, beta, state):
    """One decode token for B independent slots: q,k [B,H,K], v [B,H,V], g,beta [B,H]; returns (o, new state)."""
    S = state * g.exp()[..., None, None]
    kv_mem = (S * k[..., None]).sum(-2)
    delta = (v - kv_mem) * beta[..., None]
    S = S + k[..., None] * delta[..., None, :]
    return (S * q[..., None]).sum(-2), S


def ordered_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Cumsum over the last dim, added one element after the other."""
    out = x.clone()
    for i in range(1, x.shape[-1]):
        out[..., i] += out[..., i - 1]
    return out


def chunk_gated_delta_rule_ref(q, k, v, g, beta, state, chunk: int = GATED_DELTA_CHUNK):
    """Chunked form; returns (o [B,T,H,V], final state [B,H,K,V])."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    pad = (-T) % chunk
    # padded tokens have k = v = beta = 0 and g = 0: they neither decay nor write the state
    q, k, v = (torch.nn.functional.pad(x.transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (torch.nn.functional.pad(x.transpose(1, 2), (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, -1) for x in (q, k, v))
    g, beta = (x.reshape(B, H, n, chunk) for x in (g, beta))

    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    # each chunk's gates added in token order, so the zero gates of padding (here and in a padded piece)
    # leave the cumsum at the last real token as it is (kernels/gate_cumsum.py); torch's CPU cumsum adds in
    # order (in double), its CUDA cumsum is a scan
    g = g.cumsum(-1) if g.device.type == "cpu" else ordered_cumsum(g)
    upper = torch.triu(torch.ones(chunk, chunk, dtype=torch.bool, device=q.device), diagonal=1)
    # decay[i, j] = exp(g_i - g_j) for j <= i; the upper triangle is masked before exp so it cannot overflow
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    strict_lower = (k_beta @ k.transpose(-1, -2) * decay).masked_fill(upper | eye.bool(), 0.0)
    # WY representation: (I + L)^-1 turns the intra-chunk delta-rule recursion into two matmuls
    inv = torch.linalg.solve_triangular(eye + strict_lower, eye.expand_as(strict_lower), upper=False, unitriangular=True)
    u = inv @ v_beta
    w = inv @ (k_beta * g.exp()[..., None])

    S = state.clone()
    out = torch.empty(B, H, n, chunk, V, dtype=q.dtype, device=q.device)
    for i in range(n):
        qi, ki, gi = q[:, :, i], k[:, :, i], g[:, :, i]
        attn = (qi @ ki.transpose(-1, -2) * decay[:, :, i]).masked_fill(upper, 0.0)
        v_new = u[:, :, i] - w[:, :, i] @ S
        out[:, :, i] = (qi * gi.exp()[..., None]) @ S + attn @ v_new
        g_last = gi[..., -1]
        S = S * g_last.exp()[..., None, None] + (ki * (g_last[..., None] - gi).exp()[..., None]).transpose(-1, -2) @ v_new
    out = out.reshape(B, H, n * chunk, V)[:, :, :T].transpose(1, 2)
    return out, S
