#!/usr/bin/env bash
# FlashMLA's split-KV kernel and ours under Nsight Compute, side by side, on one shape of the harness (main.cu).
# Run on the GPU machine after build.sh here, with carry=[".carry_fmla"]:
#   bash scripts/flashmla_anchor/ncu_compare.sh [shape, default C2] [harness, default .carry_fmla/flashmla_anchor]
# Profiles one launch of each kernel (matched on mangled names; skipping 3 lands past the float64 check case, in
# the shape's warm-ups), twice: the sections below with their SASS source counters, then the L2 metrics. Prints one
# table, a row per metric, and leaves under $OUT (default /tmp/flashmla_ncu) each kernel's details and SASS pages as
# CSV, which scripts/stall_report.py reads. ncu locks the clocks to base, so compare cycles, not times.
# NCU_CACHE_CONTROL=none keeps L2 between the profiled replays (ncu flushes it by default: `all`), the regime of the
# sweep's loop figures, where a small batch's cache stays in L2.
set -uo pipefail
shape=${1:-C2}
harness=${2:-.carry_fmla/flashmla_anchor}
[[ -x $harness ]] || { echo "ncu_compare: no harness at $harness (build.sh, then carry its folder)" >&2; exit 2; }
OUT=${OUT:-/tmp/flashmla_ncu}
mkdir -p "$OUT"
sections=(SpeedOfLight WarpStateStats SchedulerStats ComputeWorkloadAnalysis MemoryWorkloadAnalysis InstructionStats
  SourceCounters)
l2=lts__t_sectors.sum,lts__t_sectors_srcunit_tex.sum,lts__t_sectors_srcunit_ltcfabric.sum,lts__t_sectors_lookup_hit.sum
l2+=,lts__lts2xbar_cycles_active_realtime.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum
declare -A kernels=([flashmla]=flash_fwd_splitkv [ours]=13jax_flash_mla4sm9018splitkv)
status=0
for side in flashmla ours; do
  args=(--kernel-name-base mangled -k "regex:${kernels[$side]}" --launch-skip 3 --launch-count 1
    --cache-control "${NCU_CACHE_CONTROL:-all}")
  sec=()
  for s in "${sections[@]}"; do sec+=(--section "$s"); done
  timeout 200 ncu "${args[@]}" "${sec[@]}" -f -o "/tmp/ncu_$side" "$harness" "$shape" 1 > "$OUT/${side}_ncu.log" 2>&1 ||
    status=1
  ncu -i "/tmp/ncu_$side.ncu-rep" --page details --csv > "$OUT/${side}_details.csv" || status=1
  ncu -i "/tmp/ncu_$side.ncu-rep" --page source --csv --print-source sass > "$OUT/${side}_sass.csv" || status=1
  timeout 200 ncu "${args[@]}" --metrics "$l2" --csv "$harness" "$shape" 1 2> /dev/null |
    grep -E '^"[0-9]' > "$OUT/${side}_l2.csv" || status=1
done
python3 - "$OUT" <<'PYEOF'
import csv, sys
out = sys.argv[1]
wanted = ("SM Frequency", "Elapsed Cycles", "Duration", "Compute (SM) Throughput", "L2 Cache Throughput",
          "DRAM Throughput", "L2 Hit Rate", "Executed Instructions", "Executed Ipc Active", "Issue Slots Busy",
          "Active Warps Per Scheduler", "Eligible Warps Per Scheduler", "Warp Cycles Per Issued Instruction")
table = {}
for side in ("flashmla", "ours"):
    for row in csv.DictReader(open(f"{out}/{side}_details.csv")):
        name = row["Metric Name"]
        if name in wanted:
            table.setdefault(name, {}).setdefault(side, f'{row["Metric Value"]} {row["Metric Unit"]}')
    for row in csv.reader(open(f"{out}/{side}_l2.csv")):
        table.setdefault(row[-3], {})[side] = f"{row[-1]} {row[-2]}"
print(f'{"metric":58} {"FlashMLA":>22} {"ours":>22}')
for name, sides in table.items():
    print(f'{name[:58]:58} {sides.get("flashmla", "-"):>22} {sides.get("ours", "-"):>22}')
PYEOF
exit $status
