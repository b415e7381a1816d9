"""SwiGLU's backward (``lpbench/precision/kernels/swiglu.py``) at the zoo's MLP shapes: the Triton kernel against inductor's
compiled autograd of ``silu(gate) * up`` (what the decoder ran before) and a copy of the gradient, with whether
each is eager autograd's gradient bit for bit; then the kernel's FP8 epilogues (the gate+up linear's gradient
quantized inside it) against the passes they replace: its amax (tensorwise) against a separate amax of the
gradient, its E5M2 codes and their transpose (delayed) against the one-pass cast of the 16-bit gradient.

    python benchmarks/swiglu.py                      # CUDA only
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch._inductor.config
import torch.nn.functional as F

SHAPES = [  # (tokens, ffn, what)
    (8192, 14336, "llama3-8b MLP, seq 8192 MBS 1"),
    (8192, 8192, "llama3.2-1b MLP, seq 4096 MBS 2"),
    (16384, 14336, "mixtral-8x7b experts, seq 8192 top-2"),
    (65536, 768, "qwen3-30b-a3b experts, seq 8192 top-8"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--launches",
        default="32x128x4,16x256x4,32x256x8,64x128x8",
        help="TOKENSxCOLUMNSxWARPS,... of the kernel (the first is the module's default)",
    )
    ap.add_argument(
        "--cast-launches",
        default="32x128x4,64x64x4,64x128x4",
        help="the same for the kernel that stores FP8 codes and their transpose",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("swiglu.py: needs a CUDA device", file=sys.stderr)
        return 2
    from lpbench.metrics.timing import HOW, quartiles_ms, us_text
    from lpbench.precision.kernels import swiglu as sw

    def us(fn):
        return us_text(quartiles_ms(fn, warmup=50, rep=300))

    from lpbench.precision.formats import E5M2
    from lpbench.precision.kernels import fp8_cast

    def parse(spec):
        return [tuple(int(v) for v in s.split("x")) for s in spec.split(",")]

    launches, cast_launches = parse(args.launches), parse(args.cast_launches)
    print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | BF16 | {HOW}")
    print(f"{'tokens x ffn':>14} {'variant':>22} {'us':>22} {'== eager':>9}  shape")
    torch.manual_seed(0)
    with torch._inductor.config.patch(emulate_precision_casts=True):  # as `lpbench run` compiles
        for tokens, ffn, what in SHAPES:
            gate_up = torch.randn(tokens, 2 * ffn, device="cuda", dtype=torch.bfloat16) * 4
            grad = torch.randn(tokens, ffn, device="cuda", dtype=torch.bfloat16)
            x = gate_up.clone().requires_grad_()
            gate, up = x.chunk(2, dim=-1)
            (F.silu(gate) * up).backward(grad)
            eager = x.grad
            x.grad = None
            torch._dynamo.reset()
            y = torch.compile(sw.Epilogue.forward)(x)  # the expression, differentiated by inductor

            def inductor():
                y.backward(grad, retain_graph=True)
                x.grad = None

            y.backward(grad, retain_graph=True)
            exact = torch.equal(x.grad, eager)
            row = f"{tokens:>6} x {ffn:<6}"
            print(f"{row} {'inductor (autograd)':>22} {us(inductor):>22} {str(exact):>9}  {what}")
            for launch in launches:
                out = torch.empty_like(gate_up)
                sw.launch_backward(lambda k: k, gate_up, grad, out, launch)
                name = "kernel " + "x".join(map(str, launch))
                print(
                    f"{row} {name:>22} "
                    f"{us(lambda: sw.launch_backward(lambda k: k, gate_up, grad, out, launch)):>22} "
                    f"{str(torch.equal(out, eager)):>9}"
                )
            print(f"{row} {'copy of the gradient':>22} {us(lambda: gate_up.clone()):>22}")
            print(
                f"{row} {'kernel, then amax':>22} "
                f"{us(lambda: (sw.launch_backward(lambda k: k, gate_up, grad, out), out.abs().amax())):>22}"
            )
            for launch in launches:
                name = "kernel + amax " + "x".join(map(str, launch))
                print(
                    f"{row} {name:>22} "
                    f"{us(lambda: sw.launch_backward(lambda k: k, gate_up, grad, out, launch, True).amax()):>22}"
                )
            enc = torch.tensor(E5M2.max / (4 * eager.float().abs().amax().item()), device="cuda")
            q, qt = torch.empty_like(gate_up, dtype=E5M2.dtype), torch.empty_like(gate_up.t(), dtype=E5M2.dtype)

            def unfused():
                sw.launch_backward(lambda k: k, gate_up, grad, out)
                fp8_cast.cast_transpose_into(out, enc, E5M2, q, qt)

            print(f"{row} {'kernel, then cast':>22} {us(unfused):>22}")
            cast = (enc, E5M2.max, qt)
            for launch in cast_launches:
                name = "kernel + cast " + "x".join(map(str, launch))
                print(
                    f"{row} {name:>22} "
                    f"{us(lambda: sw.launch_backward(lambda k: k, gate_up, grad, q, launch, True, cast)):>22}"
                )
            del q, qt
            del gate_up, grad, x, y, eager, out
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
