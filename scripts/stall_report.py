"""Where the warps of a profiled kernel wait: reads the SASS page that scripts/gpu_profile.sh exports.

    python3 scripts/stall_report.py <format>_sass.csv [--top 40] [--context 0] [--tiles N]

Prints the stall reasons over the whole kernel, then the instructions with the most samples (address offset from
the kernel's start, SASS, samples, their two largest reasons), optionally with `--context` instructions around each.
With `--tiles N` (the page tiles the profiled launch processed: scripts/profile_decode.py prints it) it first prints
the executed warp instructions per page tile, in all and by opcode: the instruction budget of a format's page.
"""

from __future__ import annotations

import argparse
import csv
import io
from collections import Counter


def read(path):
    with open(path, newline="") as f:
        text = f.read()
    kernel = text.splitlines()[0]
    rows = list(csv.DictReader(io.StringIO(text.split("\n", 1)[1])))
    return kernel, rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--context", type=int, default=0)
    parser.add_argument("--tiles", type=int, default=0, help="page tiles of the launch: print the instruction mix")
    args = parser.parse_args(argv)
    kernel, rows = read(args.csv)
    reasons = [k for k in rows[0] if k.startswith("stall_") and not k.endswith("(Not Issued)")]
    base = int(rows[0]["Address"], 16)
    samples = [int(r["Warp Stall Sampling (All Samples)"] or 0) for r in rows]
    total = sum(samples) or 1
    print(kernel.strip('",'))
    print(f"{len(rows)} SASS instructions, {total} samples")
    by_reason = Counter({k: sum(int(r[k] or 0) for r in rows) for k in reasons})
    print("stall reasons: " + ", ".join(f"{k[6:]} {v / total:.1%}" for k, v in by_reason.most_common(8)))
    if args.tiles:
        print_mix(rows, args.tiles)
    order = sorted(range(len(rows)), key=lambda i: -samples[i])[: args.top]
    for i in sorted(order) if args.context else order:
        lo, hi = max(0, i - args.context), min(len(rows), i + args.context + 1)
        for j in range(lo, hi):
            r = rows[j]
            top2 = Counter({k[6:]: int(r[k] or 0) for k in reasons}).most_common(2)
            why = ", ".join(f"{k} {v}" for k, v in top2 if v)
            mark = ">" if j == i else " "
            offset = int(r["Address"], 16) - base
            print(f"{mark}{offset:6x} {samples[j] / total:6.2%}  {r['Source'].strip():58.58s} {why}")
        if args.context:
            print()


def print_mix(rows, tiles):
    """Executed warp instructions (every warp of the CTA, the producer's included) per page tile, by opcode."""
    by_op = Counter()
    for r in rows:
        words = r["Source"].split()
        if not words:
            continue
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]  # past a predicate
        by_op[op.split(".")[0]] += int((r.get("Instructions Executed") or "0").replace(",", ""))
    total = sum(by_op.values())
    print(f"executed warp instructions per page tile: {total / tiles:.0f} (" +
          ", ".join(f"{op} {n / tiles:.0f}" for op, n in by_op.most_common(16)) + ")")


if __name__ == "__main__":
    main()
