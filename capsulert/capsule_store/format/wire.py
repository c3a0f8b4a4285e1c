"""A capsule packed for a worker-to-worker transfer, and its manifest.

The packed buffer: the capsule's tensors in one contiguous uint8 buffer on the engine device (one send, one
receive), each at a multiple of ALIGN, then a TRAILER the sender seals with the digest of the bytes before
it (so the check travels with the bytes: no message of its own, no host round trip on the sender). The
specs turn the buffer back into views.

The digest is exact integer arithmetic (the number of the buffer's 64-bit words, their sum and their
position-weighted sum, mod 2**64): integer sums do not depend on the order of the reduction, so the
sender's GPU, the receiver's GPU and a CPU all compute the same value, and no byte has to be copied to the
host for a sha256 (which would cost more than the transfer). It reads the words twice, laid out as rows of
_COLS: the row sums and the column sums give both sums (a product of each word with its weight would write
and read again a tensor as large as the buffer). It is not cryptographic: it guards the transfer against bytes that changed or went missing, as the sha256
of an object-store export does (any one changed word changes the plain sum; words swapped between positions
change the weighted one); capsule files keep their sha256.

The manifest is what the receiver needs before the bytes: the metadata without its token ids as JSON (small:
read before the receiver answers), then the token ids as int32 (turned into a CapsuleMeta while the bytes
move).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from array import array
from typing import Mapping, Sequence

import torch

from capsulert.capsule_store.capsule import CapsuleMeta
from capsulert.errors import CapsuleError, CorruptCapsuleError

ALIGN = 256  # every tensor of a packed buffer starts at a multiple of this (typed views need alignment)
TRAILER = ALIGN  # the seal: [state, words, sum, weighted sum] as int64, then zeros
_SEALED = int.from_bytes(b"capsule1", "little")
_FAILED = int.from_bytes(b"capsule0", "little")  # the sender failed after its manifest went out
_COLS = 256  # words per row of the digest's 2-D view: a row sum reads a contiguous KiB or two


def layout(pieces: Mapping[str, Sequence[torch.Tensor]], dim: int) -> tuple[list, int]:
    """Specs [name, dtype, shape, offset] of the tensors `pieces` make (each name's pieces concatenated along
    `dim`, a single piece as it is), in sorted-name order, and the bytes they take packed."""
    specs, size = [], 0
    for name in sorted(pieces):
        parts = pieces[name]
        shape = list(parts[-1].shape)
        if len(parts) > 1:
            shape[dim] = sum(p.shape[dim] for p in parts)
        specs.append([name, str(parts[0].dtype).removeprefix("torch."), shape, size])
        n = parts[0].element_size()
        for d in shape:
            n *= d
        size += -(-n // ALIGN) * ALIGN
    return specs, size


def pack_into(data: torch.Tensor, specs: list, pieces: Mapping[str, Sequence[torch.Tensor]], dim: int) -> None:
    """Copy `pieces` into `data` (a buffer of the size `layout` gave) where `specs` say: the pieces of a
    tensor held in blocks go straight into place (one copy, no concatenated tensor first)."""
    for view, (name, *_) in zip(tensor_views(data, specs).values(), specs):
        parts = pieces[name]
        if len(parts) == 1:
            view.copy_(parts[0])
        else:
            torch.cat(list(parts), dim=dim, out=view)


def tensor_views(buf: torch.Tensor, specs: list) -> dict[str, torch.Tensor]:
    """The tensors a packed buffer holds, as views of it (no copy)."""
    out = {}
    try:
        for name, dtype, shape, offset in specs:
            dt = getattr(torch, dtype)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"no dtype {dtype!r}")
            n = dt.itemsize
            for d in shape:
                n *= d
            if offset % ALIGN or offset + n > buf.numel():
                raise ValueError(f"{name}: {n} bytes at offset {offset} do not fit a {buf.numel()} byte buffer")
            out[name] = buf[offset:offset + n].view(dt).view(shape)
    except (AttributeError, TypeError, ValueError, RuntimeError) as e:
        raise CorruptCapsuleError(f"a packed capsule's tensor specs do not match its buffer: {e}") from None
    return out


def digest_words(data: torch.Tensor) -> torch.Tensor:
    """[n, sum of w_k, sum of (k + 1) * w_k] mod 2**64 over the n 64-bit words w_k of `data` (its size a
    multiple of 8), as int64 on its device; nothing is copied to the host."""
    words = data.view(torch.int64)
    n = words.numel()
    body = n - n % _COLS
    grid = words[:body].view(-1, _COLS)
    rows, cols = grid.sum(1), grid.sum(0)  # the two passes; word r * _COLS + c weighs r * _COLS + 1 + c
    tail = words[body:]
    dev = data.device
    row_weight = torch.arange(rows.numel(), dtype=torch.int64, device=dev) * _COLS + 1
    col_weight = torch.arange(_COLS, dtype=torch.int64, device=dev)
    tail_weight = torch.arange(body + 1, n + 1, dtype=torch.int64, device=dev)
    plain = rows.sum() + tail.sum()
    weighted = (rows * row_weight).sum() + (cols * col_weight).sum() + (tail * tail_weight).sum()
    return torch.stack([plain.new_full((), n), plain, weighted])  # a fill: no host copy, no wait


def _hex(words: Sequence[int]) -> str:
    n, total, weighted = (w % (1 << 64) for w in words)
    return f"{n:x}:{total:016x}{weighted:016x}"


def buffer_digest(buf: torch.Tensor) -> str:
    """32 hex digits (and the word count) over a buffer whose size is a multiple of 8, computed on its device."""
    return _hex(digest_words(buf).tolist())


def seal(buf: torch.Tensor, size: int, failed: bool = False) -> None:
    """Write the trailer after the `size` packed bytes of `buf`: the digest of those bytes, or (`failed`) a
    mark that tells the receiver the sender could not pack them. On CUDA it is queued, not waited for."""
    trailer = buf[size:size + TRAILER].view(torch.int64)
    trailer.zero_()
    trailer[:1].fill_(_FAILED if failed else _SEALED)
    if not failed:
        trailer[1:4].copy_(digest_words(buf[:size]))


def unseal(buf: torch.Tensor, size: int, name: str) -> str:
    """The digest of the first `size` bytes of a received buffer, checked against the sender's trailer (one
    host read for both); CorruptCapsuleError when they differ, CapsuleError when the sender failed."""
    got = torch.cat([buf[size:size + TRAILER].view(torch.int64)[:4], digest_words(buf[:size])]).tolist()
    state, theirs, mine = got[0], got[1:4], got[4:]
    if state == _FAILED:
        raise CapsuleError(f"the sending worker failed while packing capsule {name!r}; nothing was stored")
    if state != _SEALED or theirs != mine:
        raise CorruptCapsuleError(f"capsule {name!r} changed in transit (digest mismatch)")
    return _hex(mine)


# ---------------------------------------------------------------------- the manifest
_META_FIELDS = frozenset(f.name for f in dataclasses.fields(CapsuleMeta)) - {"tokens"}
_STR_FIELDS = ("name", "namespace", "token_digest", "fingerprint", "checksum")


def _token_bytes(tokens: Sequence[int]) -> bytes:
    arr = array("i", tokens)  # CapsuleMeta keeps them in [0, 2**31 - 1]
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def encode_manifest(meta: CapsuleMeta, origin: str | None, specs: list, nbytes: int) -> bytes:
    head = {"meta": {f: getattr(meta, f) for f in sorted(_META_FIELDS)}, "origin": origin, "specs": specs,
            "nbytes": nbytes}
    return _frame(head, _token_bytes(meta.tokens))


def encode_failure(e: BaseException) -> bytes:
    return _frame({"error": f"{type(e).__name__}: {e}"}, b"")


def _frame(head: dict, tail: bytes) -> bytes:
    text = json.dumps(head, separators=(",", ":"), allow_nan=False).encode()
    return len(text).to_bytes(4, "little") + text + tail


def decode_manifest(data: bytes) -> tuple[dict, bytes]:
    """(head, token bytes); ValueError when `data` is no manifest at all (the link is out of step)."""
    n = int.from_bytes(data[:4], "little")
    if len(data) < 4 + n:
        raise ValueError("a truncated manifest")
    head = json.loads(data[4:4 + n])
    if not isinstance(head, dict):
        raise ValueError("a manifest's head is not a JSON object")
    return head, data[4 + n:]


def manifest_meta(head: dict, tokens: bytes) -> CapsuleMeta:
    """The CapsuleMeta a manifest carries, validated as meta.py validates one."""
    fields = head.get("meta")
    if not isinstance(fields, dict) or set(fields) != _META_FIELDS:  # the sender sends every field
        raise CorruptCapsuleError("a transfer manifest's metadata fields are wrong")
    if any(not isinstance(fields[f], str) for f in _STR_FIELDS) or len(tokens) % 4:
        raise CorruptCapsuleError("a transfer manifest's metadata is malformed")
    # int32 by construction: the token checks left are the sign and the digest, both on the raw bytes (in C;
    # CapsuleMeta's own checks walk the ids as Python objects, ~1 ms for 16k tokens, on the receiver's path)
    if not tokens[3::4].isascii():  # the wire's int32 are little-endian: byte 3 holds the sign (< 0x80: ascii)
        raise CorruptCapsuleError("a transfer manifest's metadata is invalid: a token is negative")
    if token_digest_of_bytes(tokens) != fields["token_digest"]:
        raise CorruptCapsuleError("a transfer manifest's metadata is invalid: token_digest does not match tokens")
    arr = array("i")
    arr.frombytes(tokens)
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    try:
        return CapsuleMeta(**fields, tokens=tuple(arr), tokens_checked=True)
    except (ValueError, TypeError, OverflowError, CapsuleError) as e:
        raise CorruptCapsuleError(f"a transfer manifest's metadata is invalid: {e}") from None


def token_digest_of_bytes(data: bytes) -> str:
    """capsule.token_digest of the token ids whose little-endian int32 bytes are `data`."""
    return hashlib.sha256(data).hexdigest()
