"""Kernel sets: the entry points the model calls, as one frozen bundle chosen by the engine.

`reference_kernels()` is plain torch (the CPU path and the oracle). `cuda_kernels()` swaps in the fast
versions: our Triton kernels for the fused layer stages (norms, gates and the in-place recurrent step, see
kernels/fused.py), the conv update and attention over the static KV, and flash-linear-attention's chunked gated delta rule for prefill when it is installed. Every
entry keeps the state-buffer contract: read a slot's state by `slots`, update it in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from capsulert.kernels import fused, moe
from capsulert.kernels.attention import attention_ref, tiled_attention_ref
from capsulert.kernels.conv import causal_conv1d_ref, causal_conv1d_step_ref, conv_history_at
from capsulert.kernels.gated_delta import GATED_DELTA_CHUNK, chunk_gated_delta_rule_ref


# Raised whenever a change to the CUDA kernels alters the bits a forward pass computes, so capsules made before
# are of another numerics origin (engine/capsules.numerics_origin: restored byte-exact, never shared by block,
# served as a prefix or replayed). 2: prefill attention over absolute 256-key ranges. 3: an MoE layer's
# shared-expert gate computed in its packed projection (engine/packing.py). 4: the shared expert computed in the
# expert kernels, the router's logits in fp32 from fixed K slices (kernels/triton_moe*.py). 5: the attention output
# gate's sigmoid in the attention kernels (kernels/triton_attention.py). 6: the gated delta rule's in-chunk gate
# cumsum added in token order (kernels/triton_gate_cumsum.py), so padding never moves a chunk's decay.
CUDA_KERNEL_BITS = 6


@dataclass(frozen=True)
class KernelSet:
    name: str
    # q and k through their norms and the rotary embedding, k and v into the KV cache (fused.attention_prep_ref)
    attention_prep: Callable
    # both attentions take the layer's output gate: out = o * sigmoid(gate) (attention.output_gate)
    attention: Callable  # decode: one query a slot, batch-invariant
    # prefill: a query row's bits do not depend on how many queries share the piece or on kv_len
    # (split-invariant prefill: the state at every 64-token grid point is the same whatever the pieces)
    prefill_attention: Callable
    conv_prefill: Callable
    conv_step: Callable
    gated_delta_prefill: Callable
    # the elementwise work around the GEMMs (kernels/fused.py), fused into one launch each on CUDA
    add_rms_norm: Callable
    gated_rms_norm: Callable
    silu_mul: Callable
    gated_delta_step_fused: Callable
    gated_delta_prefill_prep: Callable
    # an MoE MLP (kernels/moe.py): the router with the shared expert's gate, then the experts (routed and
    # shared) and the combine
    moe_route: Callable
    moe_experts: Callable
    # pack the projections that read one input into one GEMM (engine/packing.py); off on the CPU reference
    # path, whose bits stay those of the unpacked model
    packed_projections: bool = False


def conv_prefill_ref(x, conv_buf, slots, weight, valid=None, grid=None) -> torch.Tensor:
    """x [B, T, C]; conv_buf [slots, C, K-1] updated in place for `slots`. With `valid` [B], only the
    first valid[b] tokens of a row are real: the new state is the history ending at the last real one.
    `grid` (grid_buf, at): grid_buf[slots] <- the history after the first `at` tokens (an int or [B])."""
    history = conv_buf[slots]
    if grid is not None:
        grid[0].index_copy_(0, slots, conv_history_at(x, history, grid[1]))
    out, new_state = causal_conv1d_ref(x, history, weight)
    if valid is not None:  # the history ending at the last real token
        new_state = conv_history_at(x, history, valid)
    conv_buf.index_copy_(0, slots, new_state)
    return out


def conv_step_ref(x, conv_buf, slots, weight) -> torch.Tensor:
    out, new_state = causal_conv1d_step_ref(x, conv_buf[slots], weight)
    conv_buf.index_copy_(0, slots, new_state)
    return out


def grid_chunks(at):
    """The whole chunks before a grid point `at` tokens into a piece (an int, or [B] device ints in a graph,
    which are on the grid by construction): ValueError for an int off the chunk grid."""
    if isinstance(at, int) and at % GATED_DELTA_CHUNK:
        raise ValueError(f"a grid point {at} tokens into a piece is off the chunk grid")
    return at // GATED_DELTA_CHUNK


def gated_delta_prefill_ref(q, k, v, g, beta, ssm_buf, slots, grid=None) -> torch.Tensor:
    """ssm_buf [slots, H, K, V] fp32, updated in place for `slots`; returns o [B, T, H, V] fp32.
    `grid` (grid_buf, at): grid_buf[slots] <- the state after the first `at` tokens, a whole number of
    chunks (an int, or [B] device ints in a graph): the state a piece ending there leaves (split-invariant
    prefill), so the checkpoint is bitwise the one a cut at the grid point keeps."""
    state = ssm_buf[slots]
    if grid is not None:
        grid_buf, at = grid
        if isinstance(at, int):
            part = [t[:, :grid_chunks(at) * GATED_DELTA_CHUNK] for t in (q, k, v, g, beta)]
        else:  # a graph's fixed shape: the tokens from `at` on neither decay nor write the state
            keep = (torch.arange(q.shape[1], device=q.device)[None, :] < at[:, None]).float()[..., None]
            part = [q, k, v, g * keep, beta * keep]
        grid_buf.index_copy_(0, slots, chunk_gated_delta_rule_ref(*part, state)[1])
    o, new_state = chunk_gated_delta_rule_ref(q, k, v, g, beta, state)
    ssm_buf.index_copy_(0, slots, new_state)
    return o


def reference_kernels() -> KernelSet:
    return KernelSet(
        name="reference",
        attention_prep=fused.attention_prep_ref,
        attention=attention_ref,
        prefill_attention=tiled_attention_ref,
        conv_prefill=conv_prefill_ref,
        conv_step=conv_step_ref,
        gated_delta_prefill=gated_delta_prefill_ref,
        add_rms_norm=fused.add_rms_norm,
        gated_rms_norm=fused.gated_rms_norm,
        silu_mul=fused.silu_mul,
        gated_delta_step_fused=fused.gated_delta_step_fused,
        gated_delta_prefill_prep=fused.gated_delta_prefill_prep,
        moe_route=moe.moe_route,
        moe_experts=moe.moe_experts,
    )


def _fla_prefill():
    import triton

    # fla autotunes its chunked kernels on first use (most of an engine's start-up on a fresh machine); keep
    # the timings in Triton's on-disk cache, next to the compiled kernels, so only the first engine pays.
    # Read when fla's kernels are defined, hence before the import.
    triton.knobs.autotuning.cache = True
    from capsulert.kernels.fla_gated_delta import chunk_gated_delta_rule_grid, fla_stages

    stages = fla_stages()
    if stages is None:
        return None

    def gated_delta_prefill_fla(q, k, v, g, beta, ssm_buf, slots, grid=None) -> torch.Tensor:
        # q is already normalised and scaled (the prefill prep gives q, k, v in bf16, as transformers passes
        # them); fla keeps its state and accumulators in fp32. o stays bf16: gated_rms_norm rounds o to the
        # model dtype first anyway.
        chunk = None if grid is None else grid_chunks(grid[1])
        o, final, at_grid = chunk_gated_delta_rule_grid(stages, q, k, v, g, beta, ssm_buf[slots], chunk)
        ssm_buf.index_copy_(0, slots, final)
        if grid is not None:
            grid[0].index_copy_(0, slots, at_grid)
        return o

    return gated_delta_prefill_fla


def cuda_kernels(use_fla: bool = True, large_moe_tiles: bool = True) -> KernelSet:
    """Triton kernels of ours (+ fla's chunked prefill when installed and asked for). `large_moe_tiles`: the
    expert GEMMs of long pieces run 64-row tiles (only where triton_moe.tiles_agree holds)."""
    from capsulert.kernels.triton_attention import attention, prefill_attention
    from capsulert.kernels.triton_conv import conv_prefill, conv_step
    from capsulert.kernels import triton_fused, triton_moe, triton_moe_route
    from capsulert.kernels.triton_gated_delta_prep import gated_delta_prefill_prep
    from capsulert.kernels.triton_attention_prep import attention_prep

    fla = _fla_prefill() if use_fla else None
    return KernelSet(
        name="triton+fla" if fla else "triton",
        attention_prep=attention_prep,
        attention=attention,
        prefill_attention=prefill_attention,
        conv_prefill=conv_prefill,
        conv_step=conv_step,
        gated_delta_prefill=fla or gated_delta_prefill_ref,
        add_rms_norm=triton_fused.add_rms_norm,
        gated_rms_norm=triton_fused.gated_rms_norm,
        silu_mul=triton_fused.silu_mul,
        gated_delta_step_fused=triton_fused.gated_delta_step_fused,
        # fla reads q, k, v in bf16; the plain-torch chunked rule computes in fp32
        gated_delta_prefill_prep=partial(gated_delta_prefill_prep,
                                         out_dtype=torch.bfloat16 if fla else torch.float32),
        moe_route=triton_moe_route.moe_route,
        moe_experts=triton_moe.moe_experts if large_moe_tiles else partial(triton_moe.moe_experts, large_from=None),
        packed_projections=True,
    )
