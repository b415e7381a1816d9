"""Time of one optimizer step for each master-weight x optimizer-state format, beside torch's fused AdamW.

Builds the model's parameters (shapes from the decoder on the meta device, cut with ``--num-layers``) on one
device with random gradients, and times ``optimizer.step()`` for torch's ``AdamW(fused=True)`` on FP32 weights
and states (the baseline lpbench uses for ``--master-weights fp32 --optimizer-states fp32``), then for
``LowPrecisionAdamW`` with every other ``--master-weights`` x ``--optimizer-states`` pair: compiled (the CUDA
default) and, with ``--eager``, its eager bucketed update too. Prints the median ms per step over ``--steps``
timed steps (after ``--warmup`` steps, which include compilation), its ratio to the baseline, the peak memory of
each optimizer's weights, gradients and states, and whether the compiled update fell back to the eager one.

    python benchmarks/optim_step.py --model llama3-8b
    python benchmarks/optim_step.py --model llama3-8b --num-layers 16 --eager   # on an 80 GB GPU
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import warnings

import torch

from lpbench.models.decoder import build_model
from lpbench.models.registry import first_blocks, get_model_config
from lpbench.train.optim import BETAS, EPS, LowPrecisionAdamW

STATES = ("fp32", "bf16", "fp8", "8bit")


def parameters(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: str) -> list[torch.nn.Parameter]:
    gen = torch.Generator(device).manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter((torch.randn(shape, generator=gen, device=device) * 0.02).to(dtype))
        p.grad = (torch.randn(shape, generator=gen, device=device) * 1e-3).to(dtype)
        params.append(p)
    return params


def time_steps(opt: torch.optim.Optimizer, warmup: int, steps: int, device: str) -> float:
    """Median ms of ``opt.step()`` over ``steps`` calls after ``warmup`` calls."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warmup):
        opt.step()
    sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--num-layers", type=int, default=None, help="the model's first N blocks (default: all)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--eager", action="store_true", help="also time the eager bucketed update")
    ap.add_argument("--master", default="fp32,bf16", help="master-weight formats, comma-separated")
    ap.add_argument("--states", default=",".join(STATES), help="optimizer-state formats, comma-separated")
    args = ap.parse_args()

    cfg = first_blocks(get_model_config(args.model), args.num_layers)
    named = [(n, tuple(p.shape)) for n, p in build_model(cfg).named_parameters()]
    shapes = [s for _, s in named]
    numel = sum(torch.Size(s).numel() for s in shapes)
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(
        f"device: {name} | torch {torch.__version__} | {cfg.name}, {cfg.n_layers} blocks: {len(shapes)} tensors, "
        f"{numel / 1e9:.2f} B parameters | median of {args.steps} steps after {args.warmup}"
    )

    def groups(params):
        return [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]

    runs = [("fp32", "fp32", "torch AdamW fused")]
    for master in args.master.split(","):
        for states in args.states.split(","):
            if (master, states) != ("fp32", "fp32"):
                runs += [(master, states, "compiled")] + ([(master, states, "eager")] if args.eager else [])
    baseline = None
    print(f"{'master':>6} {'states':>6} {'update':>18} {'ms/step':>9} {'x fused':>8} {'peak GB':>8}  note")
    for master, states, kind in runs:
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        params = parameters(shapes, torch.bfloat16 if master == "bf16" else torch.float32, args.device)
        if kind == "torch AdamW fused":
            opt = torch.optim.AdamW(groups(params), lr=1e-4, betas=BETAS, eps=EPS, fused=args.device == "cuda")
        else:
            opt = LowPrecisionAdamW(
                groups(params), lr=1e-4, weight_decay=0.1, states=states, compiled=kind == "compiled"
            )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ms = time_steps(opt, args.warmup, args.steps, args.device)
        baseline = baseline or ms
        peak = torch.cuda.max_memory_allocated() / 1e9 if args.device == "cuda" else float("nan")
        note = "; ".join(str(w.message) for w in caught if "differs from the eager one" in str(w.message))
        print(f"{master:>6} {states:>6} {kind:>18} {ms:9.1f} {ms / baseline:8.2f} {peak:8.1f}  {note}")
        del opt, params


if __name__ == "__main__":
    main()
