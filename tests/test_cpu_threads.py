"""An engine on the CPU runs EngineConfig.cpu_threads torch threads (1 by default: fast on a shared box)."""
from __future__ import annotations

import torch

from capsulert.engine.engine import Engine


def test_a_cpu_engine_sets_its_threads_and_none_leaves_torchs(default_model_dir):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        Engine.from_config(dict(model=str(default_model_dir), device="cpu", slots=1, max_seq=256)).close()
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        Engine.from_config(dict(model=str(default_model_dir), device="cpu", slots=1, max_seq=256,
                                cpu_threads=None)).close()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
