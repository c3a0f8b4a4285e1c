"""format/export.py: a capsule as host bytes for another worker (ExportCapsule / ImportCapsule)."""
import json

import pytest
import torch

from capsulert.capsule_store.capsule import CapsuleMeta
from capsulert.capsule_store.format.checksum import tensors_checksum
from capsulert.capsule_store.format.export import decode_export_meta, decode_export_tensors, encode_export
from capsulert.capsule_store.format.names import capsule_file, capsule_file_name
from capsulert.errors import CorruptCapsuleError


def capsule():
    tensors = {"kv": torch.arange(24, dtype=torch.float32).reshape(2, 3, 4), "ssm": torch.ones(5, dtype=torch.bfloat16)}
    meta = CapsuleMeta.build(name="c", tokens=[1, 2, 3], grid_pos=0, fingerprint="fp", layout_version=3, grid=64,
                             nbytes=sum(t.numel() * t.element_size() for t in tensors.values()))
    return meta, tensors


def test_an_export_round_trips_bitwise_with_its_checksum_filled():
    meta, tensors = capsule()
    meta_json, checksum, blob = encode_export(meta, tensors)
    assert checksum == tensors_checksum(tensors) and json.loads(meta_json)["checksum"] == checksum
    got_meta, got = decode_export_tensors(decode_export_meta(meta_json), checksum, blob)
    assert got_meta == meta.replace(checksum=checksum)
    assert sorted(got) == sorted(tensors)
    assert all(got[k].dtype == t.dtype and torch.equal(got[k], t) for k, t in tensors.items())


def test_bytes_changed_in_transit_are_refused():
    meta, tensors = capsule()
    meta_json, checksum, blob = encode_export(meta, tensors)
    flipped = bytearray(blob)
    flipped[-1] ^= 0x01  # the last byte of the last tensor's data
    with pytest.raises(CorruptCapsuleError, match="changed in transit"):
        decode_export_tensors(meta, checksum, bytes(flipped))


@pytest.mark.parametrize("blob", [b"", b"not safetensors at all", b"\xff" * 16])
def test_a_blob_that_is_not_safetensors_is_a_typed_error(blob):
    meta, tensors = capsule()
    with pytest.raises(CorruptCapsuleError, match="not a safetensors blob"):
        decode_export_tensors(meta, tensors_checksum(tensors), blob)


def test_bad_export_metadata_is_a_typed_error():
    with pytest.raises(CorruptCapsuleError):
        decode_export_meta("{not json")


def test_capsule_file_is_where_the_name_says(tmp_path):
    assert capsule_file(tmp_path, "ns", "x") == tmp_path / capsule_file_name("ns", "x")
    assert capsule_file(str(tmp_path), "ns", "x").parent == tmp_path
