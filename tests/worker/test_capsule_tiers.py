"""Capsules across tiers and processes, and every refusal of the capsule verbs."""
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from capsulert.capsule_store.format.names import capsule_file_name
from capsulert.errors import (
    BudgetExceededError,
    ConfigError,
    CorruptCapsuleError,
    DuplicateCapsuleError,
    ForeignSessionError,
    IncompatibleCapsuleError,
    InvalidCapsuleNameError,
    InvalidRequestError,
    NoFreeSlotError,
    UnknownCapsuleError,
    UnsupportedStateModeError,
)
from tests.models import MODELS

P = 301


@pytest.fixture
def tiered(make_engine, tmp_path):
    return make_engine(disk_dir=str(tmp_path / "disk"))


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_gpu_host_disk_then_new_process_restores_bitwise(tiered, text, tmp_path, model_dir):
    eng = tiered
    tokens = eng.tokenize(text)
    prefix, suffix = tokens[:P], tokens[P:P + 40]
    s = eng.open()
    s.append(prefix)
    s.snapshot("c")
    for tier in ("host", "disk"):
        eng.store.demote("c", tier)
        assert eng.store.info("c").tier == tier
    r = eng.restore("c")  # promotes to the device tier first
    assert eng.store.info("c").tier == "device"
    cold = eng.open()
    cold_logits = cold.append(prefix + suffix)
    assert torch.equal(r.append(suffix), cold_logits)
    eng.store.demote("c", "disk")
    saved = tmp_path / "saved"
    assert eng.store.save(saved) == 1
    out = tmp_path / "out.safetensors"
    script = textwrap.dedent(f"""
        import torch
        from safetensors.torch import save_file
        from capsulert.engine.engine import Engine
        torch.set_num_threads({torch.get_num_threads()})  # same reduction order as this process
        eng = Engine.from_config(model={str(model_dir)!r}, device={eng.device.type!r}, slots=4, max_seq=2048, prefill_chunk=128)
        assert eng.store.load({str(saved)!r}) == 1
        s = eng.restore("c")
        logits = s.append({suffix!r})
        toks = s.generate(16)
        save_file({{"logits": logits.cpu(), "tokens": torch.tensor(toks)}}, {str(out)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = load_file(str(out))
    assert torch.equal(got["logits"], cold_logits.cpu())
    assert got["tokens"].tolist() == cold.generate(16)


def snapshot_state(eng):
    return [(c.meta.name, c.tier, c.pinned) for c in eng.store.list()], eng.store.stats()


def test_refusals_change_nothing(make_engine, tiered, text, tmp_path):
    eng = tiered
    s = eng.open()
    s.append(text[:600])
    s.snapshot("c")
    bystander = eng.open()
    bystander.append(text[300:700])
    expected = eng.fork("c", 1)[0]
    expected_tokens = expected.generate(8)
    expected.close()
    before = snapshot_state(eng)

    def unchanged():
        assert snapshot_state(eng) == before

    cases = [
        (UnknownCapsuleError, lambda: eng.restore("nope")),
        (UnknownCapsuleError, lambda: s.restore("nope")),
        (DuplicateCapsuleError, lambda: s.snapshot("c")),
        (InvalidCapsuleNameError, lambda: s.snapshot("../x")),
        (InvalidCapsuleNameError, lambda: s.snapshot("/etc/passwd")),
        (InvalidCapsuleNameError, lambda: s.snapshot("a\x00b")),
        (UnsupportedStateModeError, lambda: s.snapshot("kv", mode="kv_only")),
        (InvalidRequestError, lambda: eng.fork("c", 0)),
        (NoFreeSlotError, lambda: eng.fork("c", eng.free_slots + 1)),
    ]
    for err, call in cases:
        free = eng.free_slots
        with pytest.raises(err):
            call()
        unchanged()
        assert eng.free_slots == free
    other = make_engine()
    foreign = other.open()
    with pytest.raises(ForeignSessionError):
        eng.snapshot(foreign, "f")
    with pytest.raises(ForeignSessionError):
        eng.restore_into(foreign, "c")
    unchanged()
    # pinned capsules alone over a budget: a new capsule cannot displace them, nor can a shrink
    eng.store.pin("c")
    eng.store.set_budget("device", eng.store.info("c").meta.nbytes + 10)
    eng.store.set_budget("host", 0)
    eng.store.set_budget("disk", 0)
    before = snapshot_state(eng)
    with pytest.raises(BudgetExceededError):
        bystander.snapshot("too-much", tier="device")
    with pytest.raises(BudgetExceededError):
        eng.store.set_budget("device", 10)
    unchanged()
    r = eng.fork("c", 1)[0]
    assert r.generate(8) == expected_tokens  # the bystander and the capsule still work
    assert bystander.generate(4)


def test_corrupt_or_foreign_files_are_refused_on_load(make_engine, tiered, text, tmp_path):
    eng = tiered
    s = eng.open()
    s.append(text[:600])
    s.snapshot("c")
    saved = tmp_path / "saved"
    eng.store.save(saved)
    path = saved / capsule_file_name("default", "c")
    assert path.is_file() and len(path.name.split(".")[0]) == 40  # named by a hash, never by the user's name

    fresh = make_engine()
    raw = path.read_bytes()
    path.write_bytes(raw[:-7] + bytes([raw[-7] ^ 1]) + raw[-6:])  # flip one tensor byte
    with pytest.raises(CorruptCapsuleError):
        fresh.store.load(saved)
    path.write_bytes(raw[: len(raw) // 2])  # truncated
    with pytest.raises(CorruptCapsuleError):
        fresh.store.load(saved)
    assert fresh.store.list() == []
    path.write_bytes(raw)
    other_chunk = make_engine(prefill_chunk=256)  # same weights, another prefill piece: the same 64-token grid
    assert other_chunk.store.load(saved) == 1
    assert other_chunk.restore("c").tokens == s.tokens
    newer = make_engine()  # the same model under newer weights: loads, and its restore is refused as stale
    newer.update_weights({k: v.clone() for k, v in newer.model_weights.items()})
    assert newer.store.load(saved) == 1
    with pytest.raises(IncompatibleCapsuleError):
        newer.restore("c")
    assert newer.free_slots == newer.config.slots
    other_dtype = "float32" if eng.dtype == torch.bfloat16 else "bfloat16"
    if eng.device.type == "cuda":  # a one-row fp32 GEMM gets other bits on the H200: CUDA refuses fp32
        with pytest.raises(ConfigError, match="dtype='bfloat16'"):
            make_engine(dtype=other_dtype)
    foreign = make_engine(dtype=other_dtype, device="cpu")  # another dtype is another model fingerprint
    with pytest.raises(IncompatibleCapsuleError):
        foreign.store.load(saved)
    assert foreign.store.list() == []
    assert fresh.store.load(saved) == 1
    assert torch.equal(fresh.restore("c").logits(), s.logits())
