"""MoE throughput on one GPU: grouped expert GEMMs against the per-expert loop, FP8 against BF16, lpbench
against torchao's MoE path, on zoo MoE models cut with --num-layers.

    python benchmarks/moe.py [--seq-len 4096] [--gbs 1] [--mbs 1] [--steps 10] [--warmup 4] [--out DIR]
                             [--variants bf16,...] [--profile]
    python benchmarks/moe.py --gbs 8 --categorize bf16=trace-mixtral-8x7b-bf16.json.gz,fp8-rowwise=...

Per model, in one process and one after another: ``bf16`` (grouped, ``torch._grouped_mm``),
``bf16-loop`` (one GEMM per expert: the grouped op replaced by its per-expert fallback),
``fp8-rowwise`` (lpbench's grouped FP8, ``torch._scaled_grouped_mm``) and ``fp8-rowwise/torchao``
(``--backend torchao``: ``torchao.prototype.moe_training``); on request (``--variants``)
``fp8-rowwise-fast-grads``, lpbench's grouped FP8 with its gradient GEMMs in fast accumulation too (the
recipe of that name, as torchao runs them). Tokens/s, model TFLOP/s (Megatron's count on the active experts)
and MFU against the BF16 dense peak; ratios against the same model's grouped BF16 run. Each result is also
written as one JSON line to ``DIR/moe.jsonl``.
``--profile`` traces the last step of each run (``--profile-steps``, left out of the timing) and prints
its CUDA kernels by total time, with the kernel time of the step against its wall time; then, per model, the
time per micro-batch by category (expert GEMMs, dense GEMMs, attention, FP8 casts, router/permute,
optimizer, idle) and the Amdahl bounds on FP8's speedup that the BF16 profile implies.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import re
import time
import traceback

import torch

from lpbench.config import RunConfig
from lpbench.convert.quantize import quantize_experts
from lpbench.metrics import trace as chrome_trace
from lpbench.models import moe as moe_layer
from lpbench.train.loop import train

MODELS = (("qwen3-30b-a3b", 2), ("mixtral-8x7b", 2))
VARIANTS = (
    ("bf16", "bf16", "lpbench", None),
    ("fp8-rowwise", "fp8-rowwise", "lpbench", None),
    ("fp8-rowwise/torchao", "fp8-rowwise", "torchao", None),
    ("bf16-loop", "bf16", "lpbench", "loop"),
    ("fp8-rowwise-fast-grads", "fp8-rowwise-fast-grads", "lpbench", None),
)
DEFAULT_VARIANTS = ("bf16", "fp8-rowwise", "fp8-rowwise/torchao", "bf16-loop")


def check_native(device: str = "cuda") -> None:
    """Native grouped GEMMs against their emulation (the path the CPU tests prove equal to the per-expert
    loop) on one tiny MoE layer: outputs and gradients, relative error per variant."""
    from lpbench.models.moe import MoE
    from lpbench.models.registry import ModelConfig
    from lpbench.precision.recipes import get_recipe

    cfg = ModelConfig("check", 1, 256, 512, 2, 2, 64, n_experts=8, top_k=2)
    torch.manual_seed(0)
    x = torch.randn(4, 500, 256, device=device)
    for precision in ("bf16", "fp8-rowwise", "fp8-rowwise-fast-grads", "fp8-tensorwise", "fp8-rowwise-gw-hp"):
        outs = []
        for native in (True, False):
            torch.manual_seed(1)
            moe = MoE(cfg).to(device)
            for p in moe.parameters():
                torch.nn.init.normal_(p, std=0.05)
            if precision != "bf16":
                quantize_experts(moe.experts, get_recipe(precision), native=native)
            moe_layer.grouped_gemm = (lambda t: t.is_cuda) if native else (lambda t: False)
            xi = x.clone().requires_grad_()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = moe(xi)
            y.float().square().sum().backward()
            outs.append([y.float(), xi.grad.float(), moe.experts.gate_up.grad, moe.experts.down.grad])
        rel = [((a - b).norm() / b.norm()).item() for a, b in zip(*outs)]
        print(
            f"check {precision:22s} native vs emulated, rel. error y / dx / dW_gate_up / dW_down: "
            + " / ".join(f"{r:.2e}" for r in rel),
            flush=True,
        )


def kernel_table(trace: str, top: int = 25) -> list[str]:
    """The ``top`` CUDA kernels of a Chrome trace by summed time (ms, calls, share of all kernel time)."""
    times, calls = chrome_trace.kernel_totals(chrome_trace.read(trace))
    total = sum(times.values())
    lines = [f"  kernels: {total:.1f} ms in {sum(calls.values())} launches"]
    for name, t in times.most_common(top):
        lines.append(f"  {t:8.2f} ms {calls[name]:6d}x {100 * t / total:5.1f}%  {name[:110]}")
    return lines


CATEGORIES = (
    "expert GEMMs",
    "dense GEMMs",
    "attention",
    "FP8 activation casts",
    "weight casts",
    "weight-grad casts + accumulation",
    "router/permute",
    "other kernels",
    "optimizer",
    "idle",
)
CASTS = ("FP8 activation casts", "weight casts")
_OPTIMIZER = re.compile(r"Optimizer\.step|clip_grad|_foreach_|multi_tensor|fused_adam", re.IGNORECASE)
_WEIGHT_CODES = re.compile(r"weight_cache\.py|weight_codes")  # FP8 codes of the weights, once per step
# CUTLASS grouped GEMMs, lpbench's grouped FP8 kernel (kernels/grouped_mm.py), or launched by the op
_EXPERT = re.compile(r"GroupProblemShape|grouped_gemm|_grouped_mm|^_grouped_kernel$")
_COPY_ONLY = re.compile(
    r"^triton_[a-z]+_fused_((_?grouped_mm|_?scaled_grouped_mm|_?to_copy|_?transpose|_?t|_?view"
    r"|_?clone|_?permute|_?unsafe_view)_?)+\d+$"
)  # a dtype cast (and layout change) alone
_ROUTER = re.compile(
    r"topk|sort|radix|scatter|gather|index|searchsorted|cumsum|softmax|bincount|nonzero|cub::", re.IGNORECASE
)
_LOSS = re.compile(r"log_softmax|cross_entropy|nll_loss", re.IGNORECASE)


def kernel_category(kernel: str, chain: list[str]) -> str:
    """Where a kernel's time goes, from its name and the CPU events that launched it (innermost first): the
    optimizer step; autograd's accumulation of weight gradients into the FP32 ``.grad`` (micro-batches after the
    first) and the compiled casts of BF16 weight gradients to FP32 before it; weight casts (the weight cache's FP8
    codes, the compiled FP32 -> BF16 copies of the forward); grouped expert GEMMs (CUTLASS and lpbench's kernel,
    not the Triton kernels inductor names after the GEMM they feed); attention; other GEMMs; FP8 casts of activations and
    gradients (amaxes, scales, codes); routing and token permutation."""
    from lpbench.metrics import profile

    names = [kernel, *chain]
    triton = kernel.startswith("triton_")
    if any(_OPTIMIZER.search(n) for n in names):
        return "optimizer"
    if any("AccumulateGrad" in n for n in chain):
        return "weight-grad casts + accumulation"
    if any(_WEIGHT_CODES.search(n) for n in chain):
        return "weight casts"
    if not triton and any(_EXPERT.search(n) for n in names[:3]):
        return "expert GEMMs"
    kind = profile.classify(profile.label(names))
    if kind == "attention":
        return "attention"
    if profile.classify(kernel) == "gemm":
        return "dense GEMMs"
    if kind == "quantize" or any("scatter_reduce" in n for n in names[:3]):  # the group amaxes' scatter
        return "FP8 activation casts"
    if _COPY_ONLY.match(kernel):
        backward = any("CompiledFunctionBackward" in n for n in chain)
        return "weight-grad casts + accumulation" if backward else "weight casts"
    if _ROUTER.search(kernel) and not _LOSS.search(kernel):
        return "router/permute"
    return "other kernels"


def step_categories(trace: str, wall_ms: float | None = None) -> tuple[dict[str, float], list[tuple[float, str]]]:
    """Kernel time of a profiled step by :data:`CATEGORIES` (ms; ``idle``: the step's wall time, else the
    trace's span, in which the GPU ran no kernel), and the heaviest kernels of "other kernels". Each kernel is
    matched to its launch on the host (the trace's correlation ids) and the CPU operators and Python frames
    around that launch. ``trace``: a Chrome trace, gzipped or not."""
    events = chrome_trace.read(trace)
    if wall_ms is None:
        wall_ms = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e3
    kernels = chrome_trace.device_events(events)
    host = sorted(
        (
            e
            for e in events
            if e.get("cat") in ("cpu_op", "python_function", "user_annotation", "cuda_runtime", "cuda_driver")
        ),
        key=lambda e: (e["tid"], e["ts"], -e["dur"]),
    )
    chains, stacks = {}, {}
    for e in host:  # an interval sweep per thread: the open events enclose this one
        stack = stacks.setdefault(e["tid"], [])
        while stack and stack[-1]["ts"] + stack[-1]["dur"] < e["ts"] + e["dur"] - 1e-3:
            stack.pop()
        corr = e.get("args", {}).get("correlation")
        if e["cat"] in ("cuda_runtime", "cuda_driver") and corr is not None:
            chains[corr] = [o["name"] for o in reversed(stack)]
        stack.append(e)
    times, other = dict.fromkeys(CATEGORIES, 0.0), {}
    for k in kernels:
        cat = kernel_category(k["name"], chains.get(k.get("args", {}).get("correlation"), []))
        times[cat] += k["dur"] / 1e3
        if cat == "other kernels":
            other[k["name"][:90]] = other.get(k["name"][:90], 0.0) + k["dur"] / 1e3
    times["idle"] = max(0.0, wall_ms - chrome_trace.busy_ms(events))
    return times, sorted(((t, n) for n, t in other.items()), reverse=True)[:6]


def category_table(model: str, profiles: dict[str, dict[str, float]], micro: int) -> list[str]:
    """Per-category time per micro-batch (the optimizer's step shared by the step's micro-batches) of each profiled
    variant, and the Amdahl bound on FP8's speedup over BF16 that the BF16 profile implies."""
    labels = list(profiles)
    lines = [
        f"CATEGORIES {model}: ms per micro-batch (step / {micro}; the optimizer runs once per step)",
        f"  {'':33s}" + "".join(f"{label:>24s}" for label in labels),
    ]
    for cat in (*CATEGORIES, "total"):
        row = [sum(p.values()) if cat == "total" else p[cat] for p in profiles.values()]
        lines.append(f"  {cat:33s}" + "".join(f"{t / micro:24.2f}" for t in row))
    bf16 = profiles.get("bf16")
    if bf16 is None:
        return lines
    total = sum(bf16.values())
    gemms = bf16["expert GEMMs"] + bf16["dense GEMMs"]
    lines.append(
        f"AMDAHL {model}: BF16 {total / micro:.2f} ms per micro-batch, GEMMs {gemms / micro:.2f} (experts "
        f"{bf16['expert GEMMs'] / micro:.2f}); 1.2x means FP8 at {total / 1.2 / micro:.2f} ms per micro-batch"
    )
    lines.append(f"  BF16 GEMMs free, nothing else changed:                        {total / (total - gemms):.3f}x")
    ideal = total - gemms / 2 - bf16["weight casts"]
    lines.append(f"  GEMMs 2x BF16's speed (FP8 peak), weight and FP8 casts free:  {total / ideal:.3f}x")
    for label, p in profiles.items():
        if label == "bf16":
            continue
        fp8 = sum(p.values())
        casts = sum(p[c] for c in CASTS)
        acc = p["weight-grad casts + accumulation"], bf16["weight-grad casts + accumulation"]
        lines.append(
            f"  {label}: measured {total / fp8:.3f}x; its GEMMs with casts free {total / (fp8 - casts):.3f}x "
            f"(casts {casts / micro:.2f} ms per micro-batch); also without weight-grad casts + accumulation "
            f"in both {(total - acc[1]) / (fp8 - casts - acc[0]):.3f}x"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--models", default=",".join(f"{m}:{n}" for m, n in MODELS), help="NAME:LAYERS,...")
    ap.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"labels to run, comma-separated, of {', '.join(v[0] for v in VARIANTS)}",
    )
    ap.add_argument("--gbs", type=int, default=1, help="global batch (sequences per optimizer step)")
    ap.add_argument("--mbs", type=int, default=1, help="micro-batch (sequences per forward and backward)")
    ap.add_argument("--profile", action="store_true", help="trace each run's last step, print its top kernels")
    ap.add_argument("--no-check", action="store_true", help="skip the native-vs-emulated check")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument(
        "--categorize",
        metavar="LABEL=TRACE,...",
        help="only split saved traces of one model (bf16=trace-...-bf16.json.gz,...; --gbs and --mbs "
        "as when traced) by category and print the Amdahl bounds, then exit",
    )
    args = ap.parse_args()
    if args.mbs < 1 or args.gbs < 1 or args.gbs % args.mbs:
        ap.exit(2, f"moe.py: --gbs {args.gbs} must be a positive multiple of --mbs {args.mbs}\n")
    if args.categorize:
        profiles = {}
        for item in args.categorize.split(","):
            label, _, trace = item.partition("=")
            if not os.path.isfile(trace):
                ap.exit(2, f"moe.py: --categorize: no trace file {trace!r} (give LABEL=PATH)\n")
            profiles[label], _ = step_categories(trace)
        print("\n".join(category_table("traces", profiles, args.gbs // args.mbs)))
        return
    variants = [v for v in VARIANTS if v[0] in args.variants.split(",")]
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as exc:
        ap.exit(2, f"moe.py: --out {args.out}: {exc.strerror}\n")
    native = moe_layer.grouped_gemm
    try:
        if not args.no_check:
            check_native()
    except Exception:
        traceback.print_exc()
    finally:
        moe_layer.grouped_gemm = native
    print(
        f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | seq {args.seq_len} MBS {args.mbs} GBS {args.gbs} | "
        f"steps {args.steps} (first {args.warmup} untimed) | {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        flush=True,
    )
    for spec in args.models.split(","):
        name, layers = spec.split(":")
        base, profiles = None, {}
        for label, precision, backend, mode in variants:
            moe_layer.grouped_gemm = (lambda x: False) if mode == "loop" else native
            cfg = RunConfig(
                model=name,
                num_layers=int(layers),
                precision=precision,
                backend=backend,
                seq_len=args.seq_len,
                mbs=args.mbs,
                gbs=args.gbs,
                steps=args.steps,
                warmup_steps=args.warmup,
                log_interval=args.steps,
                profile_steps=f"{args.steps}:{args.steps}" if args.profile else None,
            )
            t0 = time.time()
            try:
                r = train(
                    cfg, log=lambda line: print("   ", line, flush=True), results_dir=os.path.join(args.out, "results")
                )
                m = r.metrics
                row = {
                    "model": f"{name}@{layers}L",
                    "variant": label,
                    "status": r.status,
                    "tokens_per_s": m.get("tokens_per_sec_per_gpu"),
                    "step_ms": 1e3 * m.get("step_time_s", 0),
                    "step_ms_p25": 1e3 * m.get("step_time_p25_s", 0),
                    "step_ms_p75": 1e3 * m.get("step_time_p75_s", 0),
                    "tflops": m.get("tflops_per_gpu"),
                    "mfu_bf16": m.get("mfu_bf16"),
                    "peak_gb": m.get("peak_mem_allocated_gb"),
                    "wall_s": time.time() - t0,
                }
                if args.profile and "profile" in m:
                    trace = m["profile"]["trace"]
                    print(
                        f"PROFILE {name}@{layers}L {label}: step {1e3 * r.steps[-1]['step_time_s']:.1f} ms wall",
                        flush=True,
                    )
                    print("\n".join(kernel_table(trace)), flush=True)
                    profiles[label], other = step_categories(trace, 1e3 * r.steps[-1]["step_time_s"])
                    print("  heaviest other kernels: " + "; ".join(f"{t:.2f} ms {n}" for t, n in other), flush=True)
                    keep = os.path.join(args.out, f"trace-{name}-{label.replace('/', '-')}.json.gz")
                    with open(trace, "rb") as src, gzip.open(keep, "wb") as dst:
                        dst.write(src.read())
                    os.remove(trace)
            except Exception as exc:  # one failing variant must not hide the others
                traceback.print_exc()
                row = {"model": f"{name}@{layers}L", "variant": label, "status": f"error: {exc}".splitlines()[0]}
            finally:
                moe_layer.grouped_gemm = native
                gc.collect()  # the run's model and optimizer freed now, not inside the next run's peak
                torch.cuda.empty_cache()
            if label == "bf16" and row.get("tokens_per_s"):
                base = row["tokens_per_s"]
            if row.get("tokens_per_s") and base:
                row["vs_grouped_bf16"] = row["tokens_per_s"] / base
            with open(os.path.join(args.out, "moe.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
            if row.get("tokens_per_s"):
                print(
                    f"RESULT {row['model']:20s} {label:22s} {row['tokens_per_s']:9.0f} tok/s  "
                    f"{row['step_ms']:8.1f} ms ({row['step_ms_p25']:.1f}-{row['step_ms_p75']:.1f})  "
                    f"{row['tflops']:6.1f} TFLOP/s  MFU {row['mfu_bf16']:.3f}  "
                    f"peak {row['peak_gb']:.1f} GB  {row.get('vs_grouped_bf16', float('nan')):.2f}x grouped bf16  "
                    f"(wall {row['wall_s']:.0f} s)",
                    flush=True,
                )
            else:
                print(f"RESULT {row['model']:20s} {label:22s} {row['status']}", flush=True)
        if profiles:
            print("\n".join(category_table(f"{name}@{layers}L", profiles, args.gbs // args.mbs)), flush=True)


if __name__ == "__main__":
    main()
