"""Grouped copies (capsulert/kernels/triton_copy.py) against plain copies, over labelled pairs.

The CPU tests check the flattening: the runs table plan_runs builds, each run copied with memmove, plus the
pairs it leaves for copy_, must give bitwise what plain copies give. The gpu-marked tests run the
Triton kernel over the same pairs (on a CUDA device, or on the CPU under TRITON_INTERPRET=1).
"""
import ctypes

import numpy as np
import pytest
import torch

from capsulert.kernels.triton_copy import (
    CHUNK_BYTES, MAX_ALIGN, Runs, Strided, check_copy_pairs, copy_pairs, copy_runs, plan_runs)

L, SLOTS, T, H, D = 3, 4, 320, 2, 16  # a KV buffer [layers, slots, max_seq, heads, dim], small


def _rand(shape, dtype, g, dev):
    t = torch.randn(shape, generator=g) if dtype.is_floating_point else torch.randint(0, 100, shape, generator=g)
    return t.to(dtype).to(dev)


def _restore_pairs(dtype, g, dev, slot=2, blocks=3, tail=7):
    """A restore's pairs: blocks of 64 rows and a tail into a slot's rows (strided dst), a state tensor."""
    kv = torch.zeros(L, SLOTS, T, H, D, dtype=dtype, device=dev)
    ssm = torch.zeros(L, SLOTS, 2, 8, 8, dtype=torch.float32, device=dev)
    pairs = [(kv[:, slot, i * 64:(i + 1) * 64], _rand((L, 64, H, D), dtype, g, dev)) for i in range(blocks)]
    pairs.append((kv[:, slot, blocks * 64:blocks * 64 + tail], _rand((L, tail, H, D), dtype, g, dev)))
    pairs.append((ssm[:, slot], _rand((L, 2, 8, 8), torch.float32, g, dev)))
    return pairs


def _snapshot_pairs(dtype, g, dev):
    """The other direction: a slot's strided rows into fresh contiguous tensors."""
    kv = _rand((L, SLOTS, T, H, D), dtype, g, dev)
    return [(torch.empty(L, 64, H, D, dtype=dtype, device=dev), kv[:, 1, i * 64:(i + 1) * 64]) for i in range(4)]


def _mixed(g, dev):
    return (_restore_pairs(torch.bfloat16, g, dev) + _snapshot_pairs(torch.float32, g, dev)
            + [(torch.zeros(5, dtype=torch.int32, device=dev), _rand((5,), torch.int32, g, dev))])


def _odd(g, dev):
    """Odd widths: runs whose addresses and lengths are multiples of 2 or 1 byte only."""
    buf = torch.zeros(4, 3, 149, dtype=torch.uint8, device=dev)
    half = torch.zeros(4, 3, 101, dtype=torch.float16, device=dev)
    return [(buf[:, 1], _rand((4, 149), torch.uint8, g, dev)),
            (half[:, 2, 1:], _rand((4, 100), torch.float16, g, dev))]


def _empty(g, dev):
    kv = torch.zeros(L, SLOTS, T, H, D, device=dev)
    return [(kv[:, 0, 5:5], torch.zeros(L, 0, H, D, device=dev)),
            (torch.zeros(0, device=dev), torch.zeros(0, device=dev))]


def _large(g, dev):
    """Runs longer than a chunk: the 9B's recurrent state is 2 MiB a layer."""
    ssm = torch.zeros(2, 3, 4, 128, 160, dtype=torch.float32, device=dev)
    return [(ssm[:, 1], _rand((2, 4, 128, 160), torch.float32, g, dev))]


def _left_for_copy(g, dev):
    """Pairs that are not sets of runs: copy_ copies them."""
    a = torch.zeros(8, 6, device=dev)
    return [
        (a.t(), _rand((6, 8), torch.float32, g, dev)),  # no contiguous inner dimension in dst
        (torch.zeros(4, 4, device=dev), _rand((4, 4), torch.float64, g, dev)),  # dtypes differ (copy_ converts)
        (torch.zeros(3, 5, device=dev), _rand((5,), torch.float32, g, dev)),  # shapes differ (copy_ broadcasts)
        (torch.zeros(6, 64, device=dev), _rand((64,), torch.float32, g, dev).expand(6, 64)),  # a src stride of 0
        (torch.zeros(4, 3, 8, device=dev)[:, 1], _rand((4, 8), torch.float32, g, dev)),  # runs too short for a row
        (torch.zeros(4, 32, dtype=torch.complex64, device=dev),  # a lazy conjugation (copy_ resolves it)
         torch.view_as_complex(_rand((4, 32, 2), torch.float32, g, dev)).conj()),
    ]


CASES = {
    "restore-bf16": lambda g, dev: _restore_pairs(torch.bfloat16, g, dev),
    "restore-fp32": lambda g, dev: _restore_pairs(torch.float32, g, dev),
    "restore-one-block-no-tail": lambda g, dev: _restore_pairs(torch.bfloat16, g, dev, blocks=1, tail=0),
    "snapshot-strided-src": lambda g, dev: _snapshot_pairs(torch.bfloat16, g, dev),
    "contiguous": lambda g, dev: [(torch.zeros(5, 7, 9, device=dev), _rand((5, 7, 9), torch.float32, g, dev))],
    "mixed-dtypes": _mixed,
    "odd-alignment": _odd,
    "empty": _empty,
    "size-one-dims": lambda g, dev: [(torch.zeros(1, 4, 1, 32, device=dev)[:, 1:3],
                                      _rand((1, 2, 1, 32), torch.float32, g, dev))],
    "one-element": lambda g, dev: [(torch.zeros(3, 3, device=dev)[1, 2], _rand((), torch.float32, g, dev))],
    "large-runs": _large,
    "left-for-copy": _left_for_copy,
}


def _case(name, dev="cpu"):
    return CASES[name](torch.Generator().manual_seed(0), dev)


def _reference(pairs):
    """What plain copy_ gives: the pairs' destination bases, copied, with each pair copied into the same
    view of the copy. Returns (those copies, the original bases)."""
    bases = {}
    for d, _ in pairs:
        base = d._base if d._base is not None else d
        bases.setdefault(id(base), (base, base.clone()))

    def twin(d):
        base, copy = bases[id(d._base if d._base is not None else d)]
        return copy.as_strided(d.shape, d.stride(), d.storage_offset() - base.storage_offset())
    ref = [(twin(d), s) for d, s in pairs]
    for d, s in ref:
        d.copy_(s)
    return [copy for _, copy in bases.values()], [base for base, _ in bases.values()]


def _memmove(runs: Runs) -> None:
    for src, dst, n in zip(runs.src.tolist(), runs.dst.tolist(), runs.nbytes.tolist()):
        ctypes.memmove(dst, src, n)


@pytest.mark.parametrize("name", CASES, ids=CASES.keys())
def test_runs_and_leftover_pairs_copy_what_plain_copies_do(name):
    pairs = _case(name)
    want, bases = _reference(pairs)
    runs, rest = plan_runs(pairs, torch.device("cpu"))
    _memmove(runs)
    for d, s in rest:
        d.copy_(s)
    for got, w in zip(bases, want):
        assert torch.equal(got, w)


@pytest.mark.parametrize("name", CASES, ids=CASES.keys())
def test_copy_pairs_on_the_cpu_is_foreach_copy(name):
    pairs = _case(name)
    want, bases = _reference(pairs)
    copy_pairs(pairs)
    for got, w in zip(bases, want):
        assert torch.equal(got, w)


def _not_made(t: torch.Tensor) -> Strided:
    """t as a view not made, over a base that starts past its storage's start (as_strided's offset is counted
    from the storage's start, not the base's)."""
    base = (t._base if t._base is not None else t).reshape(-1)[1:]
    return Strided(base, tuple(t.shape), t.stride(), t.storage_offset())


@pytest.mark.parametrize("name", CASES, ids=CASES.keys())
def test_views_not_made_plan_and_copy_what_their_views_do(name):
    pairs = _case(name)
    # a view with a lazy conjugation is more than its storage's bytes: such a source stays a tensor
    lazy = [(_not_made(d), _not_made(s) if s._base is not None and not s.is_conj() else s) for d, s in pairs]
    for (d, s), (ld, ls) in zip(pairs, lazy):
        for t, x in ((d, ld), (s, ls)):
            v = x.view() if isinstance(x, Strided) else x
            assert (v.data_ptr(), v.shape, v.stride()) == (t.data_ptr(), t.shape, t.stride())
    cpu = torch.device("cpu")
    (runs, rest), (lruns, lrest) = plan_runs(pairs, cpu), plan_runs(lazy, cpu)
    for f in ("src", "dst", "nbytes"):
        assert (getattr(runs, f) == getattr(lruns, f)).all(), f
    assert len(rest) == len(lrest)
    want, bases = _reference(pairs)
    copy_pairs(lazy)  # the CPU copies the views they stand for
    for got, w in zip(bases, want):
        assert torch.equal(got, w)


def test_a_strided_slot_view_is_one_run_per_layer():
    pairs = _restore_pairs(torch.bfloat16, torch.Generator().manual_seed(0), "cpu", blocks=2, tail=5)
    runs, rest = plan_runs(pairs, torch.device("cpu"))
    assert not rest
    row = H * D * 2
    assert runs.count == 2 * L + L + L  # blocks and tail: a run per layer each; ssm: a run per layer
    assert runs.nbytes.tolist() == [64 * row] * (2 * L) + [5 * row] * L + [2 * 8 * 8 * 4] * L
    kv = pairs[0][0]
    assert runs.dst[:L].tolist() == [kv.data_ptr() + i * kv.stride(0) * 2 for i in range(L)]


def test_only_the_pairs_that_are_not_runs_are_left():
    pairs = _case("left-for-copy") + _case("contiguous")
    runs, rest = plan_runs(pairs, torch.device("cpu"))
    assert len(rest) == len(_case("left-for-copy")) and runs.count == 1


def test_chunks_cover_the_same_bytes_and_keep_the_alignment():
    runs = Runs(np.array([0, 1 << 20], np.int64), np.array([1 << 30, 1 << 31], np.int64),
                np.array([3 * CHUNK_BYTES + 48, 16], np.int64))
    chunks = runs.chunked()
    assert chunks.count == 5 and int(chunks.nbytes.max()) <= CHUNK_BYTES
    assert int(chunks.nbytes.sum()) == int(runs.nbytes.sum())
    assert chunks.src.tolist() == [0, CHUNK_BYTES, 2 * CHUNK_BYTES, 3 * CHUNK_BYTES, 1 << 20]
    assert chunks.dst[3] - chunks.src[3] == 1 << 30
    assert chunks.align == runs.align == 16


def test_alignment_is_the_largest_power_of_two_dividing_everything():
    def runs(*xs):
        return Runs(np.array([xs[0]], np.int64), np.array([xs[1]], np.int64), np.array([xs[2]], np.int64))
    assert runs(4096, 8192, 1024).align == MAX_ALIGN
    assert runs(4096, 8192 + 4, 1024).align == 4
    assert runs(4096, 8192, 6).align == 2
    assert runs(4097, 8192, 1024).align == 1


# ------------------------------------------------------------------ the Triton kernel (gpu-marked)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_CASES = [n for n in CASES if n != "left-for-copy"]


@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_or_interpreter")
@pytest.mark.parametrize("lazy", [False, True], ids=["views", "views-not-made"])
@pytest.mark.parametrize("name", KERNEL_CASES, ids=KERNEL_CASES)
def test_kernel_copies_bitwise_what_foreach_copy_does(name, lazy):
    pairs = _case(name, DEVICE)
    want, bases = _reference(pairs)
    planned = [(_not_made(d), _not_made(s) if s._base is not None else s) for d, s in pairs] if lazy else pairs
    runs, rest = plan_runs(planned, torch.device(DEVICE))
    assert not rest
    copy_runs(runs, torch.device(DEVICE))
    for got, w in zip(bases, want):
        assert torch.equal(got.cpu(), w.cpu())


@pytest.fixture
def cuda_device():
    if not torch.cuda.is_available():
        pytest.fail("copy_pairs launches the kernel for CUDA tensors only: run with -m gpu on the GPU machine")


@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_device")
def test_the_engine_start_check_passes_on_this_gpu():
    check_copy_pairs(torch.device("cuda"))


def test_the_engine_start_check_passes_on_the_cpu_reference():
    check_copy_pairs(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_device")
@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_copy_pairs_on_cuda_is_bitwise_the_reference(name):
    pairs = _case(name, "cuda")
    want, bases = _reference(pairs)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # ordered on the current stream, whichever it is
        side.wait_stream(torch.cuda.default_stream())
        copy_pairs(pairs)
    torch.cuda.current_stream().wait_stream(side)
    for got, w in zip(bases, want):
        assert torch.equal(got, w)
