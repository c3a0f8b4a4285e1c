"""Triton attention of a query chunk over the static per-slot KV cache (flash / flash-decoding, GQA-packed).

Same signature and semantics as `capsulert.kernels.ops.attention` (reference:
`capsulert.kernels.attention.attention_ref`): query t of batch row b sits at position start[b] + t and sees
keys [0, start[b] + t] of slot slots[b]; query head h reads kv head h // (Hq // Hkv); `kv_len` is only a
static upper bound on the keys read (the caller passes max_seq when capturing graphs). Softmax in fp32,
output in q's dtype.

CUDA-graph capturable: slots/start are read on the device and every loop bound over keys comes from the
device length, so the cost scales with the real length, not with kv_len; the grid, the number of splits and
all allocations depend only on shapes (B, T, heads, D, kv_len) and the device's SM count.

Design
------
* GQA packing: one program serves all G = Hq // Hkv query heads of one kv head for a block of BT tokens,
  as BM = BT * GP rows (GP = next power of two >= G; row r -> token r // GP, head r % GP), so each K/V tile is
  loaded once per group. BM >= 16 (tl.dot minimum); in decode (T = 1) that pads G rows up to 16.
* Split-K (flash-decoding): grid (B * Hkv * n_tblocks, NUM_SPLITS). NUM_SPLITS is chosen on the host from
  shapes so that the grid fills the GPU even for one decode row (~2 light decode programs per SM, ~1 heavy
  prefill program per SM; see _launch_config). The key range of a
  program is computed on the device from the real length: kmax = start[b] + (last token of the block) + 1,
  chunk = ceil(kmax / NUM_SPLITS) rounded up to BN, split s covers [s * chunk, min((s+1) * chunk, kmax)), so all
  splits share the real work whatever the length. With NUM_SPLITS > 1 each program writes its normalised
  partial output and its log2-sum-exp, and a second kernel (grid B * T * Hq) merges them; splits with no
  visible key carry lse = -inf and are skipped without reading their partials.
* Split-invariant prefill (prefill_attention): the splits are absolute key ranges of SPLIT_KEYS from position
  0, and the merge adds the ranges that hold keys in order, so a row's bits do not depend on how many queries
  share its piece or on kv_len. Long pieces run in waves of rows so the partials stay bounded.
* Online softmax in base 2 (scores scaled by scale * log2(e)), fp32 accumulators; bf16 inputs use bf16
  tensor-core dots with fp32 accumulation (P is rounded to bf16 for P @ V, as in flash attention); fp32 inputs
  use IEEE fp32 dots (no TF32).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _gated(out, g_ptrs, mask, GATED: tl.constexpr, dtype: tl.constexpr):
    """The output in `dtype`, times sigmoid(gate) when GATED, with the reference's roundings (output_gate in
    kernels/attention.py): the output and the sigmoid each rounded to `dtype`, then their product."""
    out = out.to(dtype)
    if GATED:
        g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) * tl.sigmoid(g).to(dtype).to(tl.float32)).to(dtype)
    return out


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, slots_ptr, start_ptr, o_ptr, lse_ptr, opart_ptr, g_ptr,
    T, t0, Tw, Hq, kv_len, n_tblocks, qk_scale,
    sq_b, sq_t, sq_h, sq_d,
    sk_n, sk_s, sk_h, sk_d,
    sv_n, sv_s, sv_h, sv_d,
    so_b, so_t, so_h, so_d,
    sg_b, sg_t, sg_h, sg_d,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr,
    D: tl.constexpr, BN: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_KEYS: tl.constexpr, IEEE: tl.constexpr,
    INTERPRET: tl.constexpr, GATED: tl.constexpr,
):
    BM: tl.constexpr = BT * GP
    pid0 = tl.program_id(0)
    split = tl.program_id(1)
    tb = pid0 % n_tblocks
    bh = pid0 // n_tblocks
    hkv = bh % HKV
    b = bh // HKV

    offs_m = tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    t = t0 + tb * BT + offs_m // GP  # rows [t0, t0 + Tw) of the piece: one wave of a split-invariant launch
    gq = offs_m % GP
    row_valid = (t < T) & (t < t0 + Tw) & (gq < G)
    hq = hkv * G + gq

    slot = tl.load(slots_ptr + b).to(tl.int64)
    st = tl.load(start_ptr + b).to(tl.int32)
    pos = st + t  # [BM] absolute position of each query row
    t_last = tl.minimum(t0 + tb * BT + BT, T) - 1
    kmax = tl.minimum(st + t_last + 1, kv_len)  # keys [0, kmax) cover every row of this block
    if SPLIT_KEYS > 0:  # absolute key ranges: a row's partials do not depend on the piece
        lo = split * SPLIT_KEYS
        hi = tl.minimum(lo + SPLIT_KEYS, kmax)
    else:
        chunk = tl.cdiv(tl.cdiv(kmax, NUM_SPLITS), BN) * BN
        lo = split * chunk
        hi = tl.minimum(lo + chunk, kmax)

    q = tl.load(q_ptr + b * sq_b + t[:, None] * sq_t + hq[:, None] * sq_h + offs_d[None, :] * sq_d,
                mask=row_valid[:, None], other=0.0)
    if IEEE:
        q = q.to(tl.float32)

    k_base = k_ptr + slot * sk_n + hkv * sk_h
    v_base = v_ptr + slot * sv_n + hkv * sv_h
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    for n0 in range(lo, hi, BN):
        offs_n = n0 + tl.arange(0, BN)
        nmask = offs_n < hi
        kt = tl.load(k_base + offs_n[:, None] * sk_s + offs_d[None, :] * sk_d, mask=nmask[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(kt.to(tl.float32)), input_precision="ieee")
        elif INTERPRET:  # the CPU interpreter's bf16 tl.dot is wrong: same math on fp32-cast operands
            s = tl.dot(q.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kt))
        s = s * qk_scale
        visible = nmask[None, :] & (offs_n[None, :] <= pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_base + offs_n[:, None] * sv_s + offs_d[None, :] * sv_d, mask=nmask[:, None], other=0.0)
        if IEEE:
            pv = tl.dot(p, vt.to(tl.float32), input_precision="ieee")
        elif INTERPRET:
            pv = tl.dot(p.to(vt.dtype).to(tl.float32), vt.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(vt.dtype), vt)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        g_ptrs = g_ptr + b * sg_b + t[:, None] * sg_t + hq[:, None] * sg_h + offs_d[None, :] * sg_d
        out = _gated(out, g_ptrs, row_valid[:, None], GATED, o_ptr.dtype.element_ty)
        tl.store(o_ptr + b * so_b + t[:, None] * so_t + hq[:, None] * so_h + offs_d[None, :] * so_d, out,
                 mask=row_valid[:, None])
    else:
        # partials laid out [B, Tw, Hq, NUM_SPLITS, (D)], rows of the wave
        row = ((b * Tw + (t - t0)) * Hq + hq) * NUM_SPLITS + split
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=row_valid)
        tl.store(opart_ptr + row.to(tl.int64)[:, None] * D + offs_d[None, :], out,
                 mask=row_valid[:, None] & (l_i > 0.0)[:, None])


@triton.jit
def _attn_merge_kernel(
    lse_ptr, opart_ptr, o_ptr, g_ptr,
    Tn, t0, Tw, Hq,
    so_b, so_t, so_h, so_d,
    sg_b, sg_t, sg_h, sg_d,
    D: tl.constexpr, NUM_SPLITS: tl.constexpr, SP: tl.constexpr, ORDERED: tl.constexpr, GATED: tl.constexpr,
):
    pid = tl.program_id(0)  # over B * Tn * Hq (Tn rows of the wave), in the order of the partials
    hq = pid % Hq
    bt = pid // Hq
    tw = bt % Tn
    b = bt // Tn
    t = t0 + tw
    offs_s = tl.arange(0, SP)
    offs_d = tl.arange(0, D)
    base = ((b * Tw + tw) * Hq + hq).to(tl.int64) * NUM_SPLITS
    lse = tl.load(lse_ptr + base + offs_s, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([D], dtype=tl.float32)
    if ORDERED:
        # the splits with keys, summed in split order: the number of empty splits after them (which follows
        # the piece's length) changes nothing, not even a zero's sign
        denom = tl.zeros([D], dtype=tl.float32)
        for s in range(NUM_SPLITS):
            ls = tl.load(lse_ptr + base + s)
            if ls > float("-inf"):
                w = tl.exp2(ls - m) + tl.zeros([D], dtype=tl.float32)
                denom += w
                acc += w * tl.load(opart_ptr + (base + s) * D + offs_d)
    else:
        denom = tl.sum(tl.exp2(lse - m), 0)
        for s in range(NUM_SPLITS):
            w = tl.exp2(tl.load(lse_ptr + base + s) - m) + tl.zeros([D], dtype=tl.float32)  # [D], uniform
            part = tl.load(opart_ptr + (base + s) * D + offs_d, mask=w > 0.0, other=0.0)  # splits w/o keys: no read
            acc += w * part
    out = acc / tl.where(denom > 0.0, denom, 1.0)
    out = _gated(out, g_ptr + b * sg_b + t * sg_t + hq * sg_h + offs_d * sg_d, offs_d < D, GATED,
                 o_ptr.dtype.element_ty)
    tl.store(o_ptr + b * so_b + t * so_t + hq * so_h + offs_d * so_d, out)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 132  # interpreter / CPU: mimic an H100/H200 so the same code paths are exercised


_PARTIAL_BYTES_CAP = 64 << 20
# split-invariant prefill: every row folds its keys in ranges of this many from position 0, one program each
# (a 32-token append over 2k keys runs 8 ranges x 4 kv heads instead of 4 programs over all 2k keys), and a
# piece's partials take at most this many bytes: a longer piece runs in waves of rows
SPLIT_KEYS = 256
_INVARIANT_PARTIAL_BYTES_CAP = 256 << 20


def _launch_config(B: int, T: int, Hq: int, Hkv: int, D: int, kv_len: int, device: torch.device,
                   fp32: bool = False, split_invariant: bool = False) -> dict:
    """Block sizes and split count from shapes only (never from device values), so a captured graph holds one
    fixed launch. Measured on one H200 (bf16, Hq=16, Hkv=4, D=256): decode keeps BM = 16 rows; prefill chunks
    use BM = 128 rows, BN = 64, 8 warps, 2 stages, and about one program per SM (heavier tiles run one per SM:
    T=256 over 16k keys went 263 -> 391 TFLOP/s going from 9 splits to 4). fp32 inputs (IEEE dots, twice the
    bytes per tile) use half the rows and keys per tile so the tiles still fit in shared memory.
    split_invariant (prefill): a row's bits must not depend on the piece it is computed in, so the tile shape
    is the one of the longest pieces whatever T is, and the splits are absolute key ranges of SPLIT_KEYS
    (a proportional split's range follows the block's last query, which moves with the piece); the merge adds
    the ranges with keys in order, so how many empty ones follow (kv_len) changes nothing. `wave`: the rows
    one launch covers, so the partials fit _INVARIANT_PARTIAL_BYTES_CAP."""
    G = Hq // Hkv
    GP = triton.next_power_of_2(G)
    BT_max = max(1, (64 if fp32 else 128) // GP)
    BT = BT_max if split_invariant else min(triton.next_power_of_2(T), BT_max)
    BT = max(BT, triton.cdiv(16, GP))
    BM = BT * GP
    BN = 32 if (fp32 and D >= 128) else 64
    heavy = BM * D >= 16384
    num_warps = 8 if heavy else 4
    num_stages = 2 if (D >= 256 or (fp32 and D >= 128)) else 3
    if split_invariant:
        assert SPLIT_KEYS % BN == 0
        splits = triton.cdiv(kv_len, SPLIT_KEYS)
        per_row = Hq * splits * (D + 1) * 4
        wave = min(T, max(BT, _INVARIANT_PARTIAL_BYTES_CAP // (B * per_row) // BT * BT))
        return dict(G=G, GP=GP, BT=BT, BN=BN, n_tblocks=triton.cdiv(wave, BT), splits=splits, wave=wave,
                    split_keys=SPLIT_KEYS, num_warps=num_warps, num_stages=num_stages)
    n_tblocks = triton.cdiv(T, BT)
    # the split count (and so each row's reduction order) must not depend on the batch size B: a row's
    # attention output is then bitwise the same alone or among 63 others (batch-invariant decode). Sized for
    # one row, it fills the GPU for one decode row; larger batches just run more programs.
    base = Hkv * n_tblocks
    target = (1 if heavy else 2) * _num_sms(device)
    splits = max(1, min(target // base, triton.cdiv(kv_len, BN), 64))
    per_split_bytes = T * Hq * (D + 1) * 4  # per row
    splits = max(1, min(splits, _PARTIAL_BYTES_CAP // per_split_bytes))
    return dict(G=G, GP=GP, BT=BT, BN=BN, n_tblocks=n_tblocks, splits=splits, wave=T, split_keys=0,
                num_warps=num_warps, num_stages=num_stages)


def attention(q, kv_k, kv_v, slots, start, kv_len: int, scale: float, gate=None,
              split_invariant: bool = False) -> torch.Tensor:
    """q [B, T, Hq, D]; kv_k, kv_v [num_slots, max_seq, Hkv, D]; slots, start int [B] on the device;
    kv_len a static (Python int) bound on the keys read. Returns [B, T, Hq, D] in q's dtype, times
    sigmoid(gate) when a gate [B, T, Hq, D] (any strides) is given: the output gate in the kernel that stores
    the output, where the model ran it as a copy, a sigmoid and a product.
    split_invariant: a row's bits do not depend on T or kv_len (prefill on the 64-token grid)."""
    B, T, Hq, D = q.shape
    Hkv = kv_k.shape[2]
    assert kv_k.dim() == 4 and kv_v.shape == kv_k.shape and kv_k.shape[3] == D
    assert Hq % Hkv == 0 and D == triton.next_power_of_2(D) and D >= 16
    assert slots.shape == (B,) and start.shape == (B,)
    assert gate is None or gate.shape == q.shape, f"gate {tuple(gate.shape)} for queries {tuple(q.shape)}"
    g = q if gate is None else gate  # not read without a gate
    kv_len = int(min(kv_len, kv_k.shape[1]))
    o = torch.empty(B, T, Hq, D, dtype=q.dtype, device=q.device)
    if B == 0 or T == 0:
        return o
    assert kv_len >= 1
    ieee = q.dtype == torch.float32 or kv_k.dtype == torch.float32
    cfg = _launch_config(B, T, Hq, Hkv, D, kv_len, q.device, fp32=ieee, split_invariant=split_invariant)
    S, Tw = cfg["splits"], cfg["wave"]
    # one split stores acc / l directly: bitwise what the ordered merge of one range gives (1 * part / 1)
    merge = S > 1
    if merge:
        lse = torch.empty(B * Tw * Hq * S, dtype=torch.float32, device=q.device)
        opart = torch.empty(B * Tw * Hq * S * D, dtype=torch.float32, device=q.device)
    else:
        lse = opart = o  # unused
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    for t0 in range(0, T, Tw):
        _attn_fwd_kernel[(B * Hkv * cfg["n_tblocks"], S)](
            q, kv_k, kv_v, slots, start, o, lse, opart, g,
            T, t0, Tw, Hq, kv_len, cfg["n_tblocks"], float(scale) * _LOG2E,
            q.stride(0), q.stride(1), q.stride(2), q.stride(3),
            kv_k.stride(0), kv_k.stride(1), kv_k.stride(2), kv_k.stride(3),
            kv_v.stride(0), kv_v.stride(1), kv_v.stride(2), kv_v.stride(3),
            o.stride(0), o.stride(1), o.stride(2), o.stride(3),
            g.stride(0), g.stride(1), g.stride(2), g.stride(3),
            HKV=Hkv, G=cfg["G"], GP=cfg["GP"], BT=cfg["BT"], D=D, BN=cfg["BN"], NUM_SPLITS=S,
            SPLIT_KEYS=cfg["split_keys"], IEEE=ieee, INTERPRET=interpret, GATED=gate is not None,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
        if merge:
            Tn = min(Tw, T - t0)
            _attn_merge_kernel[(B * Tn * Hq,)](
                lse, opart, o, g,
                Tn, t0, Tw, Hq,
                o.stride(0), o.stride(1), o.stride(2), o.stride(3),
                g.stride(0), g.stride(1), g.stride(2), g.stride(3),
                D=D, NUM_SPLITS=S, SP=triton.next_power_of_2(S), ORDERED=split_invariant, GATED=gate is not None,
                num_warps=4 if D >= 128 else 2,
            )
    return o


def prefill_attention(q, kv_k, kv_v, slots, start, kv_len: int, scale: float, gate=None) -> torch.Tensor:
    """attention() with rows independent of the piece they are computed in (split-invariant prefill)."""
    return attention(q, kv_k, kv_v, slots, start, kv_len, scale, gate, split_invariant=True)
