"""The prefill-piece kernels of the Gated DeltaNet layer against their plain-torch references, over labelled
shapes: the preparation of the chunked rule's inputs (kernels/triton_gated_delta_prep.py against
kernels/fused.gated_delta_prefill_prep) and the conv of a padded piece (kernels/triton_conv.conv_prefill with
`valid`, against kernels/ops.conv_prefill_ref).

Split-invariant prefill rests on these being row-wise: a token's outputs are bitwise the same whatever piece
it is computed in (how many tokens share it, where it sits), and a piece split in two gives bitwise the
outputs and the conv state of one piece. Those are compared bitwise; the values against the references within
a tolerance (the kernels compute in fp32 and round once).

Runs on a CUDA device, or on CPU under Triton's interpreter (TRITON_INTERPRET=1, the small shapes only).
"""
import pytest
import torch

import triton  # noqa: F401  (tests/conftest.py ignores this module where triton is not installed)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_or_interpreter")]

from capsulert.kernels import fused as ref  # noqa: E402
from capsulert.kernels import triton_attention  # noqa: E402
from capsulert.kernels.attention import attention_ref  # noqa: E402
from capsulert.kernels.ops import conv_prefill_ref  # noqa: E402
from capsulert.kernels.triton_conv import conv_prefill  # noqa: E402
from capsulert.kernels.triton_gated_delta_prep import gated_delta_prefill_prep, prep_launch_config  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _randn(*shape, seed, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEVICE)


# ---------------------------------------------------------------- prefill preparation

PREP_SHAPES = {  # R, T, Hk, Hv, Dk, Dv
    "hk2-hv2-d16": (1, 5, 2, 2, 16, 16),
    "hk1-hv3-k24-v80-ragged": (2, 7, 1, 3, 24, 80),
    "hk2-hv4-k16-v32-rows": (3, 4, 2, 4, 16, 32),
    **({"9b-piece": (1, 96, 16, 32, 128, 128), "35b-a3b-piece": (1, 64, 16, 32, 128, 128)} if CUDA else {}),
}


def _prep_inputs(R, T, Hk, Hv, Dk, Dv, seed=0, dtype=torch.bfloat16):
    """As the model gets them: column slices of one packed projection output [mixed | b | a | ...]."""
    C = 2 * Hk * Dk + Hv * Dv
    packed = _randn(R, T, C + 2 * Hv + 8, seed=seed, dtype=dtype)
    mixed, b, a = packed[..., :C], packed[..., C:C + Hv], packed[..., C + Hv:C + 2 * Hv] * 3.0
    a[0, 0, 0] = 24.0  # both softplus regimes
    a[-1, -1, -1] = -40.0
    neg_A = -_randn(Hv, seed=seed + 3).exp()
    dt_bias = _randn(Hv, seed=seed + 4, dtype=dtype, scale=0.5)
    return mixed, a, b, neg_A, dt_bias


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16-out", "fp32-out"])
@pytest.mark.parametrize("padded", [False, True], ids=["all-real", "padded"])
@pytest.mark.parametrize("shape", PREP_SHAPES.values(), ids=PREP_SHAPES.keys())
def test_prefill_prep_matches_the_reference(shape, padded, out_dtype):
    R, T, Hk, Hv, Dk, Dv = shape
    mixed, a, b, neg_A, dt_bias = _prep_inputs(R, T, Hk, Hv, Dk, Dv)
    valid = torch.tensor([max(1, T - 1 - r) for r in range(R)], device=DEVICE) if padded else None
    want = ref.gated_delta_prefill_prep(mixed, a, b, neg_A, dt_bias, valid, Hk, Dk, Dv)
    got = gated_delta_prefill_prep(mixed, a, b, neg_A, dt_bias, valid, Hk, Dk, Dv, out_dtype=out_dtype)
    for name, g, w in zip("qkv", got[:3], want[:3]):
        assert g.dtype == out_dtype and g.is_contiguous() and g.shape == w.shape, name
        torch.testing.assert_close(g.float(), w, **TOL[out_dtype], msg=lambda m: f"{name}: {m}")
    # beta is sigmoid(b) rounded to b's dtype (bf16): one rounding apart at most
    for name, g, w, tol in zip(("g", "beta"), got[3:], want[3:], (TOL[torch.float32], TOL[b.dtype])):
        assert g.dtype == torch.float32 and g.shape == w.shape, name
        torch.testing.assert_close(g, w, **tol, msg=lambda m: f"{name}: {m}")
    if padded:  # the padding tokens neither decay nor write the state: exactly zero
        for r in range(R):
            assert not got[3][r, int(valid[r]):].any() and not got[4][r, int(valid[r]):].any()


@pytest.mark.parametrize("heads", [(32, 128, 128), (64, 128, 128), (3, 24, 80), (1, 256, 256)],
                         ids=["9b", "hv64", "ragged", "d256"])
def test_prefill_prep_launch_config_is_made_of_powers_of_two(heads):
    """Triton takes only powers of two for a block extent and for num_warps (the 9B's 32 heads of 384 values
    once gave 21 heads a program)."""
    BH, BK, BV, warps = prep_launch_config(*heads)
    assert all(x > 0 and x & (x - 1) == 0 for x in (BH, BK, BV, warps)), (BH, BK, BV, warps)
    assert BH * (2 * BK + BV) <= 8192 or BH == 1


def test_prefill_prep_gives_a_token_the_same_bits_in_any_piece():
    """Token t of a piece alone (T = 1), and inside pieces of other lengths at other positions."""
    Hk, Hv, Dk, Dv = (16, 32, 128, 128) if CUDA else (2, 4, 16, 32)
    mixed, a, b, neg_A, dt_bias = _prep_inputs(1, 70, Hk, Hv, Dk, Dv, seed=5)
    whole = gated_delta_prefill_prep(mixed, a, b, neg_A, dt_bias, None, Hk, Dk, Dv)
    for lo, hi in ((0, 1), (3, 4), (5, 69), (64, 70), (1, 65)):
        part = gated_delta_prefill_prep(mixed[:, lo:hi], a[:, lo:hi], b[:, lo:hi], neg_A, dt_bias, None, Hk, Dk, Dv)
        for g, w in zip(part, whole):
            assert torch.equal(g, w[:, lo:hi]), (lo, hi)


# ---------------------------------------------------------------- conv of a padded piece

CONV_SHAPES = {  # R, C, K (taps), num_slots, slot ids
    "c16-k4": (1, 16, 4, 3, [2]),
    "c200-k4-rows": (3, 200, 4, 5, [4, 0, 2]),
    "c48-k3": (2, 48, 3, 4, [1, 3]),
    **({"9b-conv": (1, 8192, 4, 4, [3])} if CUDA else {}),
}


def _conv_inputs(R, T, C, K, num_slots, seed=0):
    x = _randn(R, T, C, seed=seed, dtype=torch.bfloat16)
    buf = _randn(num_slots, C, K - 1, seed=seed + 1, dtype=torch.bfloat16)
    w = _randn(C, K, seed=seed + 2, dtype=torch.bfloat16, scale=0.5)
    return x, buf, w


@pytest.mark.parametrize("T,valid", [(8, [8]), (8, [5]), (16, [2]), (33, [1])], ids=["full", "v5", "v2", "v1"])
@pytest.mark.parametrize("shape", CONV_SHAPES.values(), ids=CONV_SHAPES.keys())
def test_conv_prefill_of_a_padded_piece_matches_the_reference(shape, T, valid):
    """The new conv state is the history ending at the last real token (also when fewer real tokens than
    taps), the outputs of the real tokens those of the reference; other slots untouched."""
    R, C, K, num_slots, ids = shape
    x, buf, w = _conv_inputs(R, T, C, K, num_slots)
    slots = torch.tensor(ids, device=DEVICE)
    v = torch.tensor((valid * R)[:R], device=DEVICE)
    buf_ref = buf.float()
    want = conv_prefill_ref(x.float(), buf_ref, slots, w.float(), v)
    got = conv_prefill(x, buf, slots, w, v)
    for r in range(R):
        n = int(v[r])
        torch.testing.assert_close(got[r, :n].float(), want[r, :n], **TOL[torch.bfloat16])
    assert torch.equal(buf.float(), buf_ref)  # a pure shift of inputs: exact


def test_conv_prefill_split_anywhere_equals_one_piece():
    """A piece cut at any token, the second half padded: the same outputs and the same conv state, bitwise."""
    C, K = (8192, 4) if CUDA else (48, 4)
    x, buf, w = _conv_inputs(1, 40, C, K, 2, seed=9)
    slots = torch.tensor([1], device=DEVICE)
    one = buf.clone()
    whole = conv_prefill(x, one, slots, w)
    for cut in (1, 3, 17, 39):
        two = buf.clone()
        first = conv_prefill(x[:, :cut], two, slots, w)
        rest = torch.cat([x[:, cut:], torch.zeros_like(x[:, :5])], dim=1)  # padded like a graph's piece
        second = conv_prefill(rest, two, slots, w, torch.tensor([40 - cut], device=DEVICE))
        assert torch.equal(torch.cat([first, second[:, :40 - cut]], dim=1), whole), cut
        assert torch.equal(two, one), cut


@pytest.mark.parametrize("at", [1, 2, 5, 32], ids=["at1", "at2", "at5", "at32"])
@pytest.mark.parametrize("shape", CONV_SHAPES.values(), ids=CONV_SHAPES.keys())
def test_conv_prefill_keeps_the_history_at_the_grid_point(shape, at):
    """With `grid`, the slots' checkpoint buffer gets the history after the first `at` tokens, bitwise the
    state a piece ending there leaves (also when `at` is under the taps, from the old state); the outputs
    and the new state are those of the run without it; other slots' checkpoints untouched."""
    R, C, K, num_slots, ids = shape
    T = 40
    x, buf, w = _conv_inputs(R, T, C, K, num_slots, seed=at)
    slots = torch.tensor(ids, device=DEVICE)
    v = torch.tensor([T - r for r in range(R)], device=DEVICE)
    plain_buf = buf.clone()
    plain = conv_prefill(x, plain_buf, slots, w, v)
    for index in (at, torch.full((R,), at, device=DEVICE)):
        ended, grid_buf, got_buf = buf.clone(), torch.zeros_like(buf), buf.clone()
        conv_prefill(x[:, :at], ended, slots, w)
        got = conv_prefill(x, got_buf, slots, w, v, (grid_buf, index))
        assert torch.equal(got, plain) and torch.equal(got_buf, plain_buf)
        assert torch.equal(grid_buf[slots], ended[slots])
        others = [i for i in range(num_slots) if i not in ids]
        assert not grid_buf[others].any()
        ref_grid = torch.zeros_like(buf)
        conv_prefill_ref(x, buf.clone(), slots, w, v, (ref_grid, index))
        assert torch.equal(ref_grid, grid_buf)


# ---------------------------------------------------------------- split-invariant prefill attention

ATTN_PIECE_SHAPES = {  # Hq, Hkv, D, context before the piece, max_seq
    "gqa4-d32": (8, 2, 32, 300, 640),
    "mha-d16-short": (2, 2, 16, 40, 128),
    **({"9b-heads-2k": (16, 4, 256, 2048, 4352), "9b-heads-3k": (16, 4, 256, 2944, 4352)} if CUDA else {}),
}


def _kv(Hq, Hkv, D, max_seq, seed=0, dtype=torch.bfloat16):
    # q and the output gate as the model passes them: the two halves of one [.., Hq, 2D] projection
    q_all, gate_all = _randn(1, max_seq, Hq, 2 * D, seed=seed, dtype=dtype).chunk(2, dim=-1)
    kv_k = _randn(2, max_seq, Hkv, D, seed=seed + 1, dtype=dtype)
    kv_v = _randn(2, max_seq, Hkv, D, seed=seed + 2, dtype=dtype)
    return q_all, kv_k, kv_v, gate_all


def _rows(q_all, kv_k, kv_v, a, b, kv_len, gate_all=None):
    """prefill_attention of positions [a, b) as one piece, in slot 1 (gated when gate_all is given)."""
    slots, start = torch.tensor([1], device=DEVICE), torch.tensor([a], device=DEVICE)
    gate = None if gate_all is None else gate_all[:, a:b]
    return triton_attention.prefill_attention(q_all[:, a:b], kv_k, kv_v, slots, start, kv_len,
                                              q_all.shape[-1] ** -0.5, gate)


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("shape", ATTN_PIECE_SHAPES.values(), ids=ATTN_PIECE_SHAPES.keys())
def test_prefill_attention_rows_do_not_depend_on_the_piece(shape, gated, monkeypatch):
    """Rows of an append (32 tokens after the context), computed in pieces of other lengths, starting at
    other grid points, with other key bounds (kv_len) and with the piece run in waves of rows: bitwise the
    same, with and without the output gate; and close to the reference."""
    Hq, Hkv, D, P, max_seq = shape
    q_all, kv_k, kv_v, gate_all = _kv(Hq, Hkv, D, max_seq)
    gate_all = gate_all if gated else None
    want = _rows(q_all, kv_k, kv_v, P, P + 32, P + 32, gate_all)
    slots, start = torch.tensor([1], device=DEVICE), torch.tensor([P], device=DEVICE)
    ref = attention_ref(q_all[:, P:P + 32].float(), kv_k.float(), kv_v.float(), slots, start, P + 32, D ** -0.5,
                        None if gate_all is None else gate_all[:, P:P + 32].float())
    torch.testing.assert_close(want.float(), ref, **TOL[torch.bfloat16])
    G = P // 64 * 64
    assert torch.equal(_rows(q_all, kv_k, kv_v, P, P + 32, max_seq, gate_all), want)  # a graph's bound
    assert torch.equal(_rows(q_all, kv_k, kv_v, P, P + 95, max_seq, gate_all)[:, :32], want)
    assert torch.equal(_rows(q_all, kv_k, kv_v, G, P + 32, P + 32, gate_all)[:, P - G:], want)
    assert torch.equal(_rows(q_all, kv_k, kv_v, P, P + 1, P + 1, gate_all), want[:, :1])
    monkeypatch.setattr(triton_attention, "_INVARIANT_PARTIAL_BYTES_CAP", 1)  # waves of one row block
    assert torch.equal(_rows(q_all, kv_k, kv_v, G, P + 32, max_seq, gate_all)[:, P - G:], want)


def test_prefill_attention_runs_absolute_key_ranges():
    """The launch covers the keys in ranges of SPLIT_KEYS whatever the piece, and bounds its partials."""
    cfg = triton_attention._launch_config(1, 32, 16, 4, 256, 4352, torch.device(DEVICE), split_invariant=True)
    assert cfg["split_keys"] == triton_attention.SPLIT_KEYS and cfg["splits"] == -(-4352 // triton_attention.SPLIT_KEYS)
    big = triton_attention._launch_config(1, 1024, 16, 4, 256, 65536, torch.device(DEVICE), split_invariant=True)
    assert big["wave"] < 1024 and big["wave"] % big["BT"] == 0
    assert big["wave"] * 16 * big["splits"] * 257 * 4 <= triton_attention._INVARIANT_PARTIAL_BYTES_CAP
