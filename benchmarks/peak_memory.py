"""What is live on the GPU at a run's peak: every allocation at the moment of ``torch.cuda.max_memory_allocated``,
grouped by the innermost lpbench (else torch) source line that made it.

Runs ``lpbench run`` with the given flags (the first config of its lists) under torch's allocator history
(``torch.cuda.memory._record_memory_history``), replays the recorded allocations and frees to find the moment
the allocated bytes peak (after the build, as the runs' ``peak_mem_allocated_gb``), and prints the live bytes
there by source line, largest first, beside the estimator's parts (``lpbench memory``). For the cases where the
estimator misses (tests/test_memory_estimate.py's xfails):

    python benchmarks/peak_memory.py --model llama3.2-1b --seq-len 2048 --mbs 2 --gbs 2 --steps 3 \\
        --warmup-steps 1 --eval-every 0 --precision bf16 --recompute full --emulate
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch

GIB = 1024**3


def origin(frames: list[dict]) -> str:
    """The innermost lpbench frame of an allocation's stack, else the innermost torch one."""
    for prefix in ("lpbench/", "torch/"):
        for f in frames:
            if prefix in f["filename"] and "memory.py" not in f["filename"]:
                return f"{f['filename'].split(prefix, 1)[1]}:{f['line']} {f['name']}"
    return "?"


def live_at_peak(trace: list[dict], start: int = 0) -> tuple[int, dict[str, int]]:
    """(peak bytes, live bytes by origin at the peak) of the allocator events ``trace`` from event ``start``."""
    live: dict[int, tuple[int, str]] = {}
    now = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], origin(event.get("frames", [])))
            now += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            now -= live.pop(event["addr"])[0]
        if i >= start and now > peak:
            peak, at_peak = now, dict(live)
    parts: dict[str, int] = defaultdict(int)
    for size, where in at_peak.values():
        parts[where] += size
    return peak, dict(parts)


def main() -> None:
    from lpbench.cli import build_parser, configs_from_args
    from lpbench.metrics.memory import reset_peak
    from lpbench.train import loop

    cfg = configs_from_args(build_parser().parse_args(["run", *sys.argv[1:]]))[0].with_(device="cuda")
    events: dict[str, int] = {}
    real_reset = reset_peak

    def mark_build_end(device):  # the runs measure their peak from here (after the build)
        events["start"] = len(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])
        real_reset(device)

    loop.memory.reset_peak = mark_build_end
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    result = loop.train(cfg, log=print)
    trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, parts = live_at_peak(trace, events.get("start", 0))
    print(
        f"run: {result.status}; peak from the allocator's history {peak / GIB:.2f} GiB "
        f"(max_memory_allocated: {result.metrics.get('peak_mem_allocated_gb')} GB, "
        f"predicted {result.metrics.get('predicted_peak_gb')} GB)"
    )
    for where, size in sorted(parts.items(), key=lambda kv: -kv[1])[:30]:
        print(f"{size / GIB:9.3f} GiB  {where}")


if __name__ == "__main__":
    main()
