"""A capsule's numerics origin names what decides the bytes a forward computes: on CUDA it carries the
revision of the kernels' bits, so a capsule made before a kernel change (on disk, across an upgrade) is of
another origin: restored byte-exact, never shared by block, served as a prefix or replayed as canonical."""
import platform
from types import SimpleNamespace

import torch

from capsulert.engine import capsules
from capsulert.kernels.ops import CUDA_KERNEL_BITS


def _runner(device: str):
    return SimpleNamespace(device=torch.device(device), config=SimpleNamespace(kernels="auto"))


def test_a_cuda_origin_carries_the_kernel_bits_revision(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev: "NVIDIA H200")
    origin = capsules.numerics_origin(_runner("cuda"))
    assert origin == f"cuda:NVIDIA H200:torch-{torch.__version__}:auto:bits-{CUDA_KERNEL_BITS}"
    monkeypatch.setattr(capsules, "CUDA_KERNEL_BITS", CUDA_KERNEL_BITS - 1)
    assert capsules.numerics_origin(_runner("cuda")) != origin  # a capsule of the kernels before: other numerics


def test_a_cpu_origin_names_the_machine_torch_and_kernels():
    assert capsules.numerics_origin(_runner("cpu")) == f"cpu:{platform.machine()}:torch-{torch.__version__}:auto"
