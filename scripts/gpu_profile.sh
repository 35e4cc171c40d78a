#!/usr/bin/env bash
# Nsight Compute on the decode kernel, per format: where its warps stall, instruction by instruction.
# Run on the GPU machine from the repo root, after scripts/build_carry.sh here and with carry=[".carry"]:
#   FORMATS="fp8_ds_mla fp8_per_tensor" SHAPE=M1 bash scripts/gpu_profile.sh
# For each format, $OUT gets <format>_details.csv (the metrics of the sections below) and <format>_sass.csv
# (the SASS with its stall samples; read it with scripts/stall_report.py). One launch of splitkv_mla is profiled
# (the second call's: the first one compiles), at batch $BATCH and s_k $SEQLEN (the per-page work is the shape's).
# SECTIONS (default "SpeedOfLight WarpStateStats SourceCounters") picks the ncu sections. Session 12 at C1: seven
# sections at b 64 did not finish three formats in 500 s; the three default ones at b 32 took 20 s for one (which of
# the two differences mattered was not measured).
# PROFILE_TIMEOUT (default 150) bounds one format's ncu run, so one slow format cannot take the whole call.
# The summary ends with the executed warp instructions per page tile by opcode (stall_report.py --tiles).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jax_flash_mla_profile}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
shopt -s nullglob
carried=(.carry/jax_flash_mla/_jax_flash_mla*.so)
((${#carried[@]})) && cp "${carried[@]}" jax_flash_mla/
# ncu saves and restores the memory a replayed kernel can reach: keep XLA from reserving most of the GPU.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0
for fmt in ${FORMATS:-bf16 fp8_per_tensor fp8_ds_mla}; do
  rep=/tmp/profile_$fmt
  echo "==== ncu: $fmt ${SHAPE:-M1}"
  sections=()
  for sec in ${SECTIONS:-SpeedOfLight WarpStateStats SourceCounters}; do sections+=(--section "$sec"); done
  timeout "${PROFILE_TIMEOUT:-150}" ncu --clock-control none --kernel-name regex:splitkv_mla --launch-skip 1 \
      --launch-count 1 "${sections[@]}" -f -o "$rep" \
      "$PY" scripts/profile_decode.py --format "$fmt" --shape "${SHAPE:-M1}" --batch "${BATCH:-64}" \
      --seqlen "${SEQLEN:-4096}" --calls 2 > "$OUT/${fmt}_ncu.log" 2>&1 || status=1
  grep -vE "^==PROF==|^$" "$OUT/${fmt}_ncu.log" | tail -5
  tiles=$(grep -o 'page_tiles=[0-9]*' "$OUT/${fmt}_ncu.log" | tail -1 | cut -d= -f2)
  ncu -i "$rep.ncu-rep" --page details --csv > "$OUT/${fmt}_details.csv" || status=1
  ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$OUT/${fmt}_sass.csv" || status=1
  "$PY" - "$OUT/${fmt}_details.csv" <<'PYEOF'
import csv, sys
wanted = ("Duration", "Elapsed Cycles", "SM Active Cycles", "Registers Per Thread",
          "Warp Cycles Per Issued Instruction", "Issue Slots Busy",
          "Compute (SM) Throughput", "Memory Throughput", "DRAM Throughput")
for row in csv.DictReader(open(sys.argv[1])):
    if row.get("Metric Name") in wanted:
        print(f'  {row["Metric Name"]}: {row["Metric Value"]} {row["Metric Unit"]}')
PYEOF
  "$PY" scripts/stall_report.py "$OUT/${fmt}_sass.csv" --top 0 --tiles "${tiles:-0}" | tail -2
done
ls -la "$OUT"
exit $status
