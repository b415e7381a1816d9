"""CPU BF16 GEMM routes and OpenMP wait policies, timed against each other in one invocation.

    python benchmarks/cpu_routes.py [--steps 8] [--busy N]

1. One GEMM (tiny's MLP shape, 2048 x 384 x 128) and one training step (fwd + bwd) of the `tiny`
   model under BF16 autocast, on the BF16 route (torch's BF16 kernels) and the FP32 route
   (lpbench.gemm), alternating so both see the same machine load: median ms, ratio.
2. The same training step (FP32 route) in fresh processes with OMP_WAIT_POLICY=ACTIVE (OpenMP's
   spinning default) and PASSIVE (lpbench's), alternating; ``--busy N`` adds N spinning processes while
   timing, to load the machine on purpose. Prints the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import lpbench  # noqa: E402,F401  (before torch: OpenMP's wait policy, as `lpbench run` has it)


def _spin(stop):
    while not stop.is_set():
        pass


def tiny_step_times(steps: int) -> list[float]:
    """Seconds per fwd+bwd step of `tiny` (batch 8 x 256) under BF16 autocast, after one warm-up."""
    import torch

    from lpbench.models import build_model
    from lpbench.models.registry import get_model_config

    cfg = get_model_config("tiny")
    model = build_model(cfg, device="cpu", seed=0)
    ids = torch.randint(0, cfg.vocab_size, (8, 256), generator=torch.Generator().manual_seed(0))
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, ids)
        loss.backward()
        if i:
            times.append(time.perf_counter() - t0)
    return times


def routes(steps: int) -> None:
    import torch

    from lpbench import gemm

    a, b = torch.randn(2048, 384), torch.randn(128, 384)
    flops = 2 * 2048 * 384 * 128
    print(
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, native BF16: {gemm.native_bf16_cpu()}, "
        f"{torch.get_num_threads()} threads"
    )
    res: dict[str, dict[str, list[float]]] = {r: {"gemm": [], "step": []} for r in gemm.ROUTES}
    for _ in range(3):
        for r in gemm.ROUTES:
            gemm._route = r
            with torch.autocast("cpu", dtype=torch.bfloat16):
                for _ in range(3):
                    t0 = time.perf_counter()
                    gemm.linear(a, b)
                    res[r]["gemm"].append(time.perf_counter() - t0)
            res[r]["step"] += tiny_step_times(max(1, steps // 3))
    for what in ("gemm", "step"):
        med = {r: statistics.median(res[r][what]) for r in gemm.ROUTES}
        extra = {r: f", {flops / med[r] / 1e9:.1f} GFLOP/s" if what == "gemm" else "" for r in gemm.ROUTES}
        print(
            f"{what:5s}: bf16 route {med['bf16'] * 1e3:9.1f} ms{extra['bf16']} | fp32 route {med['fp32'] * 1e3:9.1f} ms"
            f"{extra['fp32']} | bf16/fp32 = {med['bf16'] / med['fp32']:.1f}x"
        )


def wait_policies(steps: int, busy: int) -> None:
    stop = mp.Event()
    spinners = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(busy)]
    for p in spinners:
        p.start()
    res: dict[str, list[float]] = {"ACTIVE": [], "PASSIVE": []}
    code = (
        f"import sys, json; sys.path.insert(0, {ROOT!r}); import lpbench; "
        f"from benchmarks.cpu_routes import tiny_step_times; print(json.dumps(tiny_step_times({steps})))"
    )
    try:
        for _ in range(2):
            for policy in res:
                env = {**os.environ, "OMP_WAIT_POLICY": policy, "LPBENCH_CPU_GEMM": "fp32"}
                out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
                res[policy] += json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        stop.set()
        for p in spinners:
            p.join()
    med = {k: statistics.median(v) for k, v in res.items()}
    print(
        f"wait policy ({busy} extra spinning processes): ACTIVE {med['ACTIVE'] * 1e3:.1f} ms "
        f"[{min(res['ACTIVE']) * 1e3:.0f}-{max(res['ACTIVE']) * 1e3:.0f}] | PASSIVE {med['PASSIVE'] * 1e3:.1f} ms "
        f"[{min(res['PASSIVE']) * 1e3:.0f}-{max(res['PASSIVE']) * 1e3:.0f}] | ACTIVE/PASSIVE = "
        f"{med['ACTIVE'] / med['PASSIVE']:.2f}x"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="timed training steps per measurement")
    ap.add_argument("--busy", type=int, default=0, help="extra spinning processes during the wait-policy test")
    ap.add_argument("--skip-routes", action="store_true")
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()}")
    if not args.skip_routes:
        routes(args.steps)
    wait_policies(args.steps, args.busy)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
