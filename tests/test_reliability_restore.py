"""A refused restore changes nothing. Restoring an incompatible capsule (here one made under other weights)
used to promote it to the gpu tier first (demoting another capsule to make room) and only then refuse; the
compatibility check now runs on the capsule's metadata and tensor shapes, before any tier move."""
import pytest

from capsulert.errors import IncompatibleCapsuleError


def listing(eng):
    return [(i.name, i.tier, i.pinned) for i in eng.store.list()], eng.store.stats(), eng.free_slots


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_incompatible_restore_moves_nothing(make_engine, text, tmp_path, tier, monkeypatch):
    maker = make_engine(prefill_chunk=128)
    s = maker.open()
    s.append(text[:300])
    with monkeypatch.context() as m:  # a capsule of weights version 1 (this engine runs version 0)
        m.setattr(maker.runner, "fingerprint", f"{maker.fingerprint}@w1")
        s.snapshot("foreign")
    maker.store.save(tmp_path / "saved")

    eng = make_engine(prefill_chunk=256, disk_dir=str(tmp_path / "disk"))  # same weights: same fingerprint
    own = eng.open()
    own.append(text[:1200])
    ref = own.snapshot("own")  # fills the gpu tier: promoting "foreign" would push it down
    eng.store.set_budget("device", ref.nbytes)
    assert eng.store.load(tmp_path / "saved") == 1
    if tier == "disk":
        eng.store.demote("foreign", "disk")
    assert eng.store.info("foreign").nbytes <= ref.nbytes  # so only the check can stop the promotion
    before = listing(eng)
    for restore in (lambda: eng.restore("foreign"), lambda: eng.fork("foreign", 2), lambda: own.restore("foreign")):
        with pytest.raises(IncompatibleCapsuleError, match="weights version 1"):
            restore()
        assert listing(eng) == before
    assert own.logits() is not None and eng.restore("own").tokens == own.tokens
