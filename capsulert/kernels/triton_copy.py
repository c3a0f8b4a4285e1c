"""Grouped copies: many (dst, src) tensor pairs in one kernel launch.

A restore writes a capsule's pieces into a slot: each KV block into the rows it covers of the slot's
[layers, max_seq, heads, dim] buffers (a view strided across layers), then the tail and the recurrent
state, ~70 pairs for a 2048-token capsule. `torch._foreach_copy_` launches one copy kernel per strided pair,
and on the GPU those launches, not the bytes, were the restore's cost. Each such pair is a few contiguous
runs of bytes (a slot view [L, rows, ...] is L runs), so `copy_pairs` flattens the pairs into one table of
runs (source address, destination address, length), cut into chunks of at most CHUNK_BYTES, sends the table
to the device in one non-blocking copy from pinned memory, and one Triton program copies each chunk. All of
it is ordered on the current stream; the host never waits. A pair that is not a set of runs (dtypes or
shapes that differ, complex values, another device, an inner dimension that is not contiguous in both) is
copied with `copy_`.

The pairs must not overlap one another (as for torch._foreach_copy_). On the CPU, and where triton is not
installed, copy_pairs is torch._foreach_copy_, the reference.

    copy_pairs(pairs)              copy every (dst, src) pair (tensors, or Strided: views not made yet)
    plan_runs(pairs, device)       the runs table of the pairs on `device` and the pairs left for copy_
    copy_runs(runs, device)        launch the kernel over a runs table
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU install has no triton: copy_pairs copies with torch there
    triton = tl = None


class Strided(NamedTuple):
    """A view of `base`'s storage not made yet: what base.as_strided(shape, stride, offset) would give (offset in
    elements from the start of the storage, as as_strided takes it). A crowd's restore named ~100 views a
    capsule (its KV runs, their slab rows, the slot's rows); on the GPU the plan reads only their addresses and
    strides, and making each view cost more host time than reading it. Where a copy needs the tensor (the CPU,
    a pair left to copy_), `view()` makes it. (A tuple: a restore makes thousands, and a frozen dataclass
    costs several times a tuple to build.)"""

    base: torch.Tensor
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def view(self) -> torch.Tensor:
        return self.base.as_strided(self.shape, self.stride, self.offset)


Pair = tuple["torch.Tensor | Strided", "torch.Tensor | Strided"]  # (dst, src)


def as_tensor(x: "torch.Tensor | Strided") -> torch.Tensor:
    return x.view() if type(x) is Strided else x


def _described(x: "torch.Tensor | Strided", bases: dict) -> tuple[torch.dtype, tuple, tuple, int, int]:
    """dtype, shape, strides, data address and device index (-1: the CPU) of a tensor or a view not made;
    `bases`: by id, what a call has read of the bases of views not made (a restore's share a few bases)."""
    if type(x) is Strided:
        b = bases.get(id(x.base))
        if b is None:
            t = x.base
            size = t.element_size()
            b = bases[id(t)] = (t.dtype, t.data_ptr() - t.storage_offset() * size, size, t.get_device())
        return b[0], x.shape, x.stride, b[1] + x.offset * b[2], b[3]
    return x.dtype, x.shape, x.stride(), x.data_ptr(), x.get_device()

CHUNK_BYTES = 64 * 1024  # the most one program copies: a 2 MiB recurrent-state run spreads over 32 programs
BLOCK_BYTES = 16 * 1024  # bytes a program moves per loop step
MAX_ALIGN = 16  # the widest access the kernel is told it may vectorize to
MIN_RUN_BYTES = 128  # a pair cut into runs shorter than this is copied by copy_ (the table would outgrow it)


def _jit(fn):
    return triton.jit(do_not_specialize=["n_runs"])(fn) if triton is not None else fn


@_jit
def _copy_runs_kernel(table, n_runs, UNIT: tl.constexpr, ALIGN: tl.constexpr, VEC: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Program i copies run i of the table [3, n_runs] int64: source address, destination address (bytes,
    multiples of ALIGN) and length in UNIT elements (a multiple of VEC = ALIGN / UNIT's size)."""
    i = tl.program_id(0)
    # the hints on the pointers (not on the integers they are cast from) let the accesses be ALIGN bytes wide
    src = tl.multiple_of(tl.load(table + i).to(tl.pointer_type(UNIT)), ALIGN)
    dst = tl.multiple_of(tl.load(table + n_runs + i).to(tl.pointer_type(UNIT)), ALIGN)
    n = tl.multiple_of(tl.load(table + 2 * n_runs + i), VEC)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: a key of the pattern cache
class RunLayout:
    """Where the contiguous runs of a pair start in dst and in src (byte offsets from their data pointers,
    one entry per run) and how many bytes each run holds."""

    dst: np.ndarray
    src: np.ndarray
    nbytes: np.ndarray


def chunk_index(nbytes: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray] | None:
    """For runs of these lengths cut into chunks of at most `limit` bytes: each chunk's run and its byte
    offset in that run (None: every run fits one chunk)."""
    k = (nbytes + limit - 1) // limit
    if k.size == 0 or int(k.max()) <= 1:
        return None
    idx = np.repeat(np.arange(k.size), k)
    return idx, (np.arange(idx.size) - np.repeat(np.cumsum(k) - k, k)) * limit


@dataclass(frozen=True)
class Runs:
    """A table of byte runs to copy: source and destination addresses and lengths (int64 arrays)."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray

    @property
    def count(self) -> int:
        return int(self.nbytes.size)

    @property
    def align(self) -> int:
        """The largest power of two up to MAX_ALIGN dividing every address and length."""
        bits = int(np.bitwise_or.reduce(self.src) | np.bitwise_or.reduce(self.dst) |
                   np.bitwise_or.reduce(self.nbytes)) if self.count else 0
        return min(bits & -bits, MAX_ALIGN) if bits else MAX_ALIGN

    def chunked(self, limit: int = CHUNK_BYTES) -> "Runs":
        """The same bytes as runs of at most `limit` bytes (limit: a multiple of MAX_ALIGN, so the
        alignment holds)."""
        cut = chunk_index(self.nbytes, limit)
        if cut is None:
            return self
        idx, step = cut
        return Runs(self.src[idx] + step, self.dst[idx] + step, np.minimum(self.nbytes[idx] - step, limit))


@dataclass(frozen=True, eq=False)
class Pattern:
    """The chunks of a sequence of pair layouts: each chunk's pair, its byte offsets from that pair's dst
    and src pointers, and its length. A restore of the same shape repeats the same sequence, so the table
    of a call is two gathers and two adds over the pairs' pointers."""

    pair: np.ndarray
    dst: np.ndarray
    src: np.ndarray
    nbytes: np.ndarray


@functools.lru_cache(maxsize=256)
def _pattern(layouts: tuple[RunLayout, ...]) -> Pattern:
    if not layouts:
        empty = np.zeros(0, np.int64)
        return Pattern(empty, empty, empty, empty)
    counts = np.fromiter((lay.nbytes.size for lay in layouts), np.int64, len(layouts))
    pair = np.repeat(np.arange(len(layouts)), counts)
    dst, src, nbytes = (np.concatenate([getattr(lay, f) for lay in layouts]) for f in ("dst", "src", "nbytes"))
    cut = chunk_index(nbytes, CHUNK_BYTES)
    if cut is None:
        return Pattern(pair, dst, src, nbytes)
    idx, step = cut
    return Pattern(pair[idx], dst[idx] + step, src[idx] + step, np.minimum(nbytes[idx] - step, CHUNK_BYTES))


def run_layout(shape: tuple[int, ...], dst_stride: tuple[int, ...], src_stride: tuple[int, ...],
               itemsize: int) -> RunLayout | None:
    """The runs of a copy between two tensors of `shape` with these strides (elements), or None when the
    copy is not a set of runs worth a table entry each: no inner dimension contiguous in both, runs shorter
    than MIN_RUN_BYTES, negative or zero strides, or destination runs that overlap."""
    if 0 in shape:
        empty = np.zeros(0, np.int64)
        return RunLayout(empty, empty, empty)
    dims: list[tuple[int, int, int]] = []  # (size, dst stride, src stride), innermost first, merged
    for n, a, b in zip(reversed(shape), reversed(dst_stride), reversed(src_stride)):
        if n == 1:
            continue
        if dims and a == dims[-1][1] * dims[-1][0] and b == dims[-1][2] * dims[-1][0]:
            dims[-1] = (dims[-1][0] * n, dims[-1][1], dims[-1][2])
        else:
            dims.append((n, a, b))
    if not dims:  # one element
        return RunLayout(np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, itemsize, np.int64))
    inner, outer = dims[0], dims[1:]
    if inner[1] != 1 or inner[2] != 1 or any(a <= 0 or b <= 0 for _, a, b in outer):
        return None
    run = inner[0] * itemsize
    dst, src = np.zeros(1, np.int64), np.zeros(1, np.int64)
    for n, a, b in outer:
        dst = (dst[None, :] + np.arange(n, dtype=np.int64)[:, None] * (a * itemsize)).ravel()
        src = (src[None, :] + np.arange(n, dtype=np.int64)[:, None] * (b * itemsize)).ravel()
    if dst.size > 1 and (run < MIN_RUN_BYTES or int(np.diff(np.sort(dst)).min()) < run):
        return None
    return RunLayout(dst, src, np.full(dst.size, run, np.int64))


_LAYOUTS: dict[tuple, RunLayout | None] = {}  # by (dtypes, shapes, strides) of a pair: few distinct per engine
_MAX_LAYOUTS = 4096


def _pair_layout(dd: torch.dtype, sd: torch.dtype, dshape: tuple, sshape: tuple, dstride: tuple,
                 sstride: tuple) -> RunLayout | None:
    """The runs of a pair (None: copy_ copies it), looked up by its dtypes, shapes and strides."""
    key = (dd, sd, dshape, sshape, dstride, sstride)
    try:
        return _LAYOUTS[key]
    except KeyError:
        pass
    if len(_LAYOUTS) >= _MAX_LAYOUTS:  # the patterns keep the layouts they hold alive
        _LAYOUTS.clear()
    # copy_ converts dtypes, broadcasts shapes and resolves a complex tensor's lazy conjugation: not bytes
    plain = dd == sd and tuple(dshape) == tuple(sshape) and not dd.is_complex
    layout = _LAYOUTS[key] = run_layout(tuple(dshape), tuple(dstride), tuple(sstride), dd.itemsize) if plain else None
    return layout


def plan_runs(pairs: Sequence[Pair], device: torch.device) -> tuple[Runs, list[Pair]]:
    """The byte runs, of at most CHUNK_BYTES each, that copy the pairs of equal shape and dtype on
    `device`, and the pairs left for copy_. Host work per pair is a few attribute reads and a dict lookup;
    the table is a handful of numpy ops over all pairs together (layouts and patterns are cached)."""
    index = -1 if device.type == "cpu" else (device.index if device.index is not None else torch.cuda.current_device())
    dptr, sptr, layouts, rest, bases = [], [], [], [], {}
    for d, s in pairs:
        dd, dshape, dstride, daddr, ddev = _described(d, bases)
        sd, sshape, sstride, saddr, sdev = _described(s, bases)
        layout = _pair_layout(dd, sd, dshape, sshape, dstride, sstride)
        if layout is None or ddev != index or sdev != index:
            rest.append((d, s))
            continue
        dptr.append(daddr)
        sptr.append(saddr)
        layouts.append(layout)
    pat = _pattern(tuple(layouts))
    src, dst = (np.array(ptrs, np.int64)[pat.pair] for ptrs in (sptr, dptr))
    return Runs(src + pat.src, dst + pat.dst, pat.nbytes), rest


UNIT_TYPES = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def copy_runs(runs: Runs, device: torch.device) -> None:
    """Copy a runs table (runs of at most CHUNK_BYTES: plan_runs's, or Runs.chunked()) on `device` (CUDA,
    or the CPU under TRITON_INTERPRET=1): the table goes to the device in one non-blocking copy from pinned
    memory (the caching host allocator keeps that memory until the copy has read it), then one launch, a
    program a run."""
    if runs.count == 0:
        return
    align = runs.align
    unit = min(align, 8)
    host = torch.empty((3, runs.count), dtype=torch.int64, pin_memory=device.type == "cuda")
    table = host.numpy()
    table[0], table[1], table[2] = runs.src, runs.dst, runs.nbytes // unit
    dev_table = host.to(device, non_blocking=True)
    _copy_runs_kernel[(runs.count,)](dev_table, runs.count, UNIT=getattr(tl, UNIT_TYPES[unit]), ALIGN=align,
                                     VEC=align // unit, BLOCK=BLOCK_BYTES // unit, num_warps=4)


def copy_pairs(pairs: Sequence[Pair]) -> None:
    """Copy each src into its dst, like torch._foreach_copy_(dsts, srcs) (which it is on the CPU): on CUDA
    the pairs that are sets of runs go in one Triton launch, the others through copy_, all stream-ordered."""
    if not pairs:
        return
    first = pairs[0][0]
    device = first.base.device if type(first) is Strided else first.device
    if triton is None or device.type != "cuda":
        torch._foreach_copy_([as_tensor(d) for d, _ in pairs], [as_tensor(s) for _, s in pairs])
        return
    runs, rest = plan_runs(pairs, device)
    if runs.count:
        with torch.cuda.device(device):  # Triton launches on the current device's current stream
            copy_runs(runs, device)
    for d, s in rest:
        as_tensor(d).copy_(as_tensor(s))


def check_copy_pairs(device: torch.device) -> None:
    """ConfigError unless copy_pairs copies a restore's kinds of pairs (a slot's rows strided across layers,
    whole blocks, a state run longer than a chunk, a pair left to copy_) on `device` bitwise as copy_ does.
    Restores move every capsule byte through it; an engine checks it once at start (a few small copies)."""
    from capsulert.errors import ConfigError

    g = torch.Generator(device=device).manual_seed(0)
    slot_buf = torch.zeros(3, 4, 96, 2, 8, dtype=torch.bfloat16, device=device)  # [layers, slots, rows, heads, dim]
    blocks = [torch.randn(3, 64, 2, 8, generator=g, device=device).to(torch.bfloat16) for _ in range(2)]
    state = torch.randn(2, CHUNK_BYTES // 4 + 16, generator=g, device=device)
    state_dst = torch.zeros_like(state)
    odd_src = torch.randn(5, 3, generator=g, device=device)
    odd_dst = torch.zeros(3, 5, device=device).t()  # not a set of runs: left to copy_
    pairs = [(slot_buf[:, 1, :64], blocks[0]), (slot_buf[:, 2, 32:96], blocks[1]), (state_dst, state),
             (odd_dst, odd_src)]
    copy_pairs(pairs)
    want = torch.zeros_like(slot_buf)
    want[:, 1, :64], want[:, 2, 32:96] = blocks[0], blocks[1]
    if not (torch.equal(slot_buf, want) and torch.equal(state_dst, state) and torch.equal(odd_dst, odd_src)):
        raise ConfigError(f"the grouped copy kernel (kernels/triton_copy.py) does not copy bytes exactly on {device} "
                          f"({torch.cuda.get_device_name(device)}, triton {triton.__version__}): capsule restores "
                          "would be corrupted; run the CPU device or report this GPU/triton combination")
