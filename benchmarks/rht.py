"""The NVFP4 wgrad operand's random Hadamard transform (16-wide, along the last dim), on one CUDA device.

    python benchmarks/rht.py [--rows 16384] [--cols 8192]

Times ``apply_rht`` as lpbench computes it (a BF16 tensor-core matmul with FP32 output) against
an FP32 matmul by the 16×16 matrix, each compiled together with the stochastically rounding
NVFP4 quantizer that consumes it; the quantizer alone is the baseline.
"""

from __future__ import annotations

import argparse

import torch
from linear import time_ms  # benchmarks/linear.py, next to this script

from lpbench.precision.quantize import RHT_SIZE, apply_rht, quantize_nvfp4, rht_matrix


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--cols", type=int, default=8192)
    args = ap.parse_args()
    m = rht_matrix().cuda()

    def matmul_fp32(x):
        return (x.float().reshape(-1, RHT_SIZE) @ m).reshape(x.shape)

    variants = {"quantizer alone": lambda x: x, "apply_rht": apply_rht, "fp32 matmul": matmul_fp32}
    x = torch.randn(args.rows, args.cols, device="cuda", dtype=torch.bfloat16)
    print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | x {tuple(x.shape)} bf16")
    base = None
    for name, rht in variants.items():
        torch._dynamo.reset()
        fn = torch.compile(lambda t, rht=rht: quantize_nvfp4(rht(t), stochastic=True).codes)
        ms = time_ms(lambda fn=fn: fn(x), warmup=3, reps=20, inner=1)
        base = base or ms
        print(f"{name:16} {ms:8.3f} ms  {ms / base:5.2f}x the quantizer alone")


if __name__ == "__main__":
    main()
