"""Where a profiled step's time went, per trace: is the GPU or the host setting the pace?

    python benchmarks/trace_summary.py $OUT/res/RUN/profiles/*/trace*.json[.gz] [--top 8]

For each Chrome trace of ``--profile-steps`` (one per rank): the span from the first to the last device event,
the time some device event ran (busy) and none did (idle), NCCL kernel time and the part of it no compute kernel
overlapped (``lpbench.metrics.trace.exposed_comm``: waiting for another rank counts), the host's time blocked in
CUDA synchronisations, and the autograd nodes that ran outside a compiled graph. Much idle time with little host
waiting means a host-bound step: the host launched too slowly, or synchronised where it could have run ahead.
Profiling itself slows the host (less with `--no-profile-stacks`), so read shares and node names here, and take step
times from unprofiled runs.
"""

from __future__ import annotations

import argparse

from lpbench.metrics import trace


def summary(path: str, top: int) -> list[str]:
    events = trace.read(path)
    device = trace.device_events(events)
    span = (max(e["ts"] + e["dur"] for e in device) - device[0]["ts"]) / 1e3 if device else 0.0
    busy = trace.busy_ms(events)
    comm, exposed = trace.exposed_comm(events)
    eager = trace.eager_backward_nodes(events)
    return [
        f"{path}",
        f"  span {span:.1f} ms | busy {busy:.1f} | idle {span - busy:.1f} | NCCL {comm:.1f}, exposed {exposed:.1f} | "
        f"host blocked in syncs {trace.host_sync_ms(events):.1f}",
        "  eager autograd nodes: " + (" | ".join(f"{n} x{c}" for n, c in eager.most_common(top)) or "none"),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--top", type=int, default=8, help="eager autograd nodes listed per trace")
    args = ap.parse_args()
    for path in args.traces:
        print("\n".join(summary(path, args.top)))


if __name__ == "__main__":
    main()
