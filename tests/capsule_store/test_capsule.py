import json

import pytest
import torch

from capsulert.capsule_store.capsule import CapsuleMeta, token_digest, validate_name
from capsulert.capsule_store.format.checksum import tensors_checksum
from capsulert.capsule_store.format.meta import OPTIONAL_FIELDS, meta_from_json, meta_to_json
from capsulert.capsule_store.format.names import capsule_file_name
from capsulert.errors import CorruptCapsuleError, InvalidCapsuleNameError


def make_meta(**kw):
    args = dict(name="sys-prompt_v1.2", namespace="default", tokens=[5, 6, 7, 8], grid_pos=0,
                fingerprint="fp0", layout_version=1, grid=64, nbytes=16, recompute_cost_s=0.5)
    args.update(kw)
    return CapsuleMeta.build(**args)


@pytest.mark.parametrize("bad", ["../x", "/etc/passwd", "a\x00b", "..", ".", ".hidden", "", "x" * 201,
                                 "caf\u00e9", "\u540d\u524d", "a/b", "a\\b", "C:\\x", "a b", "a\n", "~x", 3, None])
def test_names_refused(bad):
    with pytest.raises(InvalidCapsuleNameError):
        validate_name(bad)


@pytest.mark.parametrize("good", ["sys-prompt_v1.2", "a:b@c", "x" * 200, "a+b=c", "-", "A.B..c"])
def test_names_accepted(good):
    assert validate_name(good) == good


def test_meta_json_round_trip():
    m = make_meta().replace(checksum="ab" * 32)
    m2 = meta_from_json(meta_to_json(m))
    assert m2 == m and isinstance(m2.tokens, tuple)
    assert json.loads(meta_to_json(m))["tokens"] == [5, 6, 7, 8]
    # the format on disk and on the wire: compact, keys sorted, every field once (the optional ones only
    # when set: a capsule without them reads in builds that predate them)
    fields = {f: getattr(m, f) for f in m.__dataclass_fields__ if f != "tokens_checked" and f not in OPTIONAL_FIELDS}
    assert meta_to_json(m) == json.dumps({**fields, "tokens": [5, 6, 7, 8]}, separators=(",", ":"), sort_keys=True)


def test_token_digest_is_int32_le():
    import hashlib
    import struct

    assert token_digest([1, 2]) == hashlib.sha256(struct.pack("<2i", 1, 2)).hexdigest()
    assert token_digest([]) == hashlib.sha256(b"").hexdigest()


def _mutate(**changes):
    d = json.loads(meta_to_json(make_meta()))
    for k, v in changes.items():
        if v is KeyError:
            del d[k]
        else:
            d[k] = v
    return json.dumps(d)


@pytest.mark.parametrize("text", [
    "not json", "[]", "null", '{"name": "a"}',
    _mutate(extra=1), _mutate(boundary=KeyError),
    _mutate(boundary=5), _mutate(boundary=-1), _mutate(boundary="4"), _mutate(boundary=True),
    _mutate(grid_pos=5), _mutate(grid_pos=-1), _mutate(grid_pos=1.5),
    _mutate(tokens=[5, 6, 7, 9]), _mutate(tokens="abcd"), _mutate(tokens=[5, 6, 7, -8]),
    _mutate(tokens=[5, 6, 7, 2**31]), _mutate(tokens=[5, 6, 7, 8.0]),
    _mutate(token_digest="00" * 32), _mutate(token_digest="XYZ"),
    _mutate(fingerprint=""), _mutate(fingerprint=3), _mutate(layout_version=-1),
    _mutate(grid=0), _mutate(nbytes=-1), _mutate(created_at=-1.0), _mutate(created_at="now"),
    _mutate(recompute_cost_s=-0.1), _mutate(checksum="zz"), _mutate(checksum="AB" * 32),
    _mutate(name="../x"), _mutate(namespace=""), _mutate(name=7),
    _mutate(recompute_cost_s=float("nan")), _mutate(created_at=float("inf")),
])
def test_malformed_meta_refused(text):
    with pytest.raises(CorruptCapsuleError):
        meta_from_json(text)


def test_meta_constructor_validates():
    with pytest.raises(ValueError):
        make_meta(grid_pos=10)
    with pytest.raises(InvalidCapsuleNameError):
        make_meta(name="a/b")


def test_file_name_hides_name_and_separates_namespaces():
    f = capsule_file_name("ns", "secret-name")
    assert "secret" not in f and f.endswith(".capsule.safetensors") and len(f) == 40 + len(".capsule.safetensors")
    assert capsule_file_name("a", "b:c") != capsule_file_name("a:b", "c")


def test_checksum_sensitive_to_bytes_name_dtype_shape():
    x = torch.arange(6, dtype=torch.float32)
    base = tensors_checksum({"a": x})
    assert base == tensors_checksum({"a": x.clone()})
    assert base != tensors_checksum({"b": x})
    assert base != tensors_checksum({"a": x.reshape(2, 3)})
    assert base != tensors_checksum({"a": x.view(torch.int32)})
    y = x.clone()
    y[3] = -0.0 if y[3] == 0 else y[3] + 1
    assert base != tensors_checksum({"a": y})
