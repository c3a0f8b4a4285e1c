"""Promotion copies, never moves, out of the disk tier. One restore used to promote a disk capsule to the
gpu tier and delete its file, pinned ones included, so after the next restart it was gone. Now the file
stays (counted in the disk tier, `on_disk`) until a delete, a drop or disk budget pressure removes it, and
a restarted engine on the same disk_dir re-indexes it."""
import torch

from capsulert.capsule_store import capsule_file_name
from capsulert.capsule_store.format.disk import list_capsule_files


def test_restored_disk_capsules_survive_a_restart(make_engine, text, tmp_path):
    disk = tmp_path / "disk"
    eng = make_engine(disk_dir=str(disk))
    s = eng.open()
    s.append(text[:300])
    s.snapshot("unpinned", tier="disk")
    s.snapshot("pinned", tier="disk", pin=True)
    want = s.logits().clone()
    disk_bytes = eng.store.stats()["disk"]["bytes"]
    for name in ("unpinned", "pinned"):
        r = eng.restore(name)
        assert torch.equal(r.logits(), want)
        r.close()
        info = eng.store.info(name)
        assert info.tier == "device" and info.on_disk  # promoted: a copy in memory, the file kept
    files = {p.name for p in list_capsule_files(disk)}
    assert files == {capsule_file_name("default", n) for n in ("unpinned", "pinned")}
    assert eng.store.stats()["disk"]["bytes"] == disk_bytes  # still counted there
    eng.store.demote("unpinned", "disk")  # back down: its file is there already, nothing is written
    assert eng.store.info("unpinned").tier == "disk"
    eng.close()

    again = make_engine(disk_dir=str(disk))  # a restart on the same disk_dir
    assert {i.name for i in again.store.list()} == {"unpinned", "pinned"}
    for name in ("unpinned", "pinned"):
        assert torch.equal(again.restore(name).logits(), want)
    again.store.delete("pinned")  # a delete removes the file too
    assert {p.name for p in list_capsule_files(disk)} == {capsule_file_name("default", "unpinned")}


def test_disk_budget_pressure_drops_copies_before_capsules(make_engine, text, tmp_path):
    eng = make_engine(disk_dir=str(tmp_path / "disk"))
    s = eng.open()
    s.append(text[:300])
    for name in ("a", "b"):
        s.snapshot(name, tier="disk")
    eng.restore("a").close()  # a is in gpu now, with its disk copy
    eng.store.set_budget("disk", eng.store.info("b").meta.nbytes)  # room for one file: a's copy goes, b stays
    assert {i.name: (i.tier, i.on_disk) for i in eng.store.list()} == {"a": ("device", False), "b": ("disk", True)}
    assert eng.store.stats()["dropped"] == 0
    assert {p.name for p in list_capsule_files(tmp_path / "disk")} == {capsule_file_name("default", "b")}


def test_every_session_a_restore_makes_says_where_the_capsule_was(make_engine, text, tmp_path):
    eng = make_engine(disk_dir=str(tmp_path / "disk"))
    s = eng.open()
    s.append(text[:200])
    s.snapshot("c", tier="disk")
    assert s.restored_from is None  # opened, not restored
    first = eng.restore("c")
    assert first.restored_from == "disk"
    assert [b.restored_from for b in eng.fork("c", 2)] == ["device", "device"]  # promoted by the first read
