import inspect
import io
import os

import pytest
import torch

from capsulert.engine.default_model import ensure_default_model, generate
from capsulert.engine.engine import Engine
from tests.models import TINY_MOE_CONFIG

PROMPT = (
    "The capsule runtime keeps the complete state of a session at a committed boundary, so an agent can "
    "return to a long shared context in milliseconds. A hybrid model folds the whole prefix into its "
    "recurrent state; the attention layers keep keys and values for every position. Restoring only the "
    "keys and values would lose the fold, and the continuation would drift away from the original one. "
)


try:
    import triton  # noqa: F401
except ImportError:
    # the Triton kernel tests are GPU tests (marker `gpu`); without triton they cannot even be imported,
    # so a CPU environment (which must not have triton: transformers' CPU path breaks with it) ignores them
    collect_ignore = ["kernels/test_triton_kernels.py", "kernels/test_fused_kernels.py", "kernels/test_moe_kernels.py",
                      "kernels/test_moe_plan.py", "kernels/test_prefill_kernels.py", "kernels/test_fla_grid.py",
                      "kernels/test_gate_cumsum_kernel.py"]
try:
    import fla  # noqa: F401
except ImportError:
    # fla's chunked kernels (kernels/fla_gated_delta.py) run on CUDA only, with fla installed
    collect_ignore = sorted(set(globals().get("collect_ignore", [])) | {"kernels/test_fla_grid.py"})


def pytest_configure(config):
    # one intra-op thread: the suite runs on 2-core machines next to Ray workers, where spinning
    # worker threads slow every kernel by an order of magnitude
    torch.set_num_threads(1)
    # the programs the tests start (docs blocks, examples, `capsulert demo`/`serve`) share the cores with the
    # other test worker (`make test` runs two) the same way
    os.environ["OMP_NUM_THREADS"] = "1"
    # a Ray started without an address is a new local one, never another cluster on this machine: Ray's
    # Cluster (tests/orchestrator/multinode_scenario.py) records its address in /tmp/ray for every
    # `ray.init()` there to join while it runs, and a test in another worker would join it
    os.environ["RAY_ADDRESS"] = "local"


# test files whose module-scoped fixtures (a `capsulert serve`, an orchestrator and its Ray workers, a generated
# model) are worth starting once: under pytest-xdist (`make test`) each runs whole on one worker
WHOLE_FILE_DIRS = ("tests/orchestrator/", "tests/serve/")
WHOLE_FILES = ("tests/worker/test_default_model.py", "tests/capsule_store/test_fuzz.py", "tests/chat/test_chat_api.py",
               "tests/worker/test_speculate.py")


# files that share a fixture run as one unit, so that it starts once: tests/serve/conftest.py's SharedServer
# servers (`server` and `agent_server`, each for its group of modules), and the local Ray of
# tests/orchestrator/conftest.py (stopped when its worker moves on: its files run one after another, not
# interleaved with the serve files, which would start it again for each)
FILE_GROUPS = {"tests/serve/test_server.py": "serve-server", "tests/serve/test_tools_structured.py": "serve-server",
               "tests/serve/test_frameworks.py": "agent-server", "tests/serve/test_load.py": "agent-server",
               "tests/serve/test_responses_api.py": "agent-server"}
DIR_GROUPS = ("tests/orchestrator/",)


# tests that share a module-level cache of their reference runs (the parametrizations of one test): run
# together, so that the cache is filled once, not once on each worker
TEST_GROUPS = ("tests/worker/test_append_many.py::test_a_batched_append_is_bitwise_each_sessions_own[",
               "tests/worker/test_exactness_v2.py::test_generate_n_equals_generate_k_snapshot_restore_generate_rest[")


def work_unit(nodeid: str) -> str:
    """What one xdist worker runs together: a group of FILE_GROUPS, DIR_GROUPS or TEST_GROUPS, a whole file of
    WHOLE_FILES or WHOLE_FILE_DIRS, else the test alone."""
    file = nodeid.split("::", 1)[0]
    if file in FILE_GROUPS:
        return FILE_GROUPS[file]
    for prefix in TEST_GROUPS:
        if nodeid.startswith(prefix):
            return prefix
    for folder in DIR_GROUPS:
        if file.startswith(folder):
            return folder
    return file if file.startswith(WHOLE_FILE_DIRS) or file in WHOLE_FILES else nodeid


# Rough seconds a test takes on the 2-core CPU box under `make test` (from a `--durations` profile; the longest
# matching node-id prefix counts, DEFAULT_COST_S for the rest). Only their order matters: the scheduler hands
# out the most expensive units first, so the run does not end with one worker busy on a long test or a server
# group while the other has nothing left (longest-processing-time-first). Out of date numbers cost wall time,
# never a test.
DEFAULT_COST_S = 0.5
COST_S = {
    "tests/orchestrator/": 3.0,  # a module-scoped orchestrator and its Ray workers for most modules
    "tests/orchestrator/test_soak.py": 55, "tests/orchestrator/test_multinode.py": 40,
    "tests/orchestrator/test_worker_logs.py": 32, "tests/orchestrator/test_weight_identity_remote.py": 15,
    "tests/orchestrator/test_worker_restarts.py": 10,
    "tests/serve/test_server.py": 1.5, "tests/serve/test_tools_structured.py": 3,
    "tests/serve/test_frameworks.py": 15, "tests/serve/test_load.py": 35, "tests/serve/test_responses_api.py": 4,
    "tests/serve/test_docs_http.py": 15, "tests/serve/test_serve_proxy.py": 40, "tests/serve/test_serve_cli.py": 3,
    "tests/serve/test_serve_parts.py::test_serve_refuses_bad_settings_before_starting": 5,
    "tests/capsule_store/test_fuzz.py": 6, "tests/capsule_store/test_crash_safety.py::test_sigkill_during_saves": 15,
    "tests/capsule_store/test_store_trace.py::test_random_trace_keeps_invariants": 11,
    "tests/test_docs_code.py::test_block_runs_as_written": 18, "tests/test_docs_code.py::test_example_runs": 20,
    "tests/test_reliability_fuzz.py::test_stateful_fuzz": 50, "tests/test_examples_rl.py::test_rl_training": 33,
    "tests/test_packaging.py::test_wheel_works": 27, "tests/test_packaging.py::test_import_capsulert_is_light": 14,
    "tests/test_bench_http.py::test_both_paths": 23, "tests/test_bench_http.py::test_no_gpu": 5,
    "tests/test_demo.py::test_demo_quick": 20, "tests/test_readme.py::test_readme_engine_example_runs": 12,
    "tests/test_cli.py::test_demo_passes": 11, "tests/test_docs_site.py::test_strict_mode_fails_on": 8,
    "tests/worker/test_exactness_stateful.py": 54, "tests/worker/test_exactness_v2.py": 3,
    "tests/worker/test_exactness_v2.py::test_batched_generate_keeps_every_grid_point_canonical[dense]": 27,
    "tests/worker/test_exactness_v2.py::test_generate_n_equals": 6,
    "tests/worker/test_append_many.py::test_a_batched_append_is_bitwise_each_sessions_own[": 15,
    "tests/worker/test_prefix_cache.py::test_named_capsules_share": 17,
    "tests/worker/test_decode_fast_paths.py::test_a_group_sampled_in_place": 17,
    "tests/worker/test_scheduler.py::test_concurrent_requests_equal_their_solo_runs": 13,
    "tests/worker/test_constrained.py::test_batch_of_8_mixed": 10, "tests/worker/test_capsule_tiers.py::test_gpu_host": 9,
    "tests/worker/test_grid64.py::test_prefill_in_any_pieces": 9, "tests/worker/test_grid64.py::test_sessions_crossing": 9,
}


def unit_cost(nodeid: str) -> float:
    best = max((p for p in COST_S if nodeid.startswith(p)), key=len, default=None)
    return DEFAULT_COST_S if best is None else COST_S[best]


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n N` (--dist load): xdist's scope scheduling over work_unit. Its units go out most expensive first
    (COST_S), each to whichever worker is free. (`--dist loadgroup` would say this with marks, but xdist 3.8
    cannot regroup tests under pytest 9's node ids.)"""
    if config.getvalue("dist") != "load":
        return None
    from collections import OrderedDict

    from xdist.scheduler import LoadScopeScheduling

    class WholeFileScheduling(LoadScopeScheduling):
        _ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _assign_work_unit(self, node) -> None:
            if not self._ordered:  # the queue is complete before the first unit goes out
                self._ordered = True
                units = sorted(self.workqueue.items(), key=lambda kv: -sum(unit_cost(t) for t in kv[1]))
                self.workqueue = OrderedDict(units)
            super()._assign_work_unit(node)

    return WholeFileScheduling(config, log)


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", choices=["cpu", "cuda"],
                     help="device of the engines the engine/capsule suites build (cuda: run them on the GPU)")


@pytest.fixture(scope="session")
def device(request):
    return request.config.getoption("--device")


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory):
    return ensure_default_model(tmp_path_factory.mktemp("model-cache"))


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory):
    """The tiny mixture-of-experts model (configs/models/tiny_moe.yaml), generated like the default model."""
    path = tmp_path_factory.mktemp("tiny-moe")
    generate(path, TINY_MOE_CONFIG, progress=False)
    return path


@pytest.fixture
def model_dir(request):
    """The checkpoint make_engine loads: the dense default model, unless a test parametrizes this fixture
    (indirect) over tests/models.py's MODELS."""
    name = getattr(request, "param", "dense")
    return request.getfixturevalue({"dense": "default_model_dir", "moe": "tiny_moe_dir"}[name])


@pytest.fixture
def make_engine(model_dir, device):
    def make(**overrides):
        cfg = dict(model=str(model_dir), device=device, slots=4, max_seq=2048, prefill_chunk=128)
        cfg.update(overrides)
        return Engine.from_config(cfg)

    return make


@pytest.fixture
def engine(make_engine):
    return make_engine()


@pytest.fixture
def text():
    return PROMPT * 6


@pytest.fixture
def hf_on_cpu(monkeypatch):
    """HF transformers picks flash-linear-attention's kernels at import time whenever `fla` is importable and
    then calls them on CPU tensors too (they are Triton, GPU-only). Parity tests run HF in fp32 on the CPU,
    so they put HF's own torch implementations (the functions its decorator wraps) back in place."""
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

    for hf in (modeling_qwen3_5, modeling_qwen3_5_moe):
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                     "causal_conv1d_update"):
            fn = getattr(hf, name, None)
            if fn is not None and hasattr(fn, "__wrapped__"):
                monkeypatch.setattr(hf, name, inspect.unwrap(fn))


class FakeTerminal(io.StringIO):
    """A stderr that says it is a terminal and keeps what is drawn on it."""

    def __init__(self, monkeypatch):
        super().__init__()
        self._monkeypatch = monkeypatch

    def isatty(self) -> bool:
        return True

    def attach(self) -> "FakeTerminal":
        """Become sys.stderr until the test ends. Called in the test's body: pytest's output capture sets
        sys.stderr again when the body starts, over whatever a fixture set."""
        self._monkeypatch.setattr("sys.stderr", self)
        return self


@pytest.fixture
def terminal(monkeypatch) -> FakeTerminal:
    """A fake terminal for sys.stderr (`attach()` it), and progress bars drawn at once (no show-after delay)."""
    monkeypatch.setattr("capsulert.progress.SHOW_AFTER_S", 0)
    return FakeTerminal(monkeypatch)
