"""Depthwise causal conv1d over the Gated DeltaNet projections, plain-torch reference versions.

The conv state of a slot holds the last K-1 *inputs* (pre-activation), channels first: [C, K-1].
Output is silu(conv(x)). Prefill and single-step forms agree with a conv over the concatenated history.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_ref(x, conv_state, weight):
    """x [B, T, C], conv_state [B, C, K-1], weight [C, K] -> (silu(conv) [B, T, C], new state [B, C, K-1])."""
    T = x.shape[1]
    history = torch.cat([conv_state, x.transpose(1, 2)], dim=-1)
    out = F.conv1d(history, weight[:, None, :], groups=weight.shape[0])
    return F.silu(out[:, :, -T:]).transpose(1, 2), history[:, :, -conv_state.shape[-1]:]


def causal_conv1d_step_ref(x, conv_state, weight):
    """x [B, C] one token per slot; conv_state [B, C, K-1] -> (out [B, C], new state)."""
    history = torch.cat([conv_state, x[:, :, None]], dim=-1)
    out = (history * weight).sum(-1)
    return F.silu(out), history[:, :, 1:]


def conv_history_at(x, conv_state, at):
    """The conv state after the first `at` tokens of x [B, T, C] from conv_state [B, C, K-1]: the last K-1
    inputs before token `at` (an int, or a [B] tensor of per-row positions, for a CUDA graph)."""
    width = conv_state.shape[-1]
    full = torch.cat([conv_state, x.transpose(1, 2)], dim=-1)
    if isinstance(at, int):
        return full[:, :, at:at + width]
    idx = (at[:, None] + torch.arange(width, device=x.device))[:, None, :].expand(-1, full.shape[1], -1)
    return full.gather(-1, idx)
