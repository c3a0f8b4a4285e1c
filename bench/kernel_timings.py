"""Kernel timings on a CUDA device (not named kernels.py: bench/ lands on sys.path, and transformers
imports any top-level `kernels` module it finds): our Triton kernels replayed from CUDA graphs (no launch overhead), as
the engine runs them, with achieved bandwidth or FLOP rate. Prints a table; writes bench/out/kernels.json.

    python bench/kernel_timings.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_DIR, machine_info, print_table, write_json  # noqa: E402

from capsulert.kernels.triton_attention import attention  # noqa: E402
from capsulert.kernels.triton_conv import conv_prefill, conv_step  # noqa: E402
from capsulert.kernels.triton_gated_delta import gated_delta_step  # noqa: E402


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernel_timings.py needs a CUDA device")
    from triton.testing import do_bench_cudagraph

    rows = []

    def bench(name, fn, nbytes=None, flops=None):
        fn()  # compile outside the capture
        ms = do_bench_cudagraph(fn, rep=50)
        rows.append(dict(kernel=name, us=ms * 1e3, gbps=nbytes / ms / 1e6 if nbytes else None,
                         tflops=flops / ms / 1e9 if flops else None))

    dev, bf = "cuda", torch.bfloat16
    for B in (1, 8):
        H, K, V = 32, 128, 128
        q, k = (F.normalize(torch.randn(B, H, K, device=dev), dim=-1) for _ in range(2))
        v = torch.randn(B, H, V, device=dev)
        gate, beta = -torch.rand(B, H, device=dev), torch.rand(B, H, device=dev)
        ssm = torch.zeros(16, H, K, V, device=dev)
        slots = torch.arange(B, device=dev)
        bench(f"gated_delta_step B={B} H={H} K=V={K}", lambda: gated_delta_step(q, k, v, gate, beta, ssm, slots),
              2 * B * H * K * V * 4)
        C = 8192
        x = torch.randn(B, C, device=dev, dtype=bf)
        buf, w = torch.randn(16, C, 3, device=dev, dtype=bf), torch.randn(C, 4, device=dev, dtype=bf)
        bench(f"conv_step B={B} C={C}", lambda: conv_step(x, buf, slots, w), B * C * 2 * 8)
    x = torch.randn(1, 256, 8192, device=dev, dtype=bf)
    buf, w = torch.randn(4, 8192, 3, device=dev, dtype=bf), torch.randn(8192, 4, device=dev, dtype=bf)
    slot = torch.tensor([1], device=dev)  # made before capture: a graph cannot copy from pageable host memory
    bench("conv_prefill B=1 T=256 C=8192", lambda: conv_prefill(x, buf, slot, w),
          2 * 256 * 8192 * 2)
    max_seq, Hq, Hkv, D = 16384, 16, 4, 256
    kv_k = torch.randn(64, max_seq, Hkv, D, device=dev, dtype=bf)
    kv_v = torch.randn(64, max_seq, Hkv, D, device=dev, dtype=bf)
    for B in (1, 8, 64):  # 64 rows: a crowd's decode step, each row its own slot
        for L in (1024, 2048, 16384):
            q = torch.randn(B, 1, Hq, D, device=dev, dtype=bf)
            slots, start = torch.arange(B, device=dev), torch.full((B,), L - 1, device=dev)
            bench(f"attention decode B={B} len={L}", lambda: attention(q, kv_k, kv_v, slots, start, max_seq, D**-0.5),
                  B * L * Hkv * D * 2 * 2)
    for L in (256, 4096, 16384):
        T = 256
        q = torch.randn(1, T, Hq, D, device=dev, dtype=bf)
        slots, start = torch.tensor([0], device=dev), torch.tensor([L - T], device=dev)
        bench(f"attention prefill T={T} len={L}", lambda: attention(q, kv_k, kv_v, slots, start, max_seq, D**-0.5),
              flops=4 * T * (L - T / 2) * Hq * D)
    print_table(rows, ["kernel", "us", "gbps", "tflops"])
    write_json(OUT_DIR / "kernels.json", dict(machine=machine_info("cuda"), rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
