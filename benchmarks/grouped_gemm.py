"""The MoE experts' grouped GEMMs one by one, at the zoo's shapes: BF16 (``torch._grouped_mm``) against FP8
row-wise (``torch._scaled_grouped_mm``, precise and fast accumulation) and lpbench's grouped FP8 kernel
(``lpbench/precision/kernels/grouped_mm.py``) in each of ``--configs`` (with its relative error against torch's
result); on request (``--autotune``) what inductor's ``max-autotune`` picks (its Triton grouped template against
the aten kernel; the choice table goes to stderr). Then the weight gradient into the FP32 gradient buffer: the
GEMM then autograd's cast and add, the GEMM then one mixed-dtype add, and lpbench's kernel adding its FP32 product
in the epilogue (``--into-configs``; BF16 operands in autograd's layouts, dy and x untransposed). Operands in the layouts
``lpbench/precision/grouped.py`` gives them (rows sorted by expert, each expert's rows padded to 16); tokens
spread evenly over the experts (``--skew``: unevenly, as an untrained router spreads them).

    python benchmarks/grouped_gemm.py [--models mixtral-8x7b,qwen3-30b-a3b] [--tokens 4096] [--configs ...]
                                      [--into-only] [--into-configs ...] [--skew 0.25]
                                      [--autotune 'fp8 precise,fp8 fast']
"""

from __future__ import annotations

import argparse
import sys

import torch

GEMMS = ("fprop", "dgrad", "wgrad")


def operands(gemm: str, rows: int, n: int, k: int, experts: int, dtype, device="cuda"):
    """(a, b, scale_a, scale_b) of one projection's ``gemm`` (W [E, n, k], ``rows`` sorted rows), b as the
    grouped op takes it; codes drawn small so no product overflows."""

    def t(*shape):
        return (torch.randn(*shape, device=device) * 0.5).to(dtype)

    if gemm == "fprop":  # x [rows, k] · W_eᵀ
        a, b, sa, sb = t(rows, k), t(experts, n, k).transpose(1, 2), rows, experts * n
    elif gemm == "dgrad":  # dy [rows, n] · W_e (W_eᵀ stored [E, k, n] as the data-gradient codes)
        a, b, sa, sb = t(rows, n), t(experts, k, n).transpose(1, 2), rows, experts * k
    else:  # dy_eᵀ [n, rows] · x_e [rows, k] -> [E, n, k]
        a, b, sa, sb = t(n, rows), t(k, rows).t(), experts * n, experts * k
    scale = lambda m: torch.rand(m, device=device) + 0.5  # noqa: E731
    sa, sb = scale(sa), scale(sb)
    if gemm != "wgrad":
        sb = sb.view(experts, -1)
    return a, b, sa, sb


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mixtral-8x7b,qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens a micro-batch (seq x MBS)")
    ap.add_argument(
        "--configs",
        default="128x128x128x8x4,128x256x128x8x3,64x128x128x4x4,128x128x64x4x4",
        help="BMxBNxBKxWARPSxSTAGES,... of lpbench's kernel (kernels/grouped_mm.py) to time",
    )
    ap.add_argument(
        "--into-configs",
        default="128x128x128x8x4,128x256x128x8x3,128x128x64x8x3,128x256x64x8x3,128x128x64x4x4,256x128x64x8x3",
        help="configs of lpbench's kernel adding the weight gradient into FP32 (BK 128: FP8, else BF16)",
    )
    ap.add_argument("--into-only", action="store_true", help="time only the weight gradient into FP32")
    ap.add_argument(
        "--skew",
        type=float,
        default=0.0,
        help="tokens spread over the experts by softmax(skew x N(0, 1)) shares, as an untrained router "
        "spreads them (0: evenly; 0.25: the busiest expert ~1.5x the mean)",
    )
    ap.add_argument(
        "--autotune", default="", help="variants also compiled with max-autotune (comma-separated; empty: none)"
    )
    args = ap.parse_args()
    if not 0 <= args.skew < float("inf"):
        ap.exit(2, f"grouped_gemm.py: --skew {args.skew} must be a finite number >= 0\n")
    if not torch.cuda.is_available():
        print("grouped_gemm.py: needs a CUDA device", file=sys.stderr)
        return 2
    from lpbench.metrics.timing import HOW, quartiles_ms, us_text
    from lpbench.models import get_model_config
    from lpbench.precision.grouped import Groups
    from lpbench.precision.kernels import grouped_mm as gm

    def timed(fn):
        quartiles = quartiles_ms(fn, warmup=25, rep=200)
        return quartiles[1], us_text(quartiles)

    def bf16_mm(a, b, sa, sb, offs, fast, out_dtype):
        return torch._grouped_mm(a, b, offs=offs, out_dtype=out_dtype)

    def fp8_mm(a, b, sa, sb, offs, fast, out_dtype):
        return torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=out_dtype, use_fast_accum=fast)

    variants = [
        ("bf16", torch.bfloat16, bf16_mm, False),
        ("fp8 precise", torch.float8_e4m3fn, fp8_mm, False),
        ("fp8 fast", torch.float8_e4m3fn, fp8_mm, True),
    ]
    op_of = {label: op for label, _, op, _ in variants}
    print(
        f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | {args.tokens} tokens | {HOW}; "
        "TFLOP/s from the median"
    )
    print(f"{'model':>14} {'proj':>7} {'gemm':>5} {'variant':>12} {'kernel':>10} {'us':>24} {'TFLOP/s':>8}")
    torch.manual_seed(0)
    cases = []  # (model, proj, gemm, rows, n, k, E, offs, flops)
    for name in args.models.split(","):
        cfg = get_model_config(name)
        E, routed = cfg.n_experts, args.tokens * cfg.top_k
        shares = (args.skew * torch.randn(E, generator=torch.Generator().manual_seed(E))).softmax(0)
        counts = (shares * routed).floor().long()
        counts[: routed - int(counts.sum())] += 1  # every routed token placed
        groups, _ = Groups.of(torch.repeat_interleave(torch.arange(E), counts).cuda(), E)  # the MoE layer's layout
        offs, rows = groups.offs, groups.rows
        print(
            f"{name}: {E} experts, {routed} routed rows, busiest expert {int(counts.max())} "
            f"({counts.max().item() * E / routed:.2f}x the mean)"
        )
        for proj, n, k in (("gate_up", 2 * cfg.ffn_dim, cfg.dim), ("down", cfg.dim, cfg.ffn_dim)):
            cases += [(name, proj, gemm, rows, n, k, E, offs, 2 * routed * n * k) for gemm in GEMMS]

    def run(case, label, kernel, fn, dtype, fast, out_dtype=torch.bfloat16):
        name, proj, gemm, rows, n, k, E, offs, flops = case
        torch.manual_seed(1)  # the same operands for every kernel of a variant
        a, b, sa, sb = operands(gemm, rows, n, k, E, dtype)
        try:
            ms, text = timed(lambda: fn(a, b, sa, sb, offs, fast, out_dtype))
            if kernel != "aten":  # against the aten kernel of the same variant
                ref = op_of[label](a, b, sa, sb, offs, fast, out_dtype).float()
                got = fn(a, b, sa, sb, offs, fast, out_dtype).float()
                if gemm != "wgrad":
                    ref, got = ref[: int(offs[-1])], got[: int(offs[-1])]
                text += f"  rel.err {((got - ref).norm() / ref.norm()).item():.1e}"
        except Exception as e:  # noqa: BLE001 - a variant this build lacks is reported, not fatal
            print(
                f"{name:>14} {proj:>7} {gemm:>5} {label:>12} {kernel:>10}  failed: "
                f"{type(e).__name__}: {str(e).splitlines()[0][:120]}",
                flush=True,
            )
            return
        print(f"{name:>14} {proj:>7} {gemm:>5} {label:>12} {kernel:>10} {text:>24} {flops / ms / 1e9:8.1f}", flush=True)

    def ours(config):
        def fn(a, b, sa, sb, offs, fast, out_dtype):
            if b.dim() == 3:
                b = b.transpose(1, 2)  # [E, N, K] as the kernel takes it
            else:
                b = b.t()
            sa, sb = sa.reshape(-1), sb.reshape(-1)
            wgrad = b.dim() == 2
            out = (
                torch.empty(offs.shape[0], a.shape[0], b.shape[0], dtype=out_dtype, device="cuda")
                if wgrad
                else torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device="cuda")
            )
            gm.launch(lambda k: k, a, b, sa, sb, offs, out, fast, config=config)
            return out

        return fn

    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",") if c]
    for case in cases if not args.into_only else ():
        for label, dtype, op, fast in variants:
            run(case, label, "aten", op, dtype, fast)
            if label != "bf16":
                for config in configs:
                    run(case, label, "x".join(map(str, config)), ours(config), dtype, fast)
    # the weight gradient into the FP32 gradient buffer: autograd's (the GEMM's BF16 output cast, then added), one
    # mixed-dtype add after the GEMM, or lpbench's kernel adding the FP32 product in its epilogue (``--into-configs``)
    into = [tuple(int(v) for v in c.split("x")) for c in args.into_configs.split(",") if c]
    for name, proj, gemm, rows, n, k, E, offs, flops in cases:
        if gemm != "wgrad":
            continue
        grad = torch.zeros(E, n, k, device="cuda")
        for label, dtype, op, fast in variants:
            torch.manual_seed(1)
            if dtype == torch.bfloat16:  # dy [rows, n] and x [rows, k] as autograd holds them
                dy, x = operands("dgrad", rows, n, k, E, dtype)[0], operands("fprop", rows, n, k, E, dtype)[0]
                a, b, sa, sb = dy.t(), x, None, None
            else:
                a, b, sa, sb = operands(gemm, rows, n, k, E, dtype)

            def gemm_out(a=a, b=b, sa=sa, sb=sb, op=op, fast=fast):
                return op(a, b, sa, sb, offs, fast, torch.bfloat16)

            rows_of = [
                ("GEMM, cast, add", lambda: grad.add_(gemm_out().float())),
                ("GEMM, mixed add", lambda: grad.add_(gemm_out())),
            ]
            for config in into:
                if (config[2] == 128) == (dtype != torch.bfloat16):  # BK 128: FP8 configs; else 16-bit
                    rows_of.append(
                        (
                            "x".join(map(str, config)),
                            lambda config=config, a=a, b=b, sa=sa, sb=sb, fast=fast: gm.launch(
                                lambda kern: kern, a, b.t(), sa, sb, offs, grad, fast, True, config
                            ),
                        )
                    )
            for kernel, fn in rows_of:
                _, text = timed(fn)
                if kernel not in ("GEMM, cast, add", "GEMM, mixed add"):  # against the mixed add on zeros
                    grad.zero_()
                    fn()
                    got = grad.clone()
                    grad.zero_()
                    grad.add_(gemm_out())
                    text += f"  rel.err {((got - grad).norm() / grad.norm()).item():.1e}"
                print(
                    f"{name:>14} {proj:>7} {'into':>5} {label:>12} {kernel:>16} {text:>24} "
                    f"{flops / float(text.split()[0]) / 1e6:8.1f}",
                    flush=True,
                )
    if args.autotune:
        wanted = args.autotune.split(",")
        for case in cases:
            for label, dtype, op, fast in variants:
                if label in wanted:
                    torch._dynamo.reset()
                    run(
                        case,
                        label,
                        "autotuned",
                        torch.compile(op, mode="max-autotune-no-cudagraphs", dynamic=False),
                        dtype,
                        fast,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
