"""Where a jitted decode loop's time per call goes, from the profiler trace that `bench --trace` wrote.

The bench's loop figure per call is 13-140 µs above the decode kernels' span (docs/PERF.md, session 25) although the
loop's own glue, timed alone, costs 14-25 µs. This prints, for a few consecutive calls in the middle of the traced loop,
every device event (kernels, copies, memsets) against the call's splitkv_mla start, and per call the period (from
one splitkv_mla start to the next), the span (splitkv_mla start to the end of its combine), the device's busy time
within the period and the idle gaps longer than 2 µs.

    python3 scripts/trace_calls.py /tmp/jfm_trace/<bench_trace folder>/C2_bf16 [--calls 3]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jax_flash_mla.bench import busy_and_gaps, device_pids, trace_events  # noqa: E402


def device_events(events):
    """Complete ("X") events of the GPU device processes, sorted by start: (start µs, duration µs, name)."""
    devices = device_pids(events)
    out = [(float(e["ts"]), float(e["dur"]), e["name"]) for e in events
           if e.get("ph") == "X" and e["pid"] in devices]
    return sorted(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace_dir", help="one traced case's folder (it holds plugins/profile/...)")
    ap.add_argument("--calls", type=int, default=3, help="consecutive calls to print, from the middle of the loop")
    args = ap.parse_args(argv)

    events = device_events(trace_events(args.trace_dir))
    starts = [i for i, (_, _, name) in enumerate(events) if "splitkv_mla" in name]
    if len(starts) < args.calls + 1:
        raise SystemExit(f"trace_calls: {len(starts)} splitkv_mla launches in {args.trace_dir}, need {args.calls + 1}")

    periods, spans, busies, gaps = [], [], [], []
    for k in range(len(starts) - 1):
        t0, t1 = events[starts[k]][0], events[starts[k + 1]][0]
        window = events[starts[k]:starts[k + 1]]
        combine_end = max((s + d for s, d, n in window if "combine" in n), default=t0 + window[0][1])
        busy, idle = busy_and_gaps(events, t0, t1)
        periods.append(t1 - t0)
        spans.append(combine_end - t0)
        busies.append(busy)
        gaps.append(idle)
    print(f"{len(periods)} calls: median period {np.median(periods):.1f} µs, span {np.median(spans):.1f} µs, "
          f"device busy {np.median(busies):.1f} µs of the period")

    first = max(0, len(starts) // 2 - args.calls // 2)
    for k in range(first, first + args.calls):
        t0, t1 = events[starts[k]][0], events[starts[k + 1]][0]
        print(f"\ncall {k}: period {t1 - t0:.1f} µs, span {spans[k]:.1f} µs, busy {busies[k]:.1f} µs")
        print(f"  {'start':>9s} {'dur':>9s}  event (µs against this call's splitkv_mla start)")
        for s, d, name in events:
            if s < t1 and s + d > t0:  # the glue ahead of the next splitkv_mla closes the listing
                print(f"  {s - t0:9.1f} {d:9.1f}  {name[:90]}")
        print("  idle gaps > 2 µs (offset, length): " + (", ".join(f"{o:.1f}+{g:.1f}" for o, g in gaps[k]) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
