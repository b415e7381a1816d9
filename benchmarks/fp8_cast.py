"""The one-pass FP8 cast-transpose (``lpbench/precision/kernels/fp8_cast.py``) at llama3-8b shapes:
achieved bandwidth per launch shape (tile, warps) against a device-to-device copy, codes checked
against the reference quantizer for every shape and launch shape.

    python benchmarks/fp8_cast.py                      # CUDA only
"""

from __future__ import annotations

import argparse
import sys

import torch

SHAPES = [  # (rows, cols, dtype, what)
    (8192, 4096, torch.bfloat16, "qkv/o/gate_up input, o/down grad"),
    (8192, 14336, torch.bfloat16, "down input"),
    (8192, 28672, torch.bfloat16, "gate_up grad"),
    (28672, 4096, torch.float32, "gate_up weight (FP32 master)"),
]
LAUNCHES = [(64, 4), (64, 8), (128, 4), (128, 8), (32, 4)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", default=",".join(f"{t}x{w}" for t, w in LAUNCHES), help="TILExWARPS,...")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("fp8_cast.py: needs a CUDA device", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    from lpbench.precision.formats import E4M3
    from lpbench.precision.kernels import fp8_cast
    from lpbench.precision.quantize import fp8_encode_scale, quantize_fp8

    launches = [tuple(int(v) for v in s.split("x")) for s in args.launches.split(",")]
    print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__}")
    rows = []
    for m, n, dtype, what in SHAPES:
        x = (torch.randn(m, n, device="cuda") * 3).to(dtype)
        amax = x.float().abs().amax()
        enc = fp8_encode_scale(amax, E4M3)
        ref = quantize_fp8(x, E4M3)
        nbytes = x.numel() * (x.element_size() + 2)  # read x, write codes and transposed codes
        copy_ms = do_bench(lambda: x.clone(), warmup=25, rep=200, return_mode="median")
        copy_bw = 2 * x.numel() * x.element_size() / copy_ms / 1e6
        for tile, warps in launches:
            q = torch.full((m, n), 1.0, device="cuda").to(torch.float8_e4m3fn)
            qt = torch.full((n, m), 1.0, device="cuda").to(torch.float8_e4m3fn)
            got_amax = fp8_cast.cast_transpose_into(x, enc, E4M3, q, qt, tile, warps)
            ok = (torch.equal(q.view(torch.uint8), ref.codes.view(torch.uint8))
                  and torch.equal(qt.view(torch.uint8), ref.codes.t().contiguous().view(torch.uint8))
                  and torch.equal(got_amax, amax))
            ms = do_bench(lambda: fp8_cast.cast_transpose_into(x, enc, E4M3, q, qt, tile, warps), warmup=25, rep=200,
                          return_mode="median")
            rows.append((f"{m}x{n} {str(dtype)[6:]}", what, f"{tile}x{warps}", ms, nbytes / ms / 1e6, copy_bw, ok))
    print(f"{'shape':<22} {'launch':>7} {'ms':>8} {'GB/s':>7} {'copy GB/s':>9} {'exact':>5}  operand")
    for shape, what, launch, ms, bw, copy_bw, ok in rows:
        print(f"{shape:<22} {launch:>7} {ms:8.3f} {bw:7.0f} {copy_bw:9.0f} {str(ok):>5}  {what}")
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
