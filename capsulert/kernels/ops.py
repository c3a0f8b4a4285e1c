"""The kernel entry points the model calls: state-buffer plumbing (gather by slot, update in place)
around the reference kernels. Fast GPU versions register here with the same signatures."""
from __future__ import annotations

import torch

from capsulert.kernels.attention import attention_ref, write_kv_ref
from capsulert.kernels.conv import causal_conv1d_ref, causal_conv1d_step_ref
from capsulert.kernels.gated_delta import chunk_gated_delta_rule_ref, gated_delta_step_ref


def write_kv(kv_k, kv_v, slots, start, k, v) -> None:
    write_kv_ref(kv_k, kv_v, slots, start, k, v)


def attention(q, kv_k, kv_v, slots, start, kv_len: int, scale: float) -> torch.Tensor:
    return attention_ref(q, kv_k, kv_v, slots, start, kv_len, scale)


def conv_prefill(x, conv_buf, slots, weight, valid=None) -> torch.Tensor:
    """x [B, T, C]; conv_buf [slots, C, K-1] updated in place for `slots`. With `valid` [B], only the
    first valid[b] tokens of a row are real: the new state is the history ending at the last real one."""
    history = conv_buf[slots]
    out, new_state = causal_conv1d_ref(x, history, weight)
    if valid is not None:
        width = history.shape[-1]
        full = torch.cat([history, x.transpose(1, 2)], dim=-1)
        idx = (valid[:, None] + torch.arange(width, device=x.device))[:, None, :].expand(-1, full.shape[1], -1)
        new_state = full.gather(-1, idx)
    conv_buf.index_copy_(0, slots, new_state)
    return out


def conv_step(x, conv_buf, slots, weight) -> torch.Tensor:
    out, new_state = causal_conv1d_step_ref(x, conv_buf[slots], weight)
    conv_buf.index_copy_(0, slots, new_state)
    return out


def gated_delta_prefill(q, k, v, g, beta, ssm_buf, slots) -> torch.Tensor:
    """ssm_buf [slots, H, K, V] fp32, updated in place for `slots`; returns o [B, T, H, V] fp32."""
    o, new_state = chunk_gated_delta_rule_ref(q, k, v, g, beta, ssm_buf[slots])
    ssm_buf.index_copy_(0, slots, new_state)
    return o


def gated_delta_step(q, k, v, g, beta, ssm_buf, slots) -> torch.Tensor:
    o, new_state = gated_delta_step_ref(q, k, v, g, beta, ssm_buf[slots])
    ssm_buf.index_copy_(0, slots, new_state)
    return o
