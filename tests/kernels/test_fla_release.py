"""kernels/fla_gated_delta.py drives fla's internal stages, so only under the release they were written for:
any other installed release is refused with a ConfigError that names the one to install (no silent run of
changed internals, no silent fallback)."""
import pytest

from capsulert.errors import ConfigError
from capsulert.kernels.fla_gated_delta import FLA_RELEASE, check_fla_release


def test_the_pinned_release_passes():
    check_fla_release(FLA_RELEASE)
    check_fla_release(FLA_RELEASE + "+cu130")  # a local build tag of the same release


@pytest.mark.parametrize("version", ["0.5.9", "0.6.1", "0.7.0", "unknown"])
def test_another_release_is_refused_naming_the_pinned_one(version):
    with pytest.raises(ConfigError, match=rf"flash-linear-attention {version} is installed.*=={FLA_RELEASE}"):
        check_fla_release(version)


def test_the_gpu_extra_pins_the_same_release():
    import tomllib
    from pathlib import Path

    extra = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert extra["project"]["optional-dependencies"]["gpu"] == [f"flash-linear-attention=={FLA_RELEASE}"]
