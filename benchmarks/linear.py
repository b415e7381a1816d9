"""Forward + backward of one Linear at Llama3-8B shapes, every recipe and backend against BF16.

    python benchmarks/linear.py [--tokens 16384] [--recipes bf16,fp8-tensorwise,...] [--backends lpbench,torchao]

Times with CUDA events (median of --reps samples after --warmup, each sample --inner
fwd+bwd back to back, gradients reset to None as zero_grad does), BF16 inputs/weights/grads,
one run per (shape, recipe, backend); BF16 is measured in the same invocation and every
speedup is against it. ``fp8-gemms-only`` times the three FP8 GEMMs on pre-quantized
operands: the ceiling any FP8 recipe can reach. torchao runs compiled (as its docs advise).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch._inductor.config
from torch import nn

from lpbench.precision.linear import QuantizedLinear
from lpbench.precision.capability import native_supported
from lpbench.precision.recipes import RECIPES, get_recipe

SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
TORCHAO_RECIPES = {"fp8-tensorwise": "tensorwise", "fp8-rowwise": "rowwise", "fp8-rowwise-gw-hp": "rowwise_with_gw_hp"}


def time_ms(fn, warmup: int, reps: int, inner: int) -> float:
    """Median over ``reps`` samples of the time per call, each sample ``inner`` calls back to back
    (so the CPU queues the next call while the GPU runs this one, as in training)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def kernel_table(fn, reps: int = 5, top: int = 8) -> str:
    """The ``top`` CUDA kernels of ``fn`` by device time per call (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            totals[ev.name] = totals.get(ev.name, 0.0) + ev.device_time / 1e3 / reps
    rows = sorted(totals.items(), key=lambda kv: -kv[1])
    lines = [f"      {ms:7.3f} ms  {name[:90]}" for name, ms in rows[:top]]
    return "\n".join(lines + [f"      {sum(totals.values()):7.3f} ms  total kernel time"])


def build(recipe: str, backend: str, k: int, n: int, compile_lpbench: bool = False) -> nn.Module:
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    if recipe == "bf16":
        return lin
    if backend == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        torch._dynamo.reset()  # a fresh compile per shape/recipe: they would share (and exhaust) one cache

        model = convert_to_float8_training(
            nn.Sequential(lin), config=Float8LinearConfig.from_recipe_name(TORCHAO_RECIPES[recipe])
        )
        return torch.compile(model)
    r = get_recipe(recipe)
    module = QuantizedLinear.from_linear(lin, r, native=native_supported(r, "cuda"))
    if compile_lpbench:
        torch._dynamo.reset()
        module = torch.compile(module)
    return module


def fwd_bwd(module: nn.Module, x: torch.Tensor, g: torch.Tensor):
    params = list(module.parameters())

    def step():  # gradients start from None each step, as after the optimizer's zero_grad()
        x.grad = None
        for p in params:
            p.grad = None
        module(x).backward(g)

    return step


def fp8_gemms_only(m: int, k: int, n: int):
    """The three GEMMs as fp8-tensorwise runs them (fast accumulation in fprop only)."""
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    one = torch.ones((), device="cuda")
    x = torch.randn(m, k, device="cuda").to(e4)
    w = torch.randn(n, k, device="cuda").to(e4)
    wt = w.t().contiguous()
    xt = x.t().contiguous()
    g = torch.randn(m, n, device="cuda").to(e5)
    gt = g.t().contiguous()

    def step():
        torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True)
        torch._scaled_mm(g, wt.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        torch._scaled_mm(gt, xt.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--recipes", default=",".join(r for r in RECIPES if r != "fp32"))
    ap.add_argument("--backends", default="lpbench,torchao")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--inner", type=int, default=5, help="calls back to back per timed sample")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--compile", action="store_true", help="torch.compile lpbench's quantized linears too")
    ap.add_argument("--profile", action="store_true", help="print each variant's top CUDA kernels")
    ap.add_argument("--tune", action="store_true", help="inductor's coordinate-descent tuning of generated kernels")
    args = ap.parse_args()
    torch._inductor.config.coordinate_descent_tuning = args.tune
    torch._dynamo.config.recompile_limit = 64  # one compiled module per (shape, recipe, backend)
    torch._inductor.config.emulate_precision_casts = True  # as lpbench run compiles
    recipes, backends = args.recipes.split(","), args.backends.split(",")
    print(
        f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | tokens {args.tokens} | tune {args.tune}"
    )
    rows = []
    for name, k, n in (s for s in SHAPES if s[0] in args.shapes.split(",")):
        x = torch.randn(args.tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(args.tokens, n, device="cuda", dtype=torch.bfloat16)
        base = time_ms(fwd_bwd(build("bf16", "lpbench", k, n), x, g), args.warmup, args.reps, args.inner)
        variants = [("fp8-gemms-only", "-", fp8_gemms_only(args.tokens, k, n))]
        for recipe in recipes:
            for backend in backends:
                if recipe == "bf16" or (backend == "torchao" and recipe not in TORCHAO_RECIPES):
                    continue
                try:
                    variants.append((recipe, backend, fwd_bwd(build(recipe, backend, k, n, args.compile), x, g)))
                except Exception as exc:  # report and go on: one backend missing must not hide the rest
                    print(f"{name} {recipe} {backend}: skipped ({type(exc).__name__}: {exc})")
        rows.append({"shape": name, "k": k, "n": n, "recipe": "bf16", "backend": "lpbench", "ms": base, "speedup": 1.0})
        for recipe, backend, fn in variants:
            try:
                ms = time_ms(fn, args.warmup, args.reps, args.inner)
            except Exception as exc:
                print(f"{name} {recipe} {backend}: failed ({type(exc).__name__}: {str(exc).splitlines()[0]})")
                continue
            rows.append(
                {"shape": name, "k": k, "n": n, "recipe": recipe, "backend": backend, "ms": ms, "speedup": base / ms}
            )
            if args.profile:
                print(f"{name} {recipe} {backend}: {ms:.3f} ms\n{kernel_table(fn)}", flush=True)
        del x, g
        torch.cuda.empty_cache()
    print(f"\n{'shape':8} {'KxN':>12} {'recipe':18} {'backend':8} {'ms':>8} {'vs bf16':>8}")
    for r in rows:
        print(
            f"{r['shape']:8} {str(r['k']) + 'x' + str(r['n']):>12} {r['recipe']:18} {r['backend']:8} "
            f"{r['ms']:8.3f} {r['speedup']:7.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
