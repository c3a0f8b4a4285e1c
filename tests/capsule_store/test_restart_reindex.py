"""Issue 29 items 4 and 6: the disk tier across restarts. An engine restarted on the same disk_dir used to
load none of the capsules it had written there (and left their files unindexed, uncounted). Now the store
indexes them at start, one file at a time, each verified in full: a file that does not verify is moved
into quarantine/ with a typed record and the rest are indexed, counted in the disk budget."""
import torch

from capsulert.capsule_store import capsule_file_name
from capsulert.capsule_store.format.blockfiles import block_files, referenced_blocks
from capsulert.capsule_store.format.disk import list_capsule_files
from capsulert.capsule_store.quarantine import QUARANTINE_DIR


def disk_capsules(make_engine, disk, text, names):
    """An engine on `disk` with capsules `names` in its disk tier (prefixes of one text: they share blocks);
    each one's next-token logits at snapshot time."""
    eng = make_engine(disk_dir=str(disk))
    want = {}
    for i, name in enumerate(names):
        s = eng.open()
        s.append(text[:260 + 40 * i])
        want[name] = s.logits()
        s.snapshot(name, tier="disk")
        s.close()
    return eng, want


def test_a_restarted_engine_indexes_its_disk_tier_and_restores_it_bitwise(make_engine, text, tmp_path):
    disk = tmp_path / "disk"
    eng, want = disk_capsules(make_engine, disk, text, ["a", "b", "c"])
    used = eng.store.stats()["disk"]["bytes"]
    eng.store.close(flush=False)  # as a crash would: the files stay
    again = make_engine(disk_dir=str(disk))
    assert again.store.reindexed == 3 and again.store.quarantined == []
    assert {i.name: i.tier for i in again.store.list()} == dict.fromkeys("abc", "disk")
    assert again.store.stats()["disk"]["bytes"] == used  # counted in the budget, each block once
    for name, logits in want.items():
        r = again.restore(name)
        assert torch.equal(r.logits(), logits)
        r.close()


def test_a_damaged_file_is_set_aside_and_the_others_are_indexed(make_engine, text, tmp_path):
    disk = tmp_path / "disk"
    eng, want = disk_capsules(make_engine, disk, text, ["a", "b", "c"])
    eng.store.close()
    bad = disk / capsule_file_name("default", "b")
    raw = bytearray(bad.read_bytes())
    raw[-7] ^= 0x40  # one flipped bit in its tensor bytes
    bad.write_bytes(bytes(raw))
    again = make_engine(disk_dir=str(disk))
    [q] = again.store.quarantined
    assert q.path == str(bad) and q.error == "CorruptCapsuleError" and "checksum" in q.message
    assert q.moved_to == str(disk / QUARANTINE_DIR / bad.name) and (disk / QUARANTINE_DIR / bad.name).is_file()
    assert again.store.stats()["quarantined"] == 1
    assert sorted(i.name for i in again.store.list()) == ["a", "c"] and not bad.exists()
    for name in ("a", "c"):
        r = again.restore(name)
        assert torch.equal(r.logits(), want[name])
        r.close()
    # no block file is left that no capsule file references, and every referenced one is there
    assert set(block_files(disk)) == set(referenced_blocks(disk))


def test_a_disk_budget_smaller_than_the_files_keeps_the_newest(make_engine, text, tmp_path):
    disk = tmp_path / "disk"
    eng, want = disk_capsules(make_engine, disk, text, ["old", "mid", "new"])
    sizes = {i.name: i.own_nbytes for i in eng.store.list()}
    budget = eng.store.stats()["disk"]["bytes"] - sizes["old"]  # room for all but the oldest one's own bytes
    eng.store.close()
    again = make_engine(disk_dir=str(disk), capsule_budgets={"disk": budget})
    assert sorted(i.name for i in again.store.list()) == ["mid", "new"]
    assert again.store.stats()["disk"]["bytes"] <= budget and again.store.stats()["dropped"] == 1
    assert {p.name for p in list_capsule_files(disk)} == {capsule_file_name("default", n) for n in ("mid", "new")}
    assert set(block_files(disk)) == set(referenced_blocks(disk))
    r = again.restore("new")
    assert torch.equal(r.logits(), want["new"])
