"""A capsule packed for a transfer (capsule_store/format/wire.py): tensors packed straight from their
pieces and viewed back, the digest (exact, order-sensitive, the same however it is computed), the seal that
carries it with the bytes (a changed byte anywhere is caught; a failed pack is told apart), and the manifest
(the metadata and its token ids; what does not check out is refused)."""
import pytest
import torch

from capsulert.capsule_store.capsule import CapsuleMeta
from capsulert.errors import CapsuleError, CorruptCapsuleError
from capsulert.capsule_store.format import wire as packed_capsule
from capsulert.capsule_store.format.wire import (
    ALIGN, TRAILER, buffer_digest, decode_manifest, encode_manifest, layout, manifest_meta, pack_into, seal,
    tensor_views, unseal)


def pack_tensors(tensors: dict[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, list]:
    """The tensors packed into one buffer on `device` (no trailer), and their specs."""
    pieces = {k: [t] for k, t in tensors.items()}
    specs, size = layout(pieces, 0)
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    pack_into(buf, specs, pieces, 0)
    return buf, specs


def test_pack_and_views_round_trip_every_dtype_and_the_empty_capsule():
    tensors = {"kv": torch.randn(3, 5, dtype=torch.bfloat16), "pos": torch.tensor(7, dtype=torch.int32),
               "empty": torch.zeros(0, 4), "ssm": torch.randn(2, 3).t()}  # a strided one too
    buf, specs = pack_tensors(tensors, torch.device("cpu"))
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    back = tensor_views(buf, specs)
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape and torch.equal(back[k], t)
    buf, specs = pack_tensors({}, torch.device("cpu"))
    assert buf.numel() == 0 and tensor_views(buf, specs) == {}
    with pytest.raises(CorruptCapsuleError):
        tensor_views(torch.empty(16, dtype=torch.uint8), [["x", "float32", [8], 0]])


def test_pieces_are_packed_straight_into_place_as_their_concatenation():
    kv = torch.randn(2, 11, 3, dtype=torch.bfloat16)
    pieces = {"kv": [kv[:, :4], kv[:, 4:8], kv[:, 8:]], "state": [torch.randn(5)]}
    specs, size = layout(pieces, 1)
    assert [s[2] for s in specs] == [[2, 11, 3], [5]] and size % ALIGN == 0
    buf = torch.empty(size, dtype=torch.uint8)
    pack_into(buf, specs, pieces, 1)
    views = tensor_views(buf, specs)
    assert torch.equal(views["kv"], kv) and torch.equal(views["state"], pieces["state"][0])


def test_the_buffer_digest_is_exact_order_sensitive_and_the_same_for_any_row_width(monkeypatch):
    g = torch.Generator().manual_seed(3)
    for n in (0, 8, 4096 * 8, 4096 * 8 + 264):  # empty, one word, whole rows, rows and a tail
        buf = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        words = buf.view(torch.int64).tolist()
        total = sum(words) % (1 << 64)
        weighted = sum((k + 1) * w for k, w in enumerate(words)) % (1 << 64)
        want = f"{len(words):x}:{total:016x}{weighted:016x}"  # the definition, word by word
        assert buffer_digest(buf) == want
        for cols in (1, 7, 4096):  # how the words are laid out for the two passes changes nothing
            monkeypatch.setattr(packed_capsule, "_COLS", cols)
            assert buffer_digest(buf) == want
        monkeypatch.undo()
    d = buffer_digest(buf)
    for i in (0, 1, 4096, buf.numel() - 9, buf.numel() - 1):  # a flipped bit in any byte: rows and the tail
        for bit in (0, 7):
            flipped = buf.clone()
            flipped[i] ^= 1 << bit
            assert buffer_digest(flipped) != d
    words = buf.view(torch.int64).clone()
    words[[3, 9]] = words[[9, 3]]  # the same words in another order: the plain sum alone would not see it
    assert buffer_digest(words.view(torch.uint8)) != d
    assert buffer_digest(buf[:-ALIGN]) != d  # a missing tail


def test_the_seal_catches_a_changed_byte_anywhere_and_tells_a_failed_pack_apart():
    for tensors in ({"kv": torch.randn(4, 300), "pos": torch.tensor([5])}, {}):
        data, specs = pack_tensors(tensors, torch.device("cpu"))
        size = data.numel()
        buf = torch.cat([data, torch.empty(TRAILER, dtype=torch.uint8)])
        seal(buf, size)
        assert unseal(buf, size, "c") == buffer_digest(data)
        for i in ([0, size // 2, size - 1] if size else []) + [size, size + 8, size + 31]:  # bytes, then the seal
            bad = buf.clone()
            bad[i] ^= 0x10
            with pytest.raises(CorruptCapsuleError, match="changed in transit"):
                unseal(bad, size, "c")
        seal(buf, size, failed=True)
        with pytest.raises(CapsuleError, match="failed while packing") as err:
            unseal(buf, size, "c")
        assert not isinstance(err.value, CorruptCapsuleError)


def test_the_manifest_carries_the_metadata_and_refuses_what_does_not_check_out():
    meta = CapsuleMeta.build(name="m", namespace="ns", tokens=list(range(1000, 1300)), grid_pos=256,
                             fingerprint="model:x", layout_version=1, grid=128, nbytes=4096)
    wire = encode_manifest(meta, "origin-1", [["kv", "float32", [1024], 0]], 4096)
    head, tokens = decode_manifest(wire)
    assert head["origin"] == "origin-1" and head["nbytes"] == 4096 and len(tokens) == 4 * 300
    assert manifest_meta(head, tokens) == meta
    bad_token = bytearray(tokens)
    bad_token[40] ^= 1
    with pytest.raises(CorruptCapsuleError, match="invalid"):  # the token digest does not match
        manifest_meta(head, bytes(bad_token))
    for broken in ({**head, "meta": {k: v for k, v in head["meta"].items() if k != "fingerprint"}},
                   {**head, "meta": {**head["meta"], "checksum": 7}}):
        with pytest.raises(CorruptCapsuleError):
            manifest_meta(broken, tokens)
    with pytest.raises(CorruptCapsuleError):
        manifest_meta(head, tokens[:-2])
    with pytest.raises(ValueError):
        decode_manifest(b"\xff\xff\x00\x00not json")


@pytest.mark.parametrize("change", ["a negative token", "another token"])
def test_a_manifest_whose_token_ids_changed_is_refused(change):
    meta = CapsuleMeta.build(name="m", tokens=list(range(1000, 1300)), grid_pos=256, fingerprint="fp",
                             layout_version=1, grid=128, nbytes=1, decoded_from=300)
    head, tokens = decode_manifest(encode_manifest(meta, None, [], 0))
    assert manifest_meta(head, tokens) == meta
    wire = bytearray(tokens)
    if change == "a negative token":
        wire[4 * 7 + 3] |= 0x80
    else:
        wire[4 * 7] ^= 1
    with pytest.raises(CorruptCapsuleError, match="negative" if change == "a negative token" else "token_digest"):
        manifest_meta(head, bytes(wire))
