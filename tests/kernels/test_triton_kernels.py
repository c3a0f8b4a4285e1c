"""Triton kernels against the plain-torch references, over small labelled shapes.

Runs on a CUDA device, or on CPU under Triton's interpreter (TRITON_INTERPRET=1, slow: keep shapes small).
The whole module is gpu-marked; the CPU CI (`-m "not gpu"`, no triton) never collects it.
"""
import os

import pytest
import torch
import torch.nn.functional as F

import triton  # noqa: F401  (tests/conftest.py ignores this module where triton is not installed)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda_or_interpreter():
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.fail("the Triton kernel tests need a CUDA device, or TRITON_INTERPRET=1 to run on the CPU")

from capsulert.kernels import triton_attention  # noqa: E402
from capsulert.kernels import fused as fused_ref  # noqa: E402
from capsulert.kernels.attention import attention_ref  # noqa: E402
from capsulert.kernels.conv import causal_conv1d_ref, causal_conv1d_step_ref  # noqa: E402
from capsulert.kernels.gated_delta import gated_delta_step_ref  # noqa: E402
from capsulert.kernels.triton_attention import attention  # noqa: E402
from capsulert.kernels.triton_conv import conv_prefill, conv_step  # noqa: E402
from capsulert.kernels.triton_gated_delta import gated_delta_step  # noqa: E402
from capsulert.kernels.triton_attention_prep import attention_prep  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
EPS = 1e-6


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _dev(*xs):
    return [x.to(DEVICE) for x in xs]


def _slots(ids):
    return torch.tensor(ids, dtype=torch.int64, device=DEVICE)


def _assert_untouched(after, before, slots):
    """Rows of the slot dimension not in `slots` are bitwise unchanged."""
    others = sorted(set(range(before.shape[0])) - set(slots.tolist()))
    assert torch.equal(after[others], before[others])


# ---------------------------------------------------------------- gated delta step

DELTA_SHAPES = {  # B, H, K, V, num_slots, slot ids
    "k16-v16-h2": (3, 2, 16, 16, 5, [3, 0, 2]),
    "k32-v32-h4": (3, 4, 32, 32, 6, [5, 1, 3]),
    "k16-v32-h4": (2, 4, 16, 32, 4, [2, 1]),
    "k32-v16-h2-b1": (1, 2, 32, 16, 3, [2]),
    "ragged-k24-v80": (2, 2, 24, 80, 4, [3, 0]),  # K padded to 32, V split into 2 blocks, last partial
}


def _delta_inputs(B, H, K, V, num_slots, seed=0):
    g = _gen(seed)
    # q, k as the model produces them: strided views of a [B, T, H, K] tensor
    q = F.normalize(torch.randn(B, 1, H, K, generator=g), dim=-1)[:, 0] * K**-0.5
    k = F.normalize(torch.randn(B, 1, H, K, generator=g), dim=-1)[:, 0]
    v = torch.randn(B, H, V, generator=g)
    gate = -torch.rand(B, H, generator=g) * 0.5
    beta = torch.rand(B, H, generator=g)
    ssm = torch.randn(num_slots, H, K, V, generator=g) * 0.3
    return _dev(q, k, v, gate, beta, ssm)


@pytest.mark.parametrize("shape", DELTA_SHAPES.values(), ids=DELTA_SHAPES.keys())
def test_gated_delta_step(shape):
    B, H, K, V, num_slots, ids = shape
    q, k, v, gate, beta, ssm = _delta_inputs(B, H, K, V, num_slots)
    slots = _slots(ids)
    before = ssm.clone()
    o_ref, s_ref = gated_delta_step_ref(q, k, v, gate, beta, before[slots])

    o = gated_delta_step(q, k, v, gate, beta, ssm, slots)
    assert o.shape == (B, H, V) and o.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, **TOL[torch.float32])
    torch.testing.assert_close(ssm[slots], s_ref, **TOL[torch.float32])
    _assert_untouched(ssm, before, slots)


def test_gated_delta_step_repeated_matches_reference_recurrence():
    """Several steps in a row on the same slots: the in-place state carries correctly."""
    B, H, K, V, num_slots = 2, 2, 16, 16, 4
    slots = _slots([3, 1])
    _, _, _, _, _, ssm = _delta_inputs(B, H, K, V, num_slots, seed=1)
    state = ssm[slots].clone()
    for step in range(3):
        q, k, v, gate, beta, _ = _delta_inputs(B, H, K, V, 1, seed=10 + step)
        o_ref, state = gated_delta_step_ref(q, k, v, gate, beta, state)
        o = gated_delta_step(q, k, v, gate, beta, ssm, slots)
        torch.testing.assert_close(o, o_ref, **TOL[torch.float32])
    torch.testing.assert_close(ssm[slots], state, **TOL[torch.float32])


# ---------------------------------------------------------------- conv

CONV_SHAPES = {  # B, C, K (taps), num_slots, slot ids
    "c24-k4": (3, 24, 4, 5, [4, 0, 2]),
    "c300-k4": (2, 300, 4, 3, [2, 0]),  # several channel blocks, last partial
    "c16-k2": (2, 16, 2, 3, [1, 2]),
    "c40-k3": (1, 40, 3, 2, [1]),
}


def _conv_inputs(B, T, C, K, num_slots, dtype, seed=0):
    g = _gen(seed)
    x = torch.randn(B, T, C, generator=g).to(dtype)
    buf = torch.randn(num_slots, C, K - 1, generator=g).to(dtype)
    w = (torch.randn(C, K, generator=g) * 0.5).to(dtype)
    return _dev(x, buf, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", CONV_SHAPES.values(), ids=CONV_SHAPES.keys())
def test_conv_step(shape, dtype):
    B, C, K, num_slots, ids = shape
    x, buf, w = _conv_inputs(B, 1, C, K, num_slots, dtype)
    x = x[:, 0]
    slots = _slots(ids)
    before = buf.clone()
    out_ref, state_ref = causal_conv1d_step_ref(x.float(), before[slots].float(), w.float())

    out = conv_step(x, buf, slots, w)
    assert out.shape == (B, C) and out.dtype == dtype
    torch.testing.assert_close(out.float(), out_ref, **TOL[dtype])
    assert torch.equal(buf[slots], state_ref.to(dtype))  # the new state is a pure shift: exact
    _assert_untouched(buf, before, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 2, 5, 37], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("shape", CONV_SHAPES.values(), ids=CONV_SHAPES.keys())
def test_conv_prefill(shape, T, dtype):
    B, C, K, num_slots, ids = shape
    x, buf, w = _conv_inputs(B, T, C, K, num_slots, dtype, seed=T)
    slots = _slots(ids)
    before = buf.clone()
    out_ref, state_ref = causal_conv1d_ref(x.float(), before[slots].float(), w.float())

    out = conv_prefill(x, buf, slots, w)
    assert out.shape == (B, T, C) and out.dtype == dtype
    torch.testing.assert_close(out.float(), out_ref, **TOL[dtype])
    assert torch.equal(buf[slots], state_ref.to(dtype))
    _assert_untouched(buf, before, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_conv_prefill_equals_steps_bitwise(dtype):
    """The step and prefill kernels sum the taps in the same order: token-by-token == one prefill."""
    B, T, C, K = 2, 6, 48, 4
    x, buf, w = _conv_inputs(B, T, C, K, 3, dtype, seed=7)
    slots = _slots([2, 0])
    buf_p, buf_s = buf.clone(), buf.clone()
    out_p = conv_prefill(x, buf_p, slots, w)
    out_s = torch.stack([conv_step(x[:, t].contiguous(), buf_s, slots, w) for t in range(T)], dim=1)
    assert torch.equal(out_p, out_s)
    assert torch.equal(buf_p, buf_s)


def test_conv_prefill_strided_input():
    """x as the model passes it: a slice of a wider projection output."""
    B, T, C, K = 2, 5, 24, 4
    wide, buf, w = _conv_inputs(B, T, 2 * C, K, 3, torch.float32)
    x = wide[..., :C]
    buf = buf[:, :C].contiguous()
    w = w[:C].contiguous()
    slots = _slots([1, 2])
    before = buf.clone()
    out_ref, state_ref = causal_conv1d_ref(x, before[slots], w)
    out = conv_prefill(x, buf, slots, w)
    torch.testing.assert_close(out, out_ref, **TOL[torch.float32])
    assert torch.equal(buf[slots], state_ref)


# ---------------------------------------------------------------- attention

ATTN_SHAPES = {  # B, T, Hq, Hkv, D, max_seq, kv_len, starts, slot ids
    "decode-gqa1-d16": (3, 1, 2, 2, 16, 160, 160, [5, 70, 130], [2, 0, 3]),
    "decode-gqa2-d64": (3, 1, 4, 2, 64, 160, 150, [0, 77, 149], [1, 3, 0]),
    "decode-gqa4-d64": (3, 1, 8, 2, 64, 200, 200, [63, 64, 190], [3, 2, 1]),
    "decode-gqa3-d16": (2, 1, 6, 2, 16, 96, 96, [33, 94], [1, 0]),
    "prefill-37-gqa2-d16": (1, 37, 4, 2, 16, 128, 128, [19], [2]),
    "prefill-37-gqa4-d64-start0": (1, 37, 4, 1, 64, 128, 100, [0], [1]),
    "prefill-64-gqa1-d64": (1, 64, 2, 2, 64, 192, 192, [45], [3]),
    "prefill-64-gqa4-d16-b2": (2, 64, 8, 2, 16, 160, 160, [0, 93], [0, 2]),
}


def _attn_inputs(B, T, Hq, Hkv, D, max_seq, starts, ids, dtype, num_slots=4, seed=0):
    g = _gen(seed)
    # q as the model passes it: one half of a [B, T, Hq, 2D] projection (non-contiguous heads)
    q = torch.randn(B, T, Hq, 2 * D, generator=g).to(dtype)[..., :D]
    kv_k = torch.randn(num_slots, max_seq, Hkv, D, generator=g).to(dtype)
    kv_v = torch.randn(num_slots, max_seq, Hkv, D, generator=g).to(dtype)
    # rows past each row's own length hold large junk: it must be masked, never mixed in
    for b, (s, slot) in enumerate(zip(starts, ids)):
        kv_k[slot, s + T:] = 100.0
        kv_v[slot, s + T:] = 100.0
    slots = torch.tensor(ids, dtype=torch.int64)
    start = torch.tensor(starts, dtype=torch.int64)
    return _dev(q, kv_k, kv_v, slots, start)


@pytest.fixture(params=["split", "single-pass"])
def split_mode(request, monkeypatch):
    if request.param == "single-pass":
        monkeypatch.setattr(triton_attention, "_PARTIAL_BYTES_CAP", 0)  # forces NUM_SPLITS = 1
    return request.param


def _gate_like(q, seed=9):
    """An output gate as the model passes it: the other half of a [B, T, Hq, 2D] projection (strided)."""
    B, T, Hq, D = q.shape
    return torch.randn(B, T, Hq, 2 * D, generator=_gen(seed)).to(q.dtype).to(q.device)[..., D:]


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", ATTN_SHAPES.values(), ids=ATTN_SHAPES.keys())
def test_attention(shape, dtype, gated, split_mode):
    B, T, Hq, Hkv, D, max_seq, kv_len, starts, ids = shape
    q, kv_k, kv_v, slots, start = _attn_inputs(B, T, Hq, Hkv, D, max_seq, starts, ids, dtype)
    gate = _gate_like(q) if gated else None
    scale = D**-0.5
    ref = attention_ref(q, kv_k, kv_v, slots, start, kv_len, scale, gate)
    out = attention(q, kv_k, kv_v, slots, start, kv_len, scale, gate)
    assert out.shape == (B, T, Hq, D) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


DECODE_BATCHES = {  # Hq, Hkv, D, max_seq, the lengths of the batch's rows (each checked alone), slot ids
    "gqa2-d16-long-and-short": (4, 2, 16, 700, [600, 3, 280, 699], [2, 0, 3, 1]),
    "gqa4-d64-two-rows": (8, 2, 64, 200, [150, 10], [1, 3]),
    "gqa2-d32-block-edges": (4, 2, 32, 600, [256, 511, 257], [0, 1, 2]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", DECODE_BATCHES.values(), ids=DECODE_BATCHES.keys())
def test_decode_attention_row_is_bitwise_the_same_alone_or_in_a_batch(shape, dtype):
    """Batch-invariant decode: a row's output follows its own length only, not the batch size, the other rows
    or where it sits in the batch."""
    Hq, Hkv, D, max_seq, lengths, ids = shape
    B = len(lengths)
    q, kv_k, kv_v, slots, start = _attn_inputs(B, 1, Hq, Hkv, D, max_seq, [n - 1 for n in lengths], ids, dtype)
    gate = _gate_like(q)
    batch = attention(q, kv_k, kv_v, slots, start, max_seq, D**-0.5, gate)
    for r in range(B):
        alone = attention(q[r:r + 1], kv_k, kv_v, slots[r:r + 1], start[r:r + 1], max_seq, D**-0.5, gate[r:r + 1])
        assert torch.equal(alone, batch[r:r + 1]), f"row {r} (length {lengths[r]}) differs alone"
    rev = torch.arange(B - 1, -1, -1, device=q.device)
    moved = attention(q[rev], kv_k, kv_v, slots[rev], start[rev], max_seq, D**-0.5, gate[rev])
    assert torch.equal(moved, batch[rev])
    ref = attention_ref(q, kv_k, kv_v, slots, start, max_seq, D**-0.5, gate)
    torch.testing.assert_close(batch.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("kv_len", [64, 300, 4096, 4352, 262144])
def test_decode_attention_split_count_does_not_follow_the_batch(kv_len):
    """Decode's launch (split count, tiles) is the same for every batch size: a row's reduction order cannot
    depend on how many rows share its step."""
    dev = torch.device(DEVICE)
    cfgs = [triton_attention._launch_config(B, 1, 16, 4, 256, kv_len, dev) for B in (1, 7, 64)]
    assert all(c == cfgs[0] for c in cfgs) and 1 <= cfgs[0]["splits"] <= 64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="model-size shapes: too slow for the interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,starts", [(1, [0, 517, 4000]), (256, [3000])], ids=["decode-b3", "prefill-256"])
def test_attention_model_size(T, starts, dtype):
    """Hq=16, Hkv=4, D=256 (the model's head layout), lengths not multiples of any block."""
    B = len(starts)
    q, kv_k, kv_v, slots, start = _attn_inputs(B, T, 16, 4, 256, 4352, starts, list(range(B))[::-1], dtype)
    ref = attention_ref(q, kv_k, kv_v, slots, start, 4352, 256**-0.5)
    out = attention(q, kv_k, kv_v, slots, start, 4352, 256**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_attention_int32_start():
    """The model's `pos` buffer is int32; start/slots of either int width work."""
    B, T, Hq, Hkv, D, max_seq = 2, 1, 4, 2, 16, 64
    q, kv_k, kv_v, slots, start = _attn_inputs(B, T, Hq, Hkv, D, max_seq, [3, 40], [1, 0], torch.float32)
    ref = attention_ref(q, kv_k, kv_v, slots, start, max_seq, 0.25)
    out = attention(q, kv_k, kv_v, slots.int(), start.int(), max_seq, 0.25)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's interpreter rounds fp32 -> bf16 toward zero")
def test_attention_gate_rounds_as_the_reference(split_mode):
    """The gate in the kernel's epilogue rounds as the reference does (the output, then the sigmoid, then their
    product, each to bf16): the gated output is the kernel's own ungated output through output_gate, bit for
    bit, up to the sigmoid's last ulp in fp32."""
    B, T, Hq, Hkv, D, max_seq, kv_len, starts, ids = ATTN_SHAPES["decode-gqa4-d64"]
    q, kv_k, kv_v, slots, start = _attn_inputs(B, T, Hq, Hkv, D, max_seq, starts, ids, torch.bfloat16)
    gate = _gate_like(q)
    plain = attention(q, kv_k, kv_v, slots, start, kv_len, D**-0.5)
    gated = attention(q, kv_k, kv_v, slots, start, kv_len, D**-0.5, gate)
    want = plain * torch.sigmoid(gate)
    mismatch = (gated != want).float().mean().item()
    assert mismatch < 0.01, f"{mismatch:.2%} of the gated outputs round otherwise than the reference's"
    torch.testing.assert_close(gated.float(), want.float(), rtol=8e-3, atol=1e-6)


# ---------------------------------------------------------------- norms, rotary and the KV write

PREP_SHAPES = {  # B, T, Hq, Hkv, D, rotary_dim, max_seq, starts, slot ids
    "decode-b3-gqa4-d64": (3, 1, 8, 2, 64, 16, 96, [0, 40, 95], [2, 0, 3]),
    "decode-b2-gqa2-d16-rot-all": (2, 1, 6, 3, 16, 16, 64, [7, 63], [1, 2]),
    "prefill-37-gqa2-d32": (1, 37, 4, 2, 32, 8, 128, [19], [3]),
    "prefill-64-b2-gqa1-d16": (2, 64, 4, 4, 16, 4, 160, [0, 96], [0, 2]),
}


def _prep_inputs(B, T, Hq, Hkv, D, rot, max_seq, starts, ids, dtype, seed=4):
    """As the model passes them: q, k, v views into one projection output, int32 positions."""
    g = _gen(seed)
    proj = torch.randn(B, T, (Hq + 2 * Hkv) * D, generator=g).to(dtype)
    q = proj[..., :Hq * D].view(B, T, Hq, D)
    k = proj[..., Hq * D:(Hq + Hkv) * D].view(B, T, Hkv, D)
    v = proj[..., (Hq + Hkv) * D:].view(B, T, Hkv, D)
    w_q, w_k = (0.1 * torch.randn(D, generator=g)).to(dtype), (0.1 * torch.randn(D, generator=g)).to(dtype)
    angle = torch.rand(B, T, rot, generator=g) * 6.0
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    kv_k, kv_v = (torch.randn(4, max_seq, Hkv, D, generator=g).to(dtype) for _ in range(2))
    slots, start = torch.tensor(ids, dtype=torch.int64), torch.tensor(starts, dtype=torch.int32)
    return _dev(q, w_q, k, w_k, v, cos, sin), _dev(kv_k, kv_v, slots, start)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", PREP_SHAPES.values(), ids=PREP_SHAPES.keys())
def test_attention_prep(shape, dtype):
    """q's and k's norm + rotary against the reference, v's bytes and every other cache row unchanged."""
    B, T, Hq, Hkv, D, rot, max_seq, starts, ids = shape
    (q, w_q, k, w_k, v, cos, sin), (kv_k, kv_v, slots, start) = _prep_inputs(*shape, dtype)
    want_k, want_v = kv_k.clone(), kv_v.clone()
    want_q = fused_ref.attention_prep_ref(q, w_q, k, w_k, v, cos, sin, rot, EPS, want_k, want_v, slots, start.long())
    got_q = attention_prep(q, w_q, k, w_k, v, cos, sin, rot, EPS, kv_k, kv_v, slots, start)
    assert got_q.shape == (B, T, Hq, D) and got_q.is_contiguous()
    torch.testing.assert_close(got_q.float(), want_q.float(), **TOL[dtype])
    torch.testing.assert_close(kv_k.float(), want_k.float(), **TOL[dtype])
    assert torch.equal(kv_v, want_v)
    written = torch.zeros(kv_k.shape[:2], dtype=torch.bool, device=kv_k.device)
    for s0, slot in zip(starts, ids):
        written[slot, s0:s0 + T] = True
    assert torch.equal(kv_k[~written], want_k[~written])  # no other row moved


def test_attention_prep_is_row_invariant():
    """A row's q' and cache rows are the same bits alone and among other rows."""
    shape = PREP_SHAPES["decode-b3-gqa4-d64"]
    (q, w_q, k, w_k, v, cos, sin), (kv_k, kv_v, slots, start) = _prep_inputs(*shape, torch.bfloat16)
    batch_k, batch_v = kv_k.clone(), kv_v.clone()
    batch_q = attention_prep(q, w_q, k, w_k, v, cos, sin, shape[5], EPS, batch_k, batch_v, slots, start)
    for b in range(q.shape[0]):
        one = slice(b, b + 1)
        solo_q = attention_prep(q[one], w_q, k[one], w_k, v[one], cos[one], sin[one], shape[5], EPS, kv_k, kv_v,
                                slots[one], start[one])
        assert torch.equal(solo_q[0], batch_q[b])
    assert torch.equal(kv_k, batch_k) and torch.equal(kv_v, batch_v)


def test_attention_prep_skips_cache_rows_past_the_end():
    """Padding tokens of a captured piece can sit past max_seq: those are not written (nothing else moves)."""
    (q, w_q, k, w_k, v, cos, sin), _ = _prep_inputs(1, 8, 2, 2, 16, 16, 64, [60], [1], torch.float32)
    kv_k, kv_v = torch.zeros(2, 64, 2, 16, device=DEVICE), torch.zeros(2, 64, 2, 16, device=DEVICE)
    slots, start = _dev(torch.tensor([1]), torch.tensor([60]))
    want_k, want_v = kv_k.clone(), kv_v.clone()
    fused_ref.attention_prep_ref(q[:, :4], w_q, k[:, :4], w_k, v[:, :4], cos[:, :4], sin[:, :4], 16, EPS, want_k,
                                 want_v, slots, start)
    attention_prep(q, w_q, k, w_k, v, cos, sin, 16, EPS, kv_k, kv_v, slots, start)
    torch.testing.assert_close(kv_k, want_k, **TOL[torch.float32])
    assert torch.equal(kv_v, want_v) and not kv_k[0].any() and not kv_k[1, :60].any()


# ---------------------------------------------------------------- CUDA graphs

def _capture(fn):
    """Warm up (compile) on a side stream, then capture fn() in a CUDA graph; returns (graph, output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a real CUDA device")
def test_cuda_graph_capture_replay_matches_eager():
    torch.manual_seed(0)
    dev = "cuda"

    # gated delta step
    B, H, K, V, N = 3, 4, 32, 64, 6
    q, k, v, gate, beta, ssm0 = _delta_inputs(B, H, K, V, N)
    ssm = ssm0.clone()
    slots = _slots([0, 1, 2])
    graph, o_g = _capture(lambda: gated_delta_step(q, k, v, gate, beta, ssm, slots))
    slots.copy_(_slots([5, 2, 3]))
    ssm.copy_(ssm0)
    graph.replay()
    ssm_e = ssm0.clone()
    o_e = gated_delta_step(q, k, v, gate, beta, ssm_e, slots.clone())
    torch.cuda.synchronize()
    assert torch.equal(o_g, o_e) and torch.equal(ssm, ssm_e)

    # conv step / prefill
    for T in (1, 37):
        x, buf0, w = _conv_inputs(2, T, 64, 4, 4, torch.bfloat16)
        buf = buf0.clone()
        slots = _slots([0, 1])
        if T == 1:
            x1 = x[:, 0].contiguous()
            fn = lambda: conv_step(x1, buf, slots, w)  # noqa: E731
            eager = lambda b, s: conv_step(x1, b, s, w)  # noqa: E731
        else:
            fn = lambda: conv_prefill(x, buf, slots, w)  # noqa: E731
            eager = lambda b, s: conv_prefill(x, b, s, w)  # noqa: E731
        graph, out_g = _capture(fn)
        slots.copy_(_slots([3, 1]))
        buf.copy_(buf0)
        graph.replay()
        buf_e = buf0.clone()
        out_e = eager(buf_e, slots.clone())
        torch.cuda.synchronize()
        assert torch.equal(out_g, out_e) and torch.equal(buf, buf_e)

    # attention: captured with kv_len = max_seq; start and slots change between replays
    for T, starts0, starts1 in ((1, [0, 10, 20], [700, 3, 1500]), (64, [0], [900])):
        B = len(starts0)
        max_seq = 2048
        q, kv_k, kv_v, slots, start = _attn_inputs(B, T, 16, 4, 256, max_seq, starts0, list(range(B)),
                                                   torch.bfloat16, num_slots=4)
        gate = _gate_like(q)
        graph, o_g = _capture(lambda: attention(q, kv_k, kv_v, slots, start, max_seq, 256**-0.5, gate))
        for starts in (starts0, starts1):
            start.copy_(torch.tensor(starts, device=dev))
            slots.copy_(torch.tensor(list(range(B))[::-1], device=dev))
            graph.replay()
            o_e = attention(q, kv_k, kv_v, slots.clone(), start.clone(), max_seq, 256**-0.5, gate)
            ref = attention_ref(q, kv_k, kv_v, slots, start, max_seq, 256**-0.5, gate)
            torch.cuda.synchronize()
            assert torch.equal(o_g, o_e)
            torch.testing.assert_close(o_g.float(), ref.float(), **TOL[torch.bfloat16])
