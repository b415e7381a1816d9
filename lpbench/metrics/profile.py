"""``--profile-steps A:B``: torch.profiler over steps A..B, a Chrome trace, and where the time went.

The profiled time is split into GEMMs, quantization, attention, communication and other.

* On CUDA the time is device kernel time (every kernel, memcpy and memset; shares of the summed
  kernel time, so idle gaps and stream overlap are not shown).
* On CPU it is the self CPU time of every recorded event: operators, ``record_function``
  ranges and Python frames (``with_stack``), so the total is about the profiled wall time of
  each thread and Python overhead lands in "other".

Each time is labelled by the innermost classifiable name among the kernel (CUDA), the event and
the events enclosing it (operators, Python frames, ``nn.Module`` ranges): an ``aten::mm`` is a
GEMM wherever it runs; an ``aten::abs`` inside ``lpbench/precision/quantize.py`` or inside a
``QuantizedLinear`` module is quantization; a kernel or operator no enclosing name classifies is
other. Names are classified by ``classify`` (first matching rule wins).
"""

from __future__ import annotations

import gc
import re
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

CATEGORIES = ("gemm", "quantize", "attention", "comm", "other")
RULES = (  # (category, pattern) in order; the first match wins
    ("comm", r"nccl|gloo|c10d|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all"),
    ("attention", r"flash|scaled_dot_product|sdpa|fmha|flex_attention|efficient_attention"),
    (
        "gemm",
        r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm|_grouped_mm|_scaled_grouped_mm)$"
        r"|gemm|cutlass|nvjet|xmma|wgmma|cublas|s16816"
        r"|^_grouped_kernel$",  # kernels/grouped_mm.py
    ),
    ("other", r"softmax|cross_entropy"),  # their fused kernels name amax, which is not quantization here
    (
        "quantize",
        r"quantiz|absmax|amax|float8|fp8|fp4|mxfp|hadamard"
        r"|^_(group_)?(cast|amax_scale|record|transpose)_kernel$"  # kernels/fp8_cast.py, fp8_group.py
        r"|^_uniform_kernel$"  # kernels/nvfp4.py: stochastic rounding's draws
        r"|^triton_\w*fused\w*_to_copy\w*clamp",
    ),  # torch.compile's saturating casts (FP8 codes)
)
_RULES = [(cat, re.compile(pattern, re.IGNORECASE)) for cat, pattern in RULES]
# CUPTI's synchronization records (kineto category cuda_sync): device rows that span the time a
# stream or the host waited, not work.
SYNC_EVENTS = re.compile(r"^(Event Sync|Stream Wait Event|Stream Sync|Context Sync)$")


def classify(name: str) -> str | None:
    """The category a kernel, operator or enclosing range name belongs to; None if no rule matches."""
    return next((cat for cat, pattern in _RULES if pattern.search(name)), None)


def label(chain: Sequence[str]) -> str:
    """The name that decides a time's category: the first classifiable in ``chain`` (innermost first)."""
    return next((name for name in chain if classify(name) is not None), chain[0])


def breakdown(pairs: Iterable[tuple[str, float]]) -> dict[str, dict[str, float]]:
    """``{category: {"time": t, "share": t / total}}`` over (name, time) pairs, every category present."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for name, t in pairs:
        totals[classify(name) or "other"] += t
    total = sum(totals.values())
    return {c: {"time": t, "share": t / total if total else 0.0} for c, t in totals.items()}


def _chain(event) -> list[str]:
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return names


def labelled_times(events, device_type: str) -> list[tuple[str, float]]:
    """(label, microseconds) pairs from torch.profiler events, per the module doc's rule.

    On CUDA every device kernel, memcpy and memset counts once: torch also links a CPU range's
    GPU-side annotation (the span of a compiled graph, a module, a profiler step) to it as if it
    were a kernel, which once counted whole spans of the step again (seconds of "other" per
    step at llama3-8b scale), so linked times count only up to the device's own total per name.
    """
    from torch.autograd import DeviceType

    cpu = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    if device_type != "cuda":
        return [(label(_chain(e)), e.self_cpu_time_total) for e in cpu]
    kernels = Counter()
    for e in events:
        if e.device_type != DeviceType.CPU and not e.is_user_annotation and not SYNC_EVENTS.match(e.name):
            kernels[e.name] += e.time_range.elapsed_us()
    linked_pairs, linked = [], Counter()
    for e in cpu:  # kernels linked to the operator that launched them
        for k in e.kernels:
            linked_pairs.append((k.name, label([k.name, *_chain(e)]), k.duration))
            linked[k.name] += k.duration
    share = {name: min(1.0, kernels[name] / t) if t > 0 else 0.0 for name, t in linked.items()}
    pairs = [(lab, t * share[name]) for name, lab, t in linked_pairs if share[name] > 0]
    pairs += [(name, t - linked[name]) for name, t in kernels.items() if t - linked[name] > 0]  # unlinked
    return pairs


def format_table(parts: dict[str, dict[str, float]], unit: str = "ms") -> list[str]:
    """The breakdown as aligned text lines (time in ``unit``s, share in %)."""
    lines = [f"  {'category':<10} {'time ' + unit:>12} {'share':>7}"]
    for cat in CATEGORIES:
        lines.append(f"  {cat:<10} {parts[cat]['time']:>12.3f} {parts[cat]['share'] * 100:>6.1f}%")
    total = sum(p["time"] for p in parts.values())
    lines.append(f"  {'total':<10} {total:>12.3f} {100.0 if total else 0.0:>6.1f}%")
    return lines


class StepProfiler:
    """Profiles steps ``first..last`` of the loop (``begin``/``end`` around each step, ``close`` after); ``stacks``:
    record Python frames (``--no-profile-stacks`` leaves them out, and with them the frames' classification)."""

    def __init__(
        self,
        steps: tuple[int, int] | None,
        out_dir: str | Path,
        device: torch.device,
        log: Callable[[str], None],
        stacks: bool = True,
    ):
        self.steps, self.out_dir, self.device, self.log, self.stacks = steps, Path(out_dir), device, log, stacks
        self.prof, self.first, self.last, self.metrics = None, None, None, {}

    def begin(self, step: int) -> None:
        """Before step ``step``: start profiling at the first step of the range this run reaches."""
        if self.steps and self.prof is None and not self.metrics and self.steps[0] <= step <= self.steps[1]:
            self.first = step
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, with_stack=self.stacks)
            self.prof.start()

    def end(self, step: int, record: dict) -> None:
        """After step ``step``'s record is built: mark it profiled, stop after the last step."""
        if self.prof is None:
            return
        record["profiled"] = True
        self.last = step
        if step >= self.steps[1]:
            self.close()

    def close(self) -> dict:
        """Stop (if still running), write the trace, log and return the breakdown as flat metrics."""
        if self.prof is None:
            return self.metrics
        prof, self.prof = self.prof, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # every launched kernel finished and recorded
        prof.stop()
        rank = dist.get_rank() if dist.is_initialized() else 0
        name = f"trace-rank{rank}.json" if dist.is_initialized() and dist.get_world_size() > 1 else "trace.json"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / name
        prof.export_chrome_trace(str(trace))
        parts = breakdown(labelled_times(prof.events(), self.device.type))
        del prof
        gc.collect()  # the event tree is cyclic: free it now, not inside a timed step
        parts = {c: {"time": p["time"] / 1e3, "share": p["share"]} for c, p in parts.items()}  # us -> ms
        basis = "CUDA kernel time" if self.device.type == "cuda" else "CPU self time"
        last = self.last or self.first  # a run that failed inside its first profiled step
        self.log(f"lpbench: profile of steps {self.first}-{last} ({basis}), trace {trace}")
        for line in format_table(parts):
            self.log(line)
        self.metrics = {
            "steps": f"{self.first}:{last}",
            "trace": str(trace),
            "basis": basis,
            "total_ms": sum(p["time"] for p in parts.values()),
            **{f"{c}_ms": p["time"] for c, p in parts.items()},
            **{f"{c}_pct": p["share"] * 100 for c, p in parts.items()},
        }
        return self.metrics
