"""How far the bench's timed loop exceeds the profiled decode span, case by case, next to each case's tensor load.

    python3 scripts/loop_excess.py BENCH.csv [BENCH.csv ...]

Reads CSVs that `python -m jax_flash_mla.bench --trace ...` wrote (scripts/gpu_compare.sh keeps them in its log
archive, scripts/loop_modes.sh in its own). Per kernel row: excess = loop figure - the loop's own glue (timed alone,
column loop_overhead_us) - span, and the tensor load = the case's FLOPs over the span, as a fraction of the GEMM rate
the same bench measured for the format's math (bf16 GEMM for bf16, FP8 GEMM for the FP8 formats). An excess that
is a fixed cost per call (graph launches, host round trips) stays the same in µs from case to case; one that grows
with the tensor load points at the card's clock under sustained load (its power limit), which the profiled run may
not have reached: it starts after the profiler's set-up, with the card idle meanwhile (scripts/loop_modes.sh
measures the clock and tells the two apart).
"""

from __future__ import annotations

import argparse
import csv
import math
import os


def excess_rows(path: str) -> list:
    """(label, shape, format, loop, glue, span, excess, excess / span, tensor load) for each kernel row with a span."""
    label = os.path.splitext(os.path.basename(path))[0]
    out = []
    for row in csv.DictReader(open(path)):
        if row.get("path") != "kernel" or not row.get("span_us"):
            continue
        loop, glue, span = (float(row[k]) for k in ("us_median", "loop_overhead_us", "span_us"))
        if not span > 0:
            continue
        flops_per_us = float(row["tflops"]) * loop  # tflops was computed from the loop figure
        rate = float(row["bf16_gemm_tflops" if row["format"] == "bf16" else "fp8_gemm_tflops"])
        load = flops_per_us / span / rate if rate > 0 else math.nan
        excess = loop - glue - span
        out.append((label, row["shape"], row["format"], loop, glue, span, excess, excess / span, load))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", nargs="+", help="bench CSVs (with span_us: runs with --trace)")
    args = parser.parse_args(argv)
    rows = [r for path in args.csv for r in excess_rows(path)]
    if not rows:
        print("no kernel rows with a span (bench runs without --trace?)")
        return 1
    print(f"{'csv':14s} {'shape':5s} {'format':15s} {'loop':>7s} {'glue':>5s} {'span':>7s} {'excess':>7s} "
          f"{'of span':>8s} {'tensor load':>11s}")
    for label, shape, fmt, loop, glue, span, excess, frac, load in sorted(rows, key=lambda r: (r[8], r[0])):
        print(f"{label:14s} {shape:5s} {fmt:15s} {loop:7.1f} {glue:5.1f} {span:7.1f} {excess:7.1f} {100 * frac:7.1f}% "
              f"{100 * load:10.0f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
