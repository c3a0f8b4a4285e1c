"""flash-linear-attention's chunked gated delta rule, driven so that the recurrent state at every chunk
boundary of a piece comes out in fp32.

fla's public `chunk_gated_delta_rule` returns the final state in fp32 but keeps the states it passes on the
way (h: the state before each 64-token chunk) in the inputs' dtype. A prefill piece that crosses a grid point
needs the state there as a piece that ended there leaves it: the very register values fla's state pass
stores into h, unrounded. So this runs fla's forward stages itself (the fused intra-chunk WY stage, the state
pass, the output stage) with h in fp32, gives the output stage h rounded to bf16 as fla's
own h is (round-to-nearest-even of the same values), and reads the grid state out of h: the state pass runs
once, where a second chunked rule over the piece before the grid point ran before.

The gate cumsum the stages read is ours (kernels/triton_gate_cumsum.py), added in token order: with fla's scan a
piece's padding rows changed its final state's last bits, so a batched prefill (rows padded to the longest) and
a piece alone differed.

The stages are fla internals: `fla_stages()` runs them only under the fla release they were written against
(FLA_RELEASE, pinned in pyproject's `gpu` extra) and otherwise raises a ConfigError naming it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from capsulert.errors import ConfigError
from capsulert.kernels.gated_delta import GATED_DELTA_CHUNK

FLA_RELEASE = "0.6.0"


@dataclass(frozen=True)
class FlaStages:
    intra: Callable
    state_kernel: object  # a Triton kernel: fla's state pass (chunk_gated_delta_rule_fwd_kernel_h_blockdim64)
    output: Callable
    log2_scale: float


def check_fla_release(version: str) -> None:
    """ConfigError unless `version` is the fla release the stages were written against (its internals change
    between releases; a mismatch must not run, or silently fall back)."""
    if version.split("+")[0] != FLA_RELEASE:
        raise ConfigError(f"flash-linear-attention {version} is installed; capsulert runs the internal stages of "
                          f"release {FLA_RELEASE}: pip install flash-linear-attention=={FLA_RELEASE} (or uninstall it "
                          f"to run the plain-torch chunked rule)")


def fla_stages() -> FlaStages | None:
    """fla's forward stages; None when fla is not installed, ConfigError when it is another release or lacks
    them."""
    try:
        import fla
    except ImportError:
        return None
    check_fla_release(getattr(fla, "__version__", "unknown"))
    try:
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_kernel_h_blockdim64
        from fla.ops.common.chunk_o import chunk_fwd_o
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.utils.constant import RCP_LN2
    except ImportError as e:
        raise ConfigError(f"flash-linear-attention {fla.__version__} lacks the chunked gated-delta stages "
                          f"capsulert runs ({e}); install flash-linear-attention=={FLA_RELEASE}") from e
    return FlaStages(chunk_gated_delta_rule_fwd_intra,
                     chunk_gated_delta_rule_fwd_kernel_h_blockdim64, chunk_fwd_o, RCP_LN2)


def chunk_gated_delta_rule_grid(stages: FlaStages, q, k, v, g, beta, initial_state: torch.Tensor,
                                grid_chunk: int | torch.Tensor | None = None):
    """q, k [B, T, H, K] (normalised; q scaled), v [B, T, H, V], in bf16; g (log decay), beta [B, T, H] fp32;
    initial_state [B, H, K, V] fp32. Returns (o [B, T, H, V] bf16, final state, grid state): the grid state
    (fp32, None without grid_chunk) is the state after the first grid_chunk chunks, an int or a [B] device
    tensor, each below the piece's chunk count."""
    import triton

    from capsulert.kernels.triton_gate_cumsum import chunk_gate_cumsum

    # fla's kernels assume contiguous inputs (its public call makes them so)
    q, k, v, g, beta, initial_state = (t.contiguous() for t in (q, k, v, g, beta, initial_state))
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = GATED_DELTA_CHUNK
    gc = chunk_gate_cumsum(g, C, stages.log2_scale)
    w, u, _ = stages.intra(k=k, v=v, g=gc, beta=beta, chunk_size=C)
    # without a grid point the states stay in k's dtype, as fla keeps them: no conversion pass
    h = k.new_empty(B, triton.cdiv(T, C), H, K, V, dtype=k.dtype if grid_chunk is None else torch.float32)
    final = k.new_empty(B, H, K, V, dtype=torch.float32)  # the state pass writes all of it
    v_new = torch.empty_like(u)

    def launch(meta):
        return (triton.cdiv(V, meta["BV"]) * B * H,)
    stages.state_kernel[launch](
        k=k, v=u, w=w, v_new=v_new, g=gc, gk=None, h=h, h0=initial_state, ht=final,
        cu_seqlens=None, chunk_offsets=None, T=T, H=H, HV=H, K=K, V=V, BT=C, STATE_V_FIRST=False,
    )
    o = stages.output(q=q, k=k, v=v_new, h=h if grid_chunk is None else h.to(k.dtype), g=gc, scale=1.0, chunk_size=C)
    if grid_chunk is None:
        return o, final, None
    if isinstance(grid_chunk, int):
        return o, final, h[:, grid_chunk]
    return o, final, h[torch.arange(B, device=h.device), grid_chunk]
