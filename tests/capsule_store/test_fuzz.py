"""Hostile capsule files: hypothesis mutates a valid capsule file and feeds it to read_capsule and
CapsuleStore.load. Every case must end in a typed CapsuleError (corrupt / incompatible / bad name) or
in a correct load (tensors byte-identical to the original, checksum verified) -- never another
exception, a crash or a hang. Tensors are never read (safetensors is never opened) unless the header
claims exactly the bytes the file holds, so a header claiming terabytes allocates nothing.

Cases: byte flips 2500, truncations/extensions 1000, length field 1000, header rewrites 2500,
metadata rewrites 2500, store.load 600, a restart re-indexing the directory 400 (a mutated file beside a
sound one: the mutated one indexed exactly or set aside with a typed record, the sound one always
indexed): 10,500 in all (~35 s); CAPSULERT_FUZZ_SCALE=10 runs ten times as many. `pytest --hypothesis-show-statistics` shows how the cases ended.
"""
import json
import math
import os
import resource
import struct
import time

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis.control import currently_in_test_context
from hypothesis import strategies as st

from capsulert.capsule_store.format import disk
from capsulert.capsule_store.capsule import CapsuleMeta, tensor_nbytes, token_digest
from capsulert.capsule_store.format.checksum import tensors_checksum
from capsulert.capsule_store.format.names import capsule_file_name
from capsulert.capsule_store.store import CapsuleStore
from capsulert.errors import CorruptCapsuleError, IncompatibleCapsuleError, InvalidCapsuleNameError

TYPED = (CorruptCapsuleError, IncompatibleCapsuleError, InvalidCapsuleNameError)
FP, LAYOUT, NS, NAME = "fp-fuzz", 2, "tenant", "victim"
CASE_SECONDS = 5.0  # "no hang": any single case taking this long fails
RSS_GROWTH_LIMIT = 256 * 2**20  # no test may raise the process's peak RSS by more than this


SCALE = float(os.environ.get("CAPSULERT_FUZZ_SCALE", "1"))  # e.g. 10 for a longer hunt


def fuzz_settings(n):
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large])


# -- the valid capsule everything starts from ----------------------------------------------------
def _orig_tensors():
    g = torch.Generator().manual_seed(7)
    return {"kv_k": torch.randn(2, 3, 4, generator=g).to(torch.bfloat16),
            "kv_v": torch.randn(2, 3, 4, generator=g).to(torch.float16),
            "ssm": torch.randn(3, 5, generator=g),
            "pos": torch.tensor([9], dtype=torch.int64),
            "flags": torch.tensor([1, 0, 1], dtype=torch.uint8),
            "empty": torch.zeros(0, 4, dtype=torch.float32)}


ORIG = _orig_tensors()
_META = CapsuleMeta.build(name=NAME, namespace=NS, tokens=list(range(1000, 1040)), grid_pos=32,
                          fingerprint=FP, layout_version=LAYOUT, grid=32,
                          nbytes=tensor_nbytes(ORIG), recompute_cost_s=0.25, created_at=1.7e9)
FILE_NAME = capsule_file_name(NS, NAME)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("orig")
    path, meta = disk.write_capsule_with_meta(d, _META, ORIG)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return _Base((raw, n, meta))


class _Base(tuple):
    """(file bytes, header length, meta) of the valid capsule; a short repr keeps failure reports readable."""

    def __repr__(self):
        return f"<valid capsule file, {len(self[0])} bytes>"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


# -- watching the loader ---------------------------------------------------------------------------
class _Spy:
    calls = 0


@pytest.fixture(scope="module", autouse=True)
def spy_safe_open():
    """Count every time the loader opens the tensors (safetensors), and bound the peak RSS growth."""
    real = disk.safe_open

    def spying(*a, **kw):
        _Spy.calls += 1
        return real(*a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(disk, "safe_open", spying)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        yield
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert grown < RSS_GROWTH_LIMIT, f"peak RSS grew by {grown} bytes while fuzzing"


_DT = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
       "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def claimed_vs_held(raw: bytes):
    """Independently of the loader: (bytes the header's tensor entries claim, data bytes the file holds)."""
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    claimed = 0
    for k, e in header.items():
        if k != "__metadata__":
            claimed += math.prod(e["shape"]) * _DT[e["dtype"]]
    return claimed, len(raw) - 8 - n


def check_file(path, raw: bytes, *, data_changed: bool = False, via_store: bool = False) -> str:
    """Write `raw` to `path`, load it; check the outcome. Returns 'ok' or the error type's name."""
    path.write_bytes(raw)
    _Spy.calls = 0
    t0 = time.monotonic()
    try:
        if via_store:
            store = CapsuleStore(device="cpu", fingerprint=FP, layout_version=LAYOUT)
            assert store.load(path.parent) == 1
            (info,) = store.list()
            meta, tensors = store.get(info.name, info.namespace)
        else:
            meta, tensors = disk.read_capsule(path, FP, LAYOUT)
        outcome = "ok"
    except TYPED as e:
        outcome = type(e).__name__
        assert str(e)  # a clear message
        if "checksum mismatch" in str(e):
            outcome += " (checksum)"
    elapsed = time.monotonic() - t0
    assert elapsed < CASE_SECONDS, f"a case took {elapsed:.1f} s"
    if _Spy.calls:  # the tensors were opened only because the header claimed exactly the file's data
        claimed, held = claimed_vs_held(raw)
        assert claimed == held, (claimed, held)
    if currently_in_test_context():  # outcome counts for --hypothesis-show-statistics
        event(f"{outcome}{', tensors read' if _Spy.calls else ''}")
    if outcome == "ok":
        assert not data_changed, "a mutated data byte loaded silently"
        assert _Spy.calls == 1
        assert meta.checksum and tensors_checksum(tensors) == meta.checksum
        assert meta.fingerprint == FP and meta.layout_version == LAYOUT
        assert path.name == capsule_file_name(meta.namespace, meta.name)
        assert sorted(tensors) == sorted(ORIG)
        for k, t in ORIG.items():
            got = tensors[k]
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(got.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), k
    return outcome


def split(raw, n):
    return raw[8:8 + n], raw[8 + n:]


def assemble(header_bytes: bytes, data: bytes, n: int | None = None) -> bytes:
    return struct.pack("<Q", len(header_bytes) if n is None else n) + header_bytes + data


def test_base_file_loads(base, workdir):
    raw, _, _ = base
    assert check_file(workdir / FILE_NAME, raw) == "ok"
    assert check_file(workdir / FILE_NAME, raw, via_store=True) == "ok"


# -- 1. random byte flips (length field, header, data) ---------------------------------------------
@fuzz_settings(2500)
@given(data=st.data())
def test_byte_flips(base, workdir, data):
    raw, n, _ = base
    region = data.draw(st.sampled_from(["length", "header", "data", "anywhere"]))
    lo, hi = {"length": (0, 8), "header": (8, 8 + n), "data": (8 + n, len(raw)), "anywhere": (0, len(raw))}[region]
    flips = data.draw(st.lists(st.tuples(st.integers(lo, hi - 1), st.integers(1, 255)), min_size=1, max_size=8))
    buf = bytearray(raw)
    for off, mask in flips:
        buf[off] ^= mask
    data_changed = buf[8 + n:] != raw[8 + n:] and buf[:8] == raw[:8]
    out = check_file(workdir / FILE_NAME, bytes(buf), data_changed=data_changed)  # never "ok" if so
    if data_changed and buf[:8 + n] == raw[:8 + n]:  # only tensor bytes changed: the checksum catches it
        assert out == "CorruptCapsuleError (checksum)"


# -- 2. truncations and extensions -----------------------------------------------------------------
@fuzz_settings(1000)
@given(data=st.data())
def test_truncate_or_extend(base, workdir, data):
    raw, _, _ = base
    if data.draw(st.booleans()):
        cut = data.draw(st.integers(0, len(raw) - 1))
        mutated = raw[:cut]
    else:
        mutated = raw + data.draw(st.binary(min_size=1, max_size=300))
    assert check_file(workdir / FILE_NAME, mutated).startswith("CorruptCapsuleError")


# -- 3. the header length field ------------------------------------------------------------------
@fuzz_settings(1000)
@given(data=st.data())
def test_header_length_field(base, workdir, data):
    raw, n, _ = base
    new_n = data.draw(st.one_of(st.integers(0, 2**64 - 1), st.integers(max(0, n - 64), n + 64),
                                st.sampled_from([0, 1, 2**31, 2**32, 2**63, 2**64 - 1, len(raw), len(raw) - 8])))
    assume(new_n != n)
    out = check_file(workdir / FILE_NAME, struct.pack("<Q", new_n) + raw[8:])
    assert out.startswith("CorruptCapsuleError")


# -- 4. header JSON rewrites -----------------------------------------------------------------------
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
json_value = st.recursive(json_scalar, lambda c: st.one_of(st.lists(c, max_size=4),
                                                            st.dictionaries(st.text(max_size=6), c, max_size=4)),
                          max_leaves=12)
dtype_st = st.one_of(st.sampled_from(sorted(_DT) + ["F4", "F6_E2M3", "E8M0", "C64", "F8_E8M0", "f32", "", "I128"]),
                     json_value)
dim_st = st.one_of(st.integers(0, 8), st.integers(-5, -1), st.sampled_from([2**20, 2**31, 2**40, 2**62, 2**64 + 1]),
                   json_scalar)
shape_st = st.one_of(st.lists(dim_st, max_size=5), json_value,
                     st.lists(st.sampled_from([2**20, 2**30, 2**40]), min_size=1, max_size=3))  # terabytes
offset_st = st.one_of(st.integers(-100, 600), st.sampled_from([-1, 2**40, 2**63, 2**64, 2**64 + 5]), json_scalar)
offsets_st = st.one_of(st.lists(offset_st, min_size=2, max_size=2), st.lists(offset_st, max_size=4), json_value)


def _span(e):
    return e["data_offsets"][1] - e["data_offsets"][0]


@st.composite
def header_edits(draw, header):
    """Apply 1-4 random structural edits to a copy of the tensor part of a header."""
    h = json.loads(json.dumps(header))
    names = [k for k in h if k != "__metadata__"]
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["dtype", "shape", "offsets", "drop", "add", "extra_key", "rename",
                                     "swap", "huge", "overlap", "replace_entry", "top"]))
        name = draw(st.sampled_from(names))
        e = h.get(name)
        if not isinstance(e, dict):
            continue
        if kind == "dtype":
            e["dtype"] = draw(dtype_st)
        elif kind == "shape":
            e["shape"] = draw(shape_st)
        elif kind == "offsets":
            e["data_offsets"] = draw(offsets_st)
        elif kind == "drop":
            h.pop(name)
        elif kind == "add":
            h[draw(st.text(max_size=8))] = {"dtype": draw(dtype_st), "shape": draw(shape_st),
                                            "data_offsets": draw(offsets_st)}
        elif kind == "extra_key":
            e[draw(st.text(max_size=8))] = draw(json_value)
        elif kind == "rename":
            h[draw(st.sampled_from(["__metadata__", "", "../../etc/passwd", "kv_k", "x" * 300,
                                    "\u540d"]) | st.text(max_size=8))] = h.pop(name)
        elif kind == "swap":  # two tensors trade places in the data region
            other = h.get(draw(st.sampled_from(names)))
            if isinstance(other, dict) and "data_offsets" in e and "data_offsets" in other:
                e["data_offsets"], other["data_offsets"] = other["data_offsets"], e["data_offsets"]
        elif kind == "huge":  # a consistent entry that claims terabytes
            dim = draw(st.sampled_from([2**20, 2**30, 2**40, 2**50]))
            offs = e.get("data_offsets")
            b = offs[0] if isinstance(offs, list) and offs and type(offs[0]) is int else 0
            e.update(dtype="F32", shape=[dim, 1024], data_offsets=[b, b + dim * 1024 * 4])
        elif kind == "overlap":
            try:
                b = draw(st.integers(-4, 4)) + e["data_offsets"][0]
                e["data_offsets"] = [b, b + _span(e)]
            except (TypeError, KeyError, IndexError):
                pass
        elif kind == "replace_entry":
            h[name] = draw(json_value)
        elif kind == "top":
            return draw(st.one_of(json_value, st.just([h])))
    return h


@st.composite
def header_case(draw, base):
    raw, n, _ = base
    header = json.loads(raw[8:8 + n])
    md = header["__metadata__"]
    edited = draw(header_edits(header))
    if isinstance(edited, dict) and draw(st.booleans()):
        edited["__metadata__"] = md  # keep the metadata (so the tensor checks are what gets hit)
    elif isinstance(edited, dict) and draw(st.booleans()):
        edited["__metadata__"] = draw(st.one_of(json_value, st.fixed_dictionaries(
            {"capsulert.format": st.one_of(st.just("1"), json_value), "capsulert.meta": st.just(md["capsulert.meta"])},
            optional={"other": json_value})))
    hb = json.dumps(edited, allow_nan=True, indent=draw(st.sampled_from([None, 0, 2]))).encode()
    if draw(st.booleans()):
        hb += b" " * draw(st.integers(0, 7))  # safetensors pads headers with spaces
    data = raw[8 + n:]
    cut = draw(st.sampled_from(["keep", "keep", "shorter", "longer"]))
    if cut == "shorter":
        data = data[: draw(st.integers(0, len(data)))]
    elif cut == "longer":
        data = data + bytes(draw(st.integers(1, 64)))
    return assemble(hb, data)


@fuzz_settings(2500)
@given(data=st.data())
def test_header_rewrites(base, workdir, data):
    check_file(workdir / FILE_NAME, data.draw(header_case(base)))


# -- 5. metadata JSON rewrites ---------------------------------------------------------------------
path_names = st.sampled_from(["../victim", "/etc/passwd", "a/b", "..", ".", ".hidden", "C:\\x", "x\x00y", "",
                              "caf\u00e9", "x" * 201, "victim/../../x", "\ud800", "other-capsule", NAME])
hexes = st.text("0123456789abcdef", min_size=64, max_size=64)


@st.composite
def meta_case(draw, base):
    """A header whose capsulert.meta JSON was rewritten; returns (file bytes, file name to use)."""
    raw, n, meta = base
    header = json.loads(raw[8:8 + n])
    d = json.loads(header["__metadata__"]["capsulert.meta"])
    fields = sorted(d)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["value", "drop", "extra", "tokens", "digest", "grid", "name", "checksum",
                                     "numbers", "compat", "not_object"]))
        f = draw(st.sampled_from(fields))
        if kind == "value":
            d[f] = draw(json_value)
        elif kind == "drop":
            d.pop(f, None)
        elif kind == "extra":
            d[draw(st.text(max_size=10))] = draw(json_value)
        elif kind == "tokens":
            toks = draw(st.one_of(
                st.lists(st.integers(-2**33, 2**33), max_size=50),
                st.builds(lambda k, v: [v] * k, st.sampled_from([0, 1, 40, 10_000, 200_000]), st.integers(0, 2**31 - 1)),
                st.lists(json_scalar, max_size=5)))
            d["tokens"] = toks
            if draw(st.booleans()):  # consistent digest and boundary: only the token checks remain
                try:
                    d["token_digest"], d["boundary"] = token_digest(toks), len(toks)
                    d["grid_pos"] = min(d["grid_pos"], len(toks)) if isinstance(d.get("grid_pos"), int) else 0
                except (TypeError, OverflowError, ValueError):
                    pass
        elif kind == "digest":
            d["token_digest"] = draw(st.one_of(hexes, st.text(max_size=70), json_value))
        elif kind == "grid":
            d["grid_pos"] = draw(st.one_of(st.integers(41, 2**64), st.integers(-2**64, -1), json_scalar))
        elif kind == "name":
            d[draw(st.sampled_from(["name", "namespace"]))] = draw(st.one_of(path_names, st.text(max_size=12)))
        elif kind == "checksum":
            c = d.get("checksum") if isinstance(d.get("checksum"), str) else "0" * 64
            d["checksum"] = draw(st.one_of(hexes, st.just(c.upper()), st.just(c[:-1]), st.just(""), st.just(c + "0"),
                                           st.just(c[:-1] + ("0" if c[-1:] != "0" else "1")), json_value))
        elif kind == "numbers":
            d[draw(st.sampled_from(["created_at", "recompute_cost_s", "nbytes", "grid", "boundary",
                                    "layout_version"]))] = draw(st.one_of(
                st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**70, 2**70),
                st.sampled_from([10**400, -(10**400), 2**64, 0, -1, True, "1", None])))
        elif kind == "compat":
            d[draw(st.sampled_from(["fingerprint", "layout_version"]))] = draw(
                st.one_of(st.sampled_from(["other-model", "", LAYOUT + 1, 0]), json_scalar))
        elif kind == "not_object":
            d = draw(json_value)
            break
    meta_json = json.dumps(d, allow_nan=True)
    if draw(st.integers(0, 9)) == 0:  # raw text damage on top
        pos = draw(st.integers(0, max(0, len(meta_json) - 1)))
        meta_json = meta_json[:pos] + draw(st.text(max_size=4)) + meta_json[pos + 1:]
    header["__metadata__"]["capsulert.meta"] = meta_json
    hb = json.dumps(header).encode()
    # a renamed capsule only gets past the file-name check if the file is renamed too: do that sometimes
    fname = FILE_NAME
    if isinstance(d, dict) and draw(st.booleans()):
        try:
            fname = capsule_file_name(d.get("namespace"), d.get("name"))
        except (TypeError, UnicodeEncodeError):
            pass
    return assemble(hb, raw[8 + n:]), fname


@fuzz_settings(2500)
@given(data=st.data())
def test_metadata_rewrites(base, workdir, data):
    raw, fname = data.draw(meta_case(base))
    for p in workdir.iterdir():
        p.unlink()
    check_file(workdir / fname, raw)


# -- 6. the same mutations through CapsuleStore.load ------------------------------------------------
def draw_mutation(data, base) -> tuple[str, bytes, str, bool]:
    """(kind, mutated file bytes, its file name, whether a tensor data byte changed with the header intact)."""
    raw, n, _ = base
    kind = data.draw(st.sampled_from(["flip", "cut", "header", "meta"]))
    fname = FILE_NAME
    data_changed = False
    if kind == "flip":
        buf = bytearray(raw)
        for off, mask in data.draw(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(1, 255)),
                                            min_size=1, max_size=4)):
            buf[off] ^= mask
        data_changed = buf[8 + n:] != raw[8 + n:] and buf[:8] == raw[:8]
        mutated = bytes(buf)
    elif kind == "cut":
        mutated = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif kind == "header":
        mutated = data.draw(header_case(base))
    else:
        mutated, fname = data.draw(meta_case(base))
    return kind, mutated, fname, data_changed


def empty_dir(d):
    """`d`, emptied (files, its quarantine/ and the owner lock of an earlier case)."""
    d.mkdir(exist_ok=True)
    for p in d.rglob("*"):
        if p.is_file():
            p.unlink()
    return d


@fuzz_settings(600)
@given(data=st.data())
def test_store_load(base, workdir, data):
    raw, n, _ = base
    kind, mutated, fname, data_changed = draw_mutation(data, base)
    d = empty_dir(workdir / "store")
    out = check_file(d / fname, mutated, data_changed=data_changed, via_store=True)  # never "ok" if so
    if kind == "cut":
        assert out.startswith("CorruptCapsuleError")
    if data_changed and mutated[:8 + n] == raw[:8 + n]:  # only tensor bytes changed: the checksum catches it
        assert out == "CorruptCapsuleError (checksum)"


# -- 7. the same mutations at a restart: a store taking the directory as its disk_dir ------------------
KEEPER = ("zz-keeper-space", "keeper")  # a sound capsule beside the mutated one (a name no mutation makes)


@fuzz_settings(400)
@given(data=st.data())
def test_restart_reindex(base, workdir, data):
    """Issue 29 items 4-6: a store (a restarted engine or worker) indexes the capsule files of its disk_dir
    one at a time. A mutated file must end indexed with its exact bytes, or set aside into quarantine/ with
    a typed record, never anything else: the start never fails, and the sound file beside it is always
    indexed, bitwise."""
    raw, n, _ = base
    kind, mutated, fname, data_changed = draw_mutation(data, base)
    d = empty_dir(workdir / "restart")
    keeper = _META.replace(name=KEEPER[1], namespace=KEEPER[0])
    disk.write_capsule_with_meta(d, keeper, ORIG)
    (d / fname).write_bytes(mutated)
    t0 = time.monotonic()
    store = CapsuleStore(device="cpu", fingerprint=FP, layout_version=LAYOUT, disk_dir=d)
    try:
        assert time.monotonic() - t0 < CASE_SECONDS
        listed = {(i.namespace, i.name) for i in store.list()}
        assert KEEPER in listed and all(torch.equal(store.get(KEEPER[1], KEEPER[0])[1][k].view(torch.uint8),
                                                    t.contiguous().view(torch.uint8)) for k, t in ORIG.items())
        if store.quarantined:
            [q] = store.quarantined
            assert q.error in {t.__name__ for t in TYPED} and q.message
            assert q.moved_to and (d / "quarantine" / fname).read_bytes() == mutated and not (d / fname).exists()
            assert listed == {KEEPER}
            event(f"restart: set aside ({q.error})")
        else:  # indexed: then it is the original capsule, byte for byte
            assert not data_changed, "a mutated data byte was indexed silently"
            (other,) = listed - {KEEPER}
            meta, tensors = store.get(other[1], other[0])
            assert tensors_checksum(tensors) == meta.checksum and sorted(tensors) == sorted(ORIG)
            for k, t in ORIG.items():
                assert torch.equal(tensors[k].contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), k
            event("restart: indexed")
        if kind == "cut":
            assert store.quarantined
    finally:
        store.close()


# -- direct regressions for what the fuzzer found ---------------------------------------------------
@pytest.mark.parametrize("edit", [
    lambda d: d.update(created_at=10**400),        # OverflowError from math.isfinite / float()
    lambda d: d.update(recompute_cost_s=-(10**400)),
])
def test_found_meta_huge_ints(base, workdir, edit):
    raw, n, _ = base
    header = json.loads(raw[8:8 + n])
    d = json.loads(header["__metadata__"]["capsulert.meta"])
    edit(d)
    header["__metadata__"]["capsulert.meta"] = json.dumps(d)
    assert check_file(workdir / FILE_NAME, assemble(json.dumps(header).encode(), raw[8 + n:])) == "CorruptCapsuleError"


@pytest.mark.parametrize("dtype", [["F32"], {"a": 1}])
def test_found_unhashable_dtype(base, workdir, dtype):
    raw, n, _ = base
    header = json.loads(raw[8:8 + n])
    header["ssm"]["dtype"] = dtype  # TypeError: unhashable type in `dtype in _DTYPE_SIZES`
    assert check_file(workdir / FILE_NAME, assemble(json.dumps(header).encode(), raw[8 + n:])) == "CorruptCapsuleError"


def test_terabyte_header_refused_before_reading(base, workdir):
    raw, n, _ = base
    header = json.loads(raw[8:8 + n])
    b = header["ssm"]["data_offsets"][0]
    header["ssm"].update(shape=[2**40, 1024], data_offsets=[b, b + 2**42 * 1024])
    assert check_file(workdir / FILE_NAME, assemble(json.dumps(header).encode(), raw[8 + n:])) == "CorruptCapsuleError"
    assert _Spy.calls == 0  # refused from the header alone: no tensor was read or allocated
