import json
import os
import struct

import pytest
import torch

from capsulert.capsule_store.capsule import CapsuleMeta, tensor_nbytes
from capsulert.capsule_store.format.names import capsule_file_name
from capsulert.capsule_store.format.disk import read_capsule, read_header, write_capsule, write_capsule_with_meta
from capsulert.errors import CorruptCapsuleError, IncompatibleCapsuleError


def rand_tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    bits16 = torch.randint(-2**15, 2**15, (3, 5, 4), generator=g, dtype=torch.int16)
    bits16[0, 0, 0] = 0x7FC1  # a NaN with a payload
    bits32 = torch.randint(-2**31, 2**31 - 1, (2, 7), generator=g, dtype=torch.int32)
    bits32[0, 0] = 0x7FA00001  # a signalling-NaN bit pattern
    return {"kv_k": bits16.view(torch.bfloat16), "ssm": bits32.view(torch.float32),
            "pos": torch.tensor([4], dtype=torch.int32), "conv": torch.randn(2, 3, 3, generator=g).to(torch.float16)}


def as_bits(t):
    return t.contiguous().view(torch.uint8)


def assert_exact(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(as_bits(a[k]), as_bits(b[k])), k


def meta_for(tensors, name="secret-capsule", **kw):
    args = dict(name=name, namespace="ns", tokens=list(range(100, 140)), grid_pos=32, fingerprint="fp0",
                layout_version=3, grid=32, nbytes=tensor_nbytes(tensors), recompute_cost_s=0.01)
    args.update(kw)
    return CapsuleMeta.build(**args)


@pytest.fixture
def written(tmp_path):
    t = rand_tensors()
    path, meta = write_capsule_with_meta(tmp_path, meta_for(t), t)
    return path, meta, t


def test_round_trip_byte_exact(written):
    path, meta, t = written
    m2, t2 = read_capsule(path, "fp0", 3)
    assert m2 == meta and len(m2.checksum) == 64
    assert_exact(t, t2)
    assert t2["kv_k"].dtype == torch.bfloat16


def test_noncontiguous_views_are_written_as_values(tmp_path):
    big = torch.arange(64, dtype=torch.float32).reshape(4, 16)
    t = {"a": big[:, 2:5], "b": big[1]}  # views sharing storage
    path = write_capsule(tmp_path, meta_for({"a": t["a"].contiguous(), "b": t["b"]}), t)
    _, t2 = read_capsule(path, "fp0", 3)
    assert torch.equal(t2["a"], big[:, 2:5]) and torch.equal(t2["b"], big[1])


def test_file_name_never_contains_user_name(written, tmp_path):
    path, meta, _ = written
    assert "secret" not in path.name and path.name == capsule_file_name("ns", "secret-capsule")
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left


def _data_start(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return 8 + n


def test_checksum_mismatch(written):
    path, _, _ = written
    raw = bytearray(path.read_bytes())
    start = _data_start(path)
    for off in (start, start + 7, len(raw) - 1):
        bad = bytearray(raw)
        bad[off] ^= 0x01
        path.write_bytes(bytes(bad))
        with pytest.raises(CorruptCapsuleError, match="checksum"):
            read_capsule(path, "fp0", 3)


@pytest.mark.parametrize("frac", [0.0, 0.001, 0.01, 0.3, 0.5, 0.9, 0.999])
def test_truncated(written, frac):
    path, _, _ = written
    raw = path.read_bytes()
    path.write_bytes(raw[: int(len(raw) * frac)])
    with pytest.raises(CorruptCapsuleError):
        read_capsule(path, "fp0", 3)


def test_truncated_by_one_and_extended(written):
    path, _, _ = written
    raw = path.read_bytes()
    for data in (raw[:-1], raw + b"\x00", raw[:7], raw[:8], raw[: _data_start(path)]):
        path.write_bytes(data)
        with pytest.raises(CorruptCapsuleError):
            read_capsule(path, "fp0", 3)


def test_wrong_fingerprint_or_layout(written):
    path, _, _ = written
    with pytest.raises(IncompatibleCapsuleError, match="model"):
        read_capsule(path, "other", 3)
    with pytest.raises(IncompatibleCapsuleError, match="layout"):
        read_capsule(path, "fp0", 4)


def _rewrite_header(path, edit):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    hb = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])


def test_header_claiming_more_bytes_than_file(written):
    path, _, _ = written

    def grow(h):  # the last tensor in the data region claims 2 GB
        name = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])
        e, size = h[name], {"BF16": 2, "F16": 2, "F32": 4, "I32": 4}[h[name]["dtype"]]
        e["shape"] = [2**30]
        e["data_offsets"] = [e["data_offsets"][0], e["data_offsets"][0] + 2**30 * size]
    _rewrite_header(path, grow)
    with pytest.raises(CorruptCapsuleError, match="header declares"):
        read_capsule(path, "fp0", 3)


def test_header_length_past_file_end(written):
    path, _, _ = written
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**62) + raw[8:])
    with pytest.raises(CorruptCapsuleError, match="header claims"):
        read_capsule(path, "fp0", 3)


def test_max_bytes(written):
    path, meta, _ = written
    with pytest.raises(CorruptCapsuleError, match="more than the allowed"):
        read_header(path, max_bytes=meta.nbytes - 1)
    assert read_header(path, max_bytes=meta.nbytes)[0] == meta


@pytest.mark.parametrize("edit", [
    lambda h: h.pop("__metadata__"),
    lambda h: h["__metadata__"].update({"capsulert.format": "2"}),
    lambda h: h["__metadata__"].update({"capsulert.meta": "{bad"}),
    lambda h: h["__metadata__"].pop("capsulert.meta"),
    lambda h: h["kv_k"].update({"dtype": "Q99"}),
    lambda h: h["kv_k"].update({"shape": [-1]}),
    lambda h: h["pos"].update({"data_offsets": [0, 4]}),
    lambda h: h.update({"extra": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0], "x": 1}}),
])
def test_malformed_header(written, edit):
    path, _, _ = written
    _rewrite_header(path, edit)
    with pytest.raises(CorruptCapsuleError):
        read_capsule(path, "fp0", 3)


def test_renamed_file_refused(written):
    path, _, _ = written
    other = path.parent / capsule_file_name("ns", "another")
    os.replace(path, other)
    with pytest.raises(CorruptCapsuleError, match="file name"):
        read_capsule(other, "fp0", 3)


def test_garbage_and_missing_files(tmp_path):
    p = tmp_path / capsule_file_name("ns", "x")
    p.write_bytes(os.urandom(1000))
    with pytest.raises(CorruptCapsuleError):
        read_capsule(p, "fp0", 3)
    with pytest.raises(CorruptCapsuleError):
        read_capsule(tmp_path / "missing.capsule.safetensors", "fp0", 3)


def test_nbytes_mismatch_on_write(tmp_path):
    t = rand_tensors()
    with pytest.raises(ValueError):
        write_capsule(tmp_path, meta_for(t, nbytes=1), t)
