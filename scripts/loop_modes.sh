#!/usr/bin/env bash
# Where the bench's loop figure exceeds the decode's profiled period (docs/PERF.md, session 25: 13-97 µs a call).
# XLA replays its command buffers (CUDA graphs) in the timed runs, but launches their thunks one by one while a
# profiler session is active, so `bench --trace` profiles another execution than the one it times. This times the
# same loop in several XLA modes, each in its own process (XLA_FLAGS are read once), and logs the SM clock and the
# power draw meanwhile, in case the difference is the card's clock:
#   graphs       XLA's defaults (the bench as usual); profiled op by op, as before
#   sustained    the same, its profiled loop run 2 + REPEATS times back to back (bench --trace-runs), the span from the
#                last run: the load history of the timed runs, where the single profiled run starts on a rested card
#   graphs_prof  the same, profiled with the graphs replayed (--xla_enable_command_buffers_during_profiling=true)
#   op_by_op     no command buffers at all (--xla_gpu_enable_command_buffer=): timed as it was profiled
#   while        the whole loop in one graph (+WHILE: conditional nodes, no host round trip per call)
#   paused       XLA's defaults, the GPU idle for 1 s before each timed run (bench --pause 1), as it is before the
#                profiled run: if the card's clock drops under back-to-back runs, this one times near the period
#                (and `sustained`'s last span sits near the loop figure less its glue, its first near `graphs`' span)
# On the GPU machine, with the build to time as .carry_<BUILD> (default: the package as installed here):
#   BUILD=main FORMATS="bf16 fp8_per_tensor" SHAPES=C1,C2 bash scripts/loop_modes.sh
# BENCH_ARGS: more bench arguments (e.g. --iters 200). Prints per mode and case the loop figure, the profiled span
# and the profiled run's loop, and the clock; the last lines are a table.
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
formats=${FORMATS:-bf16 fp8_per_tensor}
shapes=${SHAPES:-C1,C2}
repeats=${REPEATS:-6}
work=/tmp/jax_flash_mla_loop_modes
rm -rf "$work" && mkdir -p "$work"
if [[ -n ${BUILD:-} ]]; then
  cp .carry_"$BUILD"/jax_flash_mla/_jax_flash_mla*.so jax_flash_mla/ || exit 1
fi

declare -A flags=(
  [graphs]=""
  [sustained]=""
  [graphs_prof]="--xla_enable_command_buffers_during_profiling=true"
  [op_by_op]="--xla_gpu_enable_command_buffer="
  [while]="--xla_gpu_enable_command_buffer=+WHILE"
  [paused]=""
)
modes=(graphs sustained graphs_prof op_by_op while paused)

# The clock log: one line every 100 ms for the whole run. Older drivers call the reasons field clocks_throttle_reasons.
query=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active
nvidia-smi --query-gpu=$query --format=csv,noheader > /dev/null 2>&1 ||
  query=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu
nvidia-smi --query-gpu=$query --format=csv,noheader,nounits -lms 100 > "$work/clocks.csv" 2> /dev/null &
logger=$!
trap 'kill $logger 2> /dev/null' EXIT

for mode in "${modes[@]}"; do
  case $mode in
    while) extra=() ;;
    paused) extra=(--pause 1) ;;
    sustained) extra=(--trace "$work/trace_$mode" --trace-runs $((2 + repeats))) ;;
    *) extra=(--trace "$work/trace_$mode") ;;
  esac
  echo "==== $mode: XLA_FLAGS=${flags[$mode]}"
  date '+%Y/%m/%d %H:%M:%S.%3N' > "$work/start_$mode"  # nvidia-smi's timestamps: local time
  XLA_FLAGS=${flags[$mode]} timeout "${MODE_TIMEOUT:-240}" "$PY" -m jax_flash_mla.bench --skip-reference \
    --formats "$(echo "$formats" | tr ' ' ',')" --shapes "$shapes" --repeats "$repeats" "${extra[@]}" \
    --csv "$work/bench_$mode.csv" --png "$work/bench_$mode.png" ${BENCH_ARGS:-} > "$work/bench_$mode.log" 2>&1
  echo "rc=$?" >> "$work/bench_$mode.log"
  date '+%Y/%m/%d %H:%M:%S.%3N' > "$work/end_$mode"
  grep -E "^\[bench [0-9]|rror|rc=" "$work/bench_$mode.log" | cut -c1-200
done
kill $logger 2> /dev/null

"$PY" - "$work" "${modes[@]}" <<'EOF'
import csv, datetime, math, os, statistics, sys

work, modes = sys.argv[1], sys.argv[2:]
when = lambda text: datetime.datetime.strptime(text.strip(), "%Y/%m/%d %H:%M:%S.%f")
clock_rows = []
for line in open(os.path.join(work, "clocks.csv")):
    parts = [p.strip() for p in line.split(",")]
    try:
        clock_rows.append((when(parts[0]), float(parts[1]), float(parts[3]), parts[5] if len(parts) > 5 else ""))
    except (ValueError, IndexError):
        continue

def clocks(mode):
    """Median SM clock (MHz) and power (W) between the mode's start and end, and the non-idle reasons seen."""
    try:
        begin, end = (when(open(os.path.join(work, f"{k}_{mode}")).read()) for k in ("start", "end"))
    except OSError:
        return "no clock log"
    rows = [r for r in clock_rows if begin <= r[0] <= end and r[2] > 150]  # under load only
    if not rows:
        return "no clock samples under load"
    reasons = sorted({r[3] for r in rows if r[3] and r[3] not in ("0x0000000000000000", "0x0000000000000001")})
    return (f"SM {statistics.median(r[1] for r in rows):.0f} MHz (min {min(r[1] for r in rows):.0f}), "
            f"{statistics.median(r[2] for r in rows):.0f} W" + (f", reasons {' '.join(reasons)}" if reasons else ""))

print("\n==== loop modes (us per call; span: the (last) profiled run's; first span: the first of several profiled runs;"
      " traced loop: the last profiled run's wall time)")
print(f"{'mode':12s} {'case':22s} {'loop':>8s} {'span':>8s} {'first span':>11s} {'traced loop':>12s}")
first_span = lambda row: float((row.get("span_by_run_us") or "nan").split()[0])
for mode in modes:
    path = os.path.join(work, f"bench_{mode}.csv")
    if not os.path.exists(path):
        print(f"{mode:12s} no CSV (see bench_{mode}.log)")
        continue
    for row in csv.DictReader(open(path)):
        if row.get("path") != "kernel":
            continue
        value = lambda k: float(row[k]) if row.get(k) not in (None, "") else math.nan
        print(f"{mode:12s} {row['shape'] + ' ' + row['format']:22s} {value('us_median'):8.1f} {value('span_us'):8.1f} "
              f"{first_span(row):11.1f} {value('traced_loop_us'):12.1f}")
    print(f"{mode:12s} {clocks(mode)}")
EOF
echo "==== excess of the loop over the span (the profiled modes), by tensor load"
"$PY" scripts/loop_excess.py "$work"/bench_*.csv
for mode in graphs graphs_prof op_by_op; do
  for d in "$work"/trace_"$mode"/*/; do
    [[ -d $d ]] || continue
    echo "== $mode $(basename "$d")"
    timeout 60 "$PY" scripts/trace_calls.py "$d" --calls 1 2>&1 | head -14
  done
done
mkdir -p "${OUT:-/tmp}" && tar czf "${OUT:-/tmp}/loop_modes.tar.gz" -C "$work" --exclude='trace_*' . 2> /dev/null
