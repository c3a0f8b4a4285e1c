"""Benchmarks put bench/ on sys.path (tests import bench/soak.py); none of their module names may shadow
a top-level package that libraries probe for (transformers imports any top-level `kernels` it finds)."""
import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
PROBED = {"kernels", "triton", "fla", "flash_attn", "causal_conv1d", "torch", "transformers", "ray", "numpy"}


def test_bench_modules_do_not_shadow_probed_packages():
    names = {p.stem for p in BENCH.glob("*.py")}
    assert not names & PROBED, names & PROBED
    for name in names:  # nor any module installed in this environment (namespace dirs have no origin)
        spec = importlib.util.find_spec(name)
        assert spec is None or spec.origin is None or Path(spec.origin).parent == BENCH, \
            f"bench/{name}.py shadows {spec.origin}"
