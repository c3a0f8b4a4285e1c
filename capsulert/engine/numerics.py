"""Process-wide CUDA numerics the exactness contract relies on, set in one place.

Split-invariant prefill (canonical state on the 64-token grid) needs every GEMM row to get the same bits
whatever the number of rows it is computed with. On the H200 (torch 2.11, bf16) that holds for every 9B
weight shape when cuBLASLt is preferred with a 1-byte workspace (no split-K): with the default cuBLAS
workspace the k/v, o_proj and down projections split K for some row counts and a row's bits change
(bench/RESULTS.md). fla's chunked gated delta rule must not take its
length-dependent SM90 path. Both are read by the libraries once, when CUDA work starts, so they are set
here before the engine touches the device, and checked once the engine stands (check_split_invariant_gemm):
a process that ran CUDA GEMMs before with other settings gets a ConfigError, never silently other bits.
"""
from __future__ import annotations

import os
from typing import Iterator

import torch
import torch.nn.functional as F

from capsulert.errors import ConfigError

CUDA_ENV = {"CUBLASLT_WORKSPACE_SIZE": "1", "FLA_FLASH_QLA": "0"}


def configure_cuda() -> None:
    """Set the CUDA numerics before the first CUDA GEMM of the process (idempotent). A value the user set
    otherwise is refused: it would break the exactness contract."""
    for key, want in CUDA_ENV.items():
        have = os.environ.get(key)
        if have is not None and have != want:
            raise ConfigError(f"{key}={have} is set; capsulert's exactness contract needs {key}={want} on CUDA "
                              "(unset it or set it to that value)")
        os.environ[key] = want
    torch.backends.cuda.preferred_blas_library("cublaslt")


# (offset, rows) of the pieces compared with one GEMM over all the rows on CUDA: whole tiles and the few-row and
# ragged pieces of an append that crosses a grid point inside its piece
CUDA_PIECES = ((0, 64), (64, 64), (64, 192), (512, 256), (64, 1), (64, 7), (128, 33), (64, 65), (448, 100))
# A CPU prefill piece runs on a whole number of rows (the rest padding that writes no state): CPU GEMMs take
# another path for a few rows (gemv at one row) and elementwise kernels finish a ragged tail in scalar code, so
# a row's bits would depend on the piece's row count. The engine pads to the first of these counts at which
# this machine's BLAS gives a row the same bits in every piece (cpu_piece_rows): 8 on the 2-core CI box; a
# 16-thread Xeon's BLAS (torch 2.11) changes a row's bits between 8- and 256-row GEMMs.
CPU_PIECE_ROWS_CHOICES = (8, 16, 32, 64)


def cpu_pieces(rows: int) -> tuple[tuple[int, int], ...]:
    """(offset, rows) of the pieces compared for a CPU whose prefill pieces are padded to whole `rows`: one and
    several multiples of it, at grid-aligned and unaligned offsets."""
    return ((0, rows), (rows, rows), (64, 64 + rows), (128, 5 * rows), (200 // rows * rows, 7 * rows))


def cpu_check_rows(rows: int) -> int:
    """The rows of the one GEMM cpu_pieces(rows) are compared with: all of them, in whole 64-row tiles."""
    return -(-max(a + m for a, m in cpu_pieces(rows)) // 64) * 64


def cpu_piece_rows(weight: torch.Tensor) -> int:
    """The first of CPU_PIECE_ROWS_CHOICES at which GEMM rows over `weight` keep their bits in every piece
    (cpu_pieces); ConfigError when none does."""
    for rows in CPU_PIECE_ROWS_CHOICES:
        if first_split_variant_piece(weight, cpu_check_rows(rows), cpu_pieces(rows)) is None:
            return rows
    raise ConfigError(
        f"GEMM rows on {weight.device} depend on the number of rows computed with them whatever whole number of "
        f"{', '.join(map(str, CPU_PIECE_ROWS_CHOICES))} rows a piece is padded to ({weight.dtype}): this machine's "
        "BLAS breaks split-invariant prefill, on which capsules' exactness rests (a restore + append would not "
        "equal a cold prefill bitwise)")


def first_split_variant_piece(weight: torch.Tensor, rows: int,
                              pieces: tuple[tuple[int, int], ...]) -> tuple[int, int] | None:
    """The first (offset, rows) piece whose GEMM rows over `weight` differ from the same rows of one `rows`-row
    GEMM (on `weight`'s device and dtype), or None when every piece keeps its rows' bits: the property
    split-invariant prefill needs (pieces start on the grid, and the rows past the last grid point get the same
    bits whether their piece started there or earlier)."""
    g = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(rows, weight.shape[1], device=weight.device, dtype=weight.dtype, generator=g)
    full = F.linear(x, weight)
    return next(((a, m) for a, m in pieces if not torch.equal(F.linear(x[a:a + m], weight), full[a:a + m])), None)


def distinct_shapes(weights: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The first weight of each (shape, dtype, stride): a GEMM check needs one of each."""
    seen: set[tuple] = set()
    for w in weights:
        key = (tuple(w.shape), w.dtype, w.stride())
        if key not in seen:
            seen.add(key)
            yield w


def first_row_variant_gemm(weights: list[torch.Tensor], rows: int) -> tuple[tuple[int, ...], int] | None:
    """The first weight shape, and the row count m < `rows`, at which a GEMM of m rows gives other bits than the
    same rows of one `rows`-row GEMM; None when every shape keeps its rows' bits at every count. The condition
    for running a decode step's dense ops on the batch's own rows instead of padding them to `rows` (a batch of
    b sessions then computes each row as the same session alone does). Shapes are checked once each."""
    for w in distinct_shapes(weights):
        bad = first_split_variant_piece(w, rows, tuple((0, m) for m in range(1, rows)))
        if bad is not None:
            return tuple(w.shape), bad[1]
    return None


def first_mixed_variant_gemm(weights: list[torch.Tensor], decode_rows: int,
                             piece_rows: int) -> tuple[tuple[int, ...], int] | None:
    """The first weight shape, and the rows of a mixed step's GEMM (a decode step's m <= decode_rows rows, then
    piece_rows rows of prefill pieces), at which the step's rows or the pieces' get other bits than in
    GEMMs of their own; None when none does. The condition for a decode step and grid re-derivations to share
    one forward (HybridModel.step_with_pieces). Shapes are checked once each."""
    for w in distinct_shapes(weights):
        g = torch.Generator(device=w.device).manual_seed(0)
        x = torch.randn(decode_rows + piece_rows, w.shape[1], device=w.device, dtype=w.dtype, generator=g)
        pieces = x[decode_rows:]
        own = F.linear(pieces, w)
        for m in range(1, decode_rows + 1):
            both = torch.cat([x[:m], pieces])
            mixed = F.linear(both, w)
            if not torch.equal(mixed[:m], F.linear(x[:m], w)) or not torch.equal(mixed[m:], own):
                return tuple(w.shape), m + piece_rows
    return None


def row_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear of x [..., K] with every row its own one-row GEMM, in one batched call: the bits a one-row
    F.linear gives the row where first_row_linear_variant finds none other (a CPU GEMM of several rows runs
    another kernel than a one-row one, gemv, and gives a row other bits)."""
    rows = x.reshape(-1, 1, x.shape[-1])
    out = torch.bmm(rows, w.t().expand(rows.shape[0], -1, -1))
    return out.reshape(*x.shape[:-1], w.shape[0])


def first_row_linear_variant(weights: list[torch.Tensor], rows: int) -> tuple[int, ...] | None:
    """The first weight shape for which row_linear over `rows` rows gives a row other bits than a one-row
    F.linear; None when it keeps every row's bits for every shape (each shape checked once)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    for w in distinct_shapes(weights):
        x = torch.randn(rows, 1, w.shape[1], generator=g).to(device=w.device, dtype=w.dtype)
        alone = torch.cat([F.linear(x[r], w) for r in range(rows)])
        if not torch.equal(row_linear(x, w)[:, 0], alone):
            return tuple(w.shape)
    return None


def check_split_invariant_gemm(weight: torch.Tensor, rows: int = 1024) -> None:
    """first_split_variant_piece over CUDA_PIECES on a CUDA device: ConfigError when a piece changes a row's
    bits, naming the cause: for bf16 the CUDA numerics not set before the process's first GEMM, for another
    dtype the dtype."""
    bad = first_split_variant_piece(weight, rows, CUDA_PIECES)
    if bad is None:
        return
    a, m = bad
    dtype = str(weight.dtype).replace("torch.", "")
    if weight.dtype != torch.bfloat16:
        # cuBLAS keeps a row's bits across row counts for bf16 under the settings above (measured on the
        # H200); for fp32 it does not (a one-row GEMM takes another kernel), whatever the process did before
        why = (f"split-invariant prefill on CUDA holds for bfloat16 weights (cuBLASLt with a 1-byte workspace), "
               f"not for {dtype} on this device: start the engine with dtype='bfloat16'")
    else:
        why = ("split-invariant prefill needs cuBLASLt with a 1-byte workspace, read when the process's first "
               "CUDA GEMM runs. Start the engine before any other CUDA work in the process, or export "
               "CUBLASLT_WORKSPACE_SIZE=1 and TORCH_BLAS_PREFER_CUBLASLT=1 before it starts")
    raise ConfigError(f"GEMM rows on {weight.device} ({dtype}) depend on the number of rows computed with them "
                      f"({m} rows at {a} vs one {rows}-row GEMM): {why}")
