"""The checkpoint fingerprint is hashed once per set of files and kept by their identity; a changed weight
file is another model, whose capsules an engine refuses."""
from __future__ import annotations

import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from capsulert.errors import IncompatibleCapsuleError, ModelLoadError
from capsulert.engine import fingerprint
from capsulert.engine.engine import Engine
from capsulert.engine.fingerprint import checkpoint_fingerprint

WEIGHTS = "model.safetensors"


@pytest.fixture
def model_copy(default_model_dir, tmp_path):
    """A copy of the default model's files (the fixture's directory is shared by the whole session)."""
    return shutil.copytree(default_model_dir, tmp_path / "model")


def _perturb(model_dir) -> None:
    """Rewrite the weights with one value changed (a fine-tune of one parameter)."""
    weights = load_file(model_dir / WEIGHTS)
    weights["model.norm.weight"][0] += 1.0
    save_file(weights, str(model_dir / WEIGHTS), metadata={"format": "pt"})


def test_same_files_are_hashed_once(model_copy, tmp_path):
    cache = tmp_path / "cache"
    before = fingerprint.hash_count
    first = checkpoint_fingerprint(model_copy, cache)
    assert fingerprint.hash_count == before + 1 and len(first) == 64
    for _ in range(3):
        assert checkpoint_fingerprint(model_copy, cache) == first
    assert fingerprint.hash_count == before + 1  # read back from the cache, no weight read
    assert len(list(cache.iterdir())) == 1


def test_a_changed_weight_file_is_another_fingerprint(model_copy, tmp_path):
    cache = tmp_path / "cache"
    first = checkpoint_fingerprint(model_copy, cache)
    _perturb(model_copy)
    before = fingerprint.hash_count
    second = checkpoint_fingerprint(model_copy, cache)
    assert second != first and fingerprint.hash_count == before + 1
    assert checkpoint_fingerprint(model_copy, cache) == second and fingerprint.hash_count == before + 1


def test_a_replaced_file_of_the_same_size_and_mtime_is_hashed_again(model_copy, tmp_path):
    """A file replaced by another of the same size, its mtime set back, is still noticed: a new inode, or
    (where the file system hands the freed inode number out again) a new ctime, which no one can set."""
    cache = tmp_path / "cache"
    first = checkpoint_fingerprint(model_copy, cache)
    path = model_copy / WEIGHTS
    st = path.stat()
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1  # the last byte of the last tensor
    path.unlink()
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size
    before = fingerprint.hash_count
    assert checkpoint_fingerprint(model_copy, cache) != first and fingerprint.hash_count == before + 1


def test_byte_identical_copies_agree(default_model_dir, model_copy, tmp_path):
    """The digest covers the bytes, not where they are: every node's copy of a model has one fingerprint."""
    assert checkpoint_fingerprint(default_model_dir, tmp_path / "a") == checkpoint_fingerprint(model_copy, tmp_path / "b")


def test_a_damaged_cache_file_is_hashed_again(model_copy, tmp_path):
    cache = tmp_path / "cache"
    first = checkpoint_fingerprint(model_copy, cache)
    (entry,) = cache.iterdir()
    entry.write_text("{not json")
    before = fingerprint.hash_count
    assert checkpoint_fingerprint(model_copy, cache) == first and fingerprint.hash_count == before + 1


def test_a_directory_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no safetensors"):
        checkpoint_fingerprint(tmp_path, tmp_path / "cache")


def test_an_engine_refuses_a_capsule_of_changed_weights(model_copy, tmp_path):
    cfg = dict(device="cpu", slots=2, max_seq=512, prefill_chunk=128)
    before = fingerprint.hash_count
    made = Engine.from_config(model=str(model_copy), **cfg)
    s = made.open()
    s.append("A capsule made by the first weights.")
    s.snapshot("c")
    made.store.save(tmp_path / "saved")
    again = Engine.from_config(model=str(model_copy), **cfg)  # same files: same model, no hash
    assert again.fingerprint == made.fingerprint and fingerprint.hash_count == before + 1
    assert again.store.load(tmp_path / "saved") == 1
    _perturb(model_copy)
    changed = Engine.from_config(model=str(model_copy), **cfg)
    assert changed.fingerprint != made.fingerprint
    with pytest.raises(IncompatibleCapsuleError):
        changed.store.load(tmp_path / "saved")
    assert changed.store.list() == []
