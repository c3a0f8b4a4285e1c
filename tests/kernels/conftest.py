import os

import pytest
import torch


@pytest.fixture
def cuda_or_interpreter():
    """For the Triton kernel tests (gpu-marked): a CUDA device, or Triton's interpreter on the CPU."""
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.fail("the Triton kernel tests need a CUDA device, or TRITON_INTERPRET=1 to run on the CPU")
