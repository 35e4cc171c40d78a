#!/usr/bin/env bash
# A/B of kernel builds on one GPU machine, in one call: for each carried build, its GPU tests, racecheck on our
# kernels and the benchmark, then one table. Timings of different builds only compare within one call (one card).
#
# Here (no GPU): build each candidate with scripts/build_carry.sh (in a git worktree for other commits) and copy
# its .carry to .carry_<name>; then on the GPU machine, with carry=[".carry_<name>", ...]:
#   BUILDS="main sync slab" bash scripts/gpu_compare.sh
# Environment (optional): BUILDS (names of .carry_<name>, default: every .carry_* here); FORMATS (default
# "bf16 fp8_per_tensor"); SHAPES (bench shapes, default M1,C1,C2); BENCH_ARGS (more bench arguments, e.g.
# --unroll); SKIP_TESTS / SKIP_RACECHECK =1 to leave a step
# out (the first build listed is taken as the baseline: only benched); PYTEST_WORKERS (default 4).
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jax_flash_mla_compare}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
formats=${FORMATS:-bf16 fp8_per_tensor}
read -r -a builds <<< "${BUILDS:-$(ls -d .carry_* 2> /dev/null | sed 's/^\.carry_//' | tr '\n' ' ')}"
workers=${PYTEST_WORKERS:-4}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
declare -a summary=()

for i in "${!builds[@]}"; do
  name=${builds[$i]}
  so=(.carry_"$name"/jax_flash_mla/_jax_flash_mla*.so)
  if [[ ! -f ${so[0]} ]]; then
    summary+=("$name: no module in .carry_$name")
    continue
  fi
  cp "${so[@]}" jax_flash_mla/
  echo "==== $name: $(head -1 .carry_"$name"/BUILD_INFO.txt 2> /dev/null)"
  line="$name:"
  if ((i > 0)) && [[ ${SKIP_TESTS:-0} != 1 ]]; then
    k=$(echo "$formats" | sed 's/ / or /g')
    XLA_PYTHON_CLIENT_MEM_FRACTION=$("$PY" -c "print(round(0.9 / $workers, 3))") JAX_FLASH_MLA_REQUIRE_GPU=1 \
      timeout 240 "$PY" -m pytest -n "$workers" -q tests/test_decode_gpu.py -k "$k" > "$OUT/pytest_$name.log" 2>&1
    line+=" tests rc=$? ($(tail -1 "$OUT/pytest_$name.log" | tr -d '=' | xargs));"
  fi
  if ((i > 0)) && [[ ${SKIP_RACECHECK:-0} != 1 ]]; then
    SANITIZE_FORMATS=$(echo "$formats" | tr ' ' ',') timeout 150 compute-sanitizer --tool racecheck --error-exitcode 1 \
      --kernel-name kns=splitkv_mla "$PY" tests/gpu_sanitize.py > "$OUT/racecheck_$name.log" 2>&1
    line+=" racecheck rc=$? ($(grep -E 'RACECHECK SUMMARY' "$OUT/racecheck_$name.log" | sed 's/=* *RACECHECK SUMMARY: //'));"
  fi
  read -r -a bench_args <<< "${BENCH_ARGS:-}"
  timeout 200 "$PY" -m jax_flash_mla.bench --skip-reference --formats "$(echo "$formats" | tr ' ' ',')" \
    --shapes "${SHAPES:-M1,C1,C2}" --csv "$OUT/bench_$name.csv" --png /tmp/bench_"$name".png "${bench_args[@]}" \
    > "$OUT/bench_$name.log" 2>&1
  line+=" bench rc=$?"
  summary+=("$line")
  grep -E "^(M1|C1|C2|VL) " "$OUT/bench_$name.log" | awk -v n="$name" '{printf "  %-8s %-3s %-15s %9s us\n", n, $1, $2, $4}' \
    >> "$OUT/table.txt"
done

echo
echo "==== summary"
printf '%s\n' "${summary[@]}"
sort -k2,2 -k3,3 -s "$OUT/table.txt" 2> /dev/null
