"""Weights have identities, not counters. The version counter starts at 0 in every process, so a capsule
made under update 1 of one process used to restore silently under another process's (different) update 1.
Now the fingerprint names the weights: a checkpoint directory's content digest, a random id for tensors, or
the identity the caller gives (an orchestrator gives every worker the same one)."""
import shutil

import pytest
import torch
from safetensors.torch import save_file

from capsulert.errors import NoFreeSlotError, StaleCapsuleError, WeightUpdateError
from capsulert.protocol.sampling import SamplingParams
from tests.worker.test_weight_versions import cold, nudged

NOEOS = SamplingParams(ignore_eos=True)


def checkpoint(engine, model_dir, path, seed):
    """A checkpoint directory of the engine's model with nudged weights."""
    path.mkdir()
    for f in model_dir.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, path / f.name)
    save_file({k: v.contiguous() for k, v in nudged(engine, seed).items()}, str(path / "model.safetensors"))
    return path


def test_a_capsule_of_another_process_update_with_the_same_counter_is_stale(make_engine, text, tmp_path):
    disk = str(tmp_path / "disk")
    first = make_engine(disk_dir=disk)
    assert first.update_weights(nudged(first, seed=1)) == 1
    s = first.open()
    s.append(text[:300])
    s.snapshot("w1", tier="disk")
    s.snapshot("w1-pinned", tier="disk", pin=True)
    first.close()

    second = make_engine(disk_dir=disk)  # a restart: the counter starts at 0 again
    assert {i.name for i in second.store.list()} >= {"w1", "w1-pinned"}
    assert second.update_weights(nudged(second, seed=2)) == 1  # the same counter, other weights
    for name in ("w1", "w1-pinned"):
        with pytest.raises(StaleCapsuleError, match="other weights"):
            second.restore(name)
    assert second.free_slots == second.config.slots
    second.rebuild("w1")  # rebuilt under these weights it restores bitwise a cold prefill of them
    r = second.restore("w1")
    ref = cold(second, r.tokens)
    assert torch.equal(r.logits(), ref.logits())


def test_a_checkpoint_directory_update_is_named_by_its_content(make_engine, model_dir, text, tmp_path):
    eng = make_engine(disk_dir=str(tmp_path / "disk"))
    a = checkpoint(eng, model_dir, tmp_path / "a", seed=3)
    b = checkpoint(eng, model_dir, tmp_path / "b", seed=4)
    eng.update_weights(a)
    s = eng.open()
    s.append(text[:300])
    s.snapshot("under-a", tier="disk")
    want = s.generate(8, NOEOS)
    ident_a = eng.weights_identity
    eng.close()

    other = make_engine(disk_dir=str(tmp_path / "disk"))
    other.update_weights(b)  # version 1 too, of other bytes
    assert other.weights_identity != ident_a and other.weights_version == 1
    with pytest.raises(StaleCapsuleError):
        other.restore("under-a")
    other.close()

    again = make_engine(disk_dir=str(tmp_path / "disk"))
    again.update_weights(a)  # the same bytes as the first process's update 1: its capsules are current again
    assert again.weights_identity == ident_a
    assert again.restore("under-a").generate(8, NOEOS) == want


def test_an_identity_is_checked_and_kept(make_engine):
    eng = make_engine()
    same = {k: v.clone() for k, v in eng.model_weights.items()}
    for bad in ("", "a" * 65, "with space", "dot.ted", 7):
        with pytest.raises(WeightUpdateError, match="identity"):
            eng.update_weights(same, identity=bad)
    assert eng.weights_version == 0 and eng.weights_identity == ""
    eng.update_weights(same, identity="run-7_step-12")
    assert eng.weights_identity == "run-7_step-12" and eng.weights_version == 1
    eng.update_weights(same)  # tensors: a random identity each time
    first = eng.weights_identity
    eng.update_weights(same)
    assert len({first, eng.weights_identity, "run-7_step-12"}) == 3


def test_rebuild_pinned_without_a_free_slot_changes_nothing(make_engine, text):
    eng = make_engine(slots=2)
    s = eng.open()
    s.append(text[:200])
    s.snapshot("pinned", pin=True)
    held = eng.open()
    fingerprint, logits = eng.fingerprint, s.logits().clone()
    with pytest.raises(NoFreeSlotError, match="unchanged"):
        eng.update_weights(nudged(eng), rebuild_pinned=True)
    assert eng.fingerprint == fingerprint and eng.weights_version == 0 and not s.stale
    assert torch.equal(s.logits(), logits)  # the old weights still compute it
    held.close()
    assert eng.update_weights(nudged(eng), rebuild_pinned=True) == 1
    assert eng.store.info("pinned").meta.fingerprint == eng.fingerprint
    s.close()
    r = eng.restore("pinned")
    ref = cold(eng, r.tokens)
    assert torch.equal(r.logits(), ref.logits())


@pytest.mark.parametrize("verb", ["append", "rederive"])
async def test_an_append_an_update_lands_in_leaves_the_session_as_it_was(make_engine, text, verb):
    """The step scheduler prefills in budgeted pieces; an update between two of them made the next piece
    fail with StaleSessionError and left the pieces before it in the session (a client that re-derived and
    resent its prompt duplicated them). Now the session holds what it held before the call."""
    from capsulert.errors import StaleSessionError
    from capsulert.sessions.local import AsyncEngine

    eng = make_engine()
    prompt, more = eng.tokenize(text)[:200], eng.tokenize(text * 2)[:700]
    new = nudged(eng)
    pieces = []
    original = eng.append_checked

    def append_then_update(session, ids):  # the update lands between the call's first and second pieces
        original(session, ids)
        pieces.append(len(ids))
        if len(pieces) == 1:
            eng.update_weights(new)
    async with AsyncEngine(eng, step_prefill_tokens=128) as aeng:
        s = await aeng.open(prompt)
        before = await s.tokens()
        if verb == "rederive":
            eng.update_weights(nudged(eng, seed=9))  # stale: its rederive re-prefills in pieces
        eng.append_checked = append_then_update
        with pytest.raises(StaleSessionError):
            await (s.append(more) if verb == "append" else s.rederive())
        eng.append_checked = original
        assert pieces[0] > 0 and await s.tokens() == before  # nothing of the failed call stayed
        assert await s.rederive() == len(before)
        got = await s.generate(8, NOEOS)
    ref = cold(eng, before)
    assert got == ref.generate(8, NOEOS)
