"""Both NVFP4 emulation operands of one BF16 tensor, fused quantizer against compiled reference, on one CUDA device.

    python benchmarks/nvfp4.py [--rows 8192] [--cols 16384] [--stochastic] [--tiles 64x64x4,...] [--profile]

What the emulated NVFP4 Linear makes of an output gradient (or, without ``--stochastic``, of
an input): the row-major dgrad (or fprop) operand and the transposed, Hadamard-transformed
wgrad operand, each as BF16 values code × block scale plus a global scale. The baseline is the
reference (``quantize_nvfp4`` after ``apply_rht``), as ``lpbench run`` ran it before the fused
kernels (``kernels/nvfp4.py``); both are compiled by inductor, as in training. Also prints the bytes each moves per
element of the tensor at its measured time (two reads and two 2-byte writes: 8 bytes).
``--tiles`` times the fused kernels at other tile shapes (rows x columns x warps);
``--profile`` lists the fused quantizer's kernels.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from linear import kernel_table, time_ms  # benchmarks/linear.py, next to this script

from lpbench.precision.kernels import nvfp4
from lpbench.precision.quantize import apply_rht, quantize_nvfp4


def reference(x: torch.Tensor, stochastic: bool):
    """The two operands as the reference path of the emulated Linear computes them."""
    out = []
    for t in (x, apply_rht(F.pad(x, (0, 0, 0, -x.shape[0] % 16)).t())):
        q = quantize_nvfp4(t, stochastic=stochastic)
        out.append(((q.values() * q.block_scales()).bfloat16(), q.global_scale))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=16384)
    ap.add_argument("--stochastic", action="store_true", help="stochastic rounding (gradients)")
    ap.add_argument("--tiles", default="", help="more tile shapes for the fused kernels, e.g. 128x64x8,64x128x8")
    ap.add_argument("--profile", action="store_true", help="print the fused quantizer's kernels")
    args = ap.parse_args()
    x = torch.randn(args.rows, args.cols, device="cuda", dtype=torch.bfloat16)
    print(
        f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | x {tuple(x.shape)} bf16 | "
        f"stochastic rounding: {args.stochastic}"
    )

    def fused(t):
        return nvfp4.quantize(t, row=True, col=True, rht=True, stochastic=args.stochastic)

    default = nvfp4.TILES[args.stochastic]
    tiles = [default] + [tuple(map(int, t.split("x"))) for t in args.tiles.split(",") if t]
    variants = [("compiled reference", lambda t: reference(t, args.stochastic), None)]
    variants += [(f"fused {bm}x{bn}, {w} warps", fused, (bm, bn, w)) for bm, bn, w in tiles]
    base = None
    for name, fn, tile in variants:
        if tile:
            nvfp4.TILES[args.stochastic] = tile
        torch._dynamo.reset()
        fn = torch.compile(fn)
        ms = time_ms(lambda fn=fn: fn(x), warmup=3, reps=20, inner=5)
        base = base or ms
        gbs = x.numel() * 8 / ms / 1e6
        print(f"{name:24} {ms:8.3f} ms  {base / ms:5.2f}x the compiled reference  ({gbs:6.0f} GB/s at 8 B/element)")
    if args.profile:
        nvfp4.TILES[args.stochastic] = default
        print(kernel_table(lambda: fused(x)))


if __name__ == "__main__":
    main()
