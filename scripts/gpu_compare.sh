#!/usr/bin/env bash
# A/B of kernel builds on one GPU machine, in one call: for each carried build, its GPU tests, racecheck on our
# kernels and the benchmark, then one table. Timings of different builds only compare within one call (one card).
#
# Here (no GPU): build each candidate with scripts/build_carry.sh (another commit: scripts/build_carry_at.sh) and copy
# its .carry to .carry_<name>; then on the GPU machine, with carry=[".carry_<name>", ...]:
#   BUILDS="main sync slab" bash scripts/gpu_compare.sh
# Environment (optional): BUILDS (names of .carry_<name>, default: every .carry_* here); FORMATS (default "bf16
# fp8_per_tensor"); SHAPES (bench shapes, default M1,C1,C2); BENCH_ARGS (more bench arguments, e.g. --unroll);
# SKIP_SMOKE / SKIP_TESTS / SKIP_RACECHECK / SKIP_BENCH =1 to leave a step out (the first build listed is taken as the
# baseline: only benched, so with SKIP_BENCH it runs nothing); SMOKE_TIMEOUT (seconds, default 60: a build whose smoke
# run, tests/gpu_sanitize.py, fails or times out gets no further step); PYTEST_WORKERS (default from the card:
# scripts/gpu_test_share.py, 15 on an H200, 8 on an H100); TEST_TIMEOUT / RACECHECK_TIMEOUT (seconds for one build's
# GPU tests / one format's run of a sanitizer, default 240 / 150); SANITIZE_TOOLS (the compute-sanitizer tools run per
# format when SKIP_RACECHECK is not 1, default "racecheck", e.g. "racecheck synccheck"); SANITIZE_RETRIES (reruns of a
# sanitizer run that segfaulted, rc 139: default 2); CHECK_GAIN (e.g. 0.995: the candidates' tests and sanitizers
# run after all the benches, and only for a build whose loop figure, the mean of its runs, is below CHECK_GAIN times
# the baseline's at every shape and format both benched, so that one call benches A-B-A and checks only a gain);
# BASELINE_FORMATS (formats benched for the baseline, default FORMATS); TEST_FORMATS (formats whose GPU tests run,
# default FORMATS); TEST_ARGS (more pytest arguments, e.g. "-m few_rows" for the few-rows kernels' cases; split on
# spaces, so no argument may contain one: "-m 'not few_rows'" does not work); TEST_MEM_TOTAL (the share of the card's
# memory the pytest workers split; default from the card as well); SANITIZE_BESIDE_TESTS=1 runs the sanitizers in
# the background while the tests run (on a copy of the build's package; the tests get one fewer worker and, unless
# TEST_MEM_TOTAL says otherwise, 0.84 of the card's memory), so that one 600 s call holds a build's tests,
# sanitizers and bench.
# A name may repeat (BUILDS="main new main": the bench in A-B-A order within one call); a repeat's logs and table
# rows are named <name>.<position>.
# A build whose carry has package/jax_flash_mla (build_carry_at.sh with WITH_PACKAGE=1) runs with that Python package
# in place of this checkout's; the others with this checkout's.
# Logs: $OUT/compare_logs_N.tar.gz, N counting the runs of one GPU call.
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
# Logs go to a work folder; at the end they are packed into one archive under $OUT (the device tool brings back
# only a few files), and racecheck's first hazards are printed. COMPARE_LOGS names another work folder.
logs=${COMPARE_LOGS:-/tmp/jax_flash_mla_compare}
rm -rf "$logs" && mkdir -p "$logs"
PY=${PYTHON:-python3}
formats=${FORMATS:-bf16 fp8_per_tensor}
read -r -a builds <<< "${BUILDS:-$(ls -d .carry_* 2> /dev/null | sed 's/^\.carry_//' | tr '\n' ' ')}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
beside=${SANITIZE_BESIDE_TESTS:-0}
[[ ${SKIP_RACECHECK:-0} == 1 ]] && beside=0
if [[ $beside == 1 ]]; then
  read -r workers _ < <("$PY" scripts/gpu_test_share.py)
  read -r workers mem_fraction < <(PYTEST_WORKERS=${PYTEST_WORKERS:-$((workers > 1 ? workers - 1 : 1))} \
    TEST_MEM_TOTAL=${TEST_MEM_TOTAL:-0.84} "$PY" scripts/gpu_test_share.py)
else
  read -r workers mem_fraction < <("$PY" scripts/gpu_test_share.py)
fi
echo "pytest: $workers workers, XLA_PYTHON_CLIENT_MEM_FRACTION=$mem_fraction each"
declare -a summary=()
# This checkout's package, restored before each build (a build may bring its own Python side).
pristine=$logs/package_pristine
cp -r jax_flash_mla "$pristine"

# Each sanitizer of SANITIZE_TOOLS on each format, one process per format: with several kernels in one process
# compute-sanitizer 2026.x segfaulted (rc 139) where each format alone ran clean (session 5). Even alone, racecheck
# segfaults in about half of its fp8_ds_mla runs, on every build (session 35), so a run that ends in rc 139 is run
# again, up to SANITIZE_RETRIES (default 2) times; the fragment lists each crashed attempt. Prints the summary's
# fragment.
sanitize() {
  local tag=$1 script=$2 tool f log rc verdict crashes attempt
  for tool in ${SANITIZE_TOOLS:-racecheck}; do
    for f in $formats; do
      log=$logs/${tool}_${tag}_$f.log
      crashes=""
      for ((attempt = 0; attempt <= ${SANITIZE_RETRIES:-2}; attempt++)); do
        SANITIZE_FORMATS=$f timeout "${RACECHECK_TIMEOUT:-150}" compute-sanitizer --tool "$tool" --error-exitcode 1 \
          --kernel-name kns=splitkv_mla "$PY" "$script" > "$log" 2>&1
        rc=$?
        ((rc == 139)) || break
        cp "$log" "${log%.log}_crash$attempt.log"
        crashes+="rc=139, "
      done
      verdict=$(grep -E '(RACECHECK|ERROR) SUMMARY' "$log" | sed -E 's/=* *(RACECHECK|ERROR) SUMMARY: //')
      echo -n " $tool $f ${crashes}rc=$rc ($verdict);"
    done
  done
}

# Puts build $1's module (and its own Python package, if its carry has one) into the checkout; prints " (its own
# Python package)" for such a build. Fails, leaving the checkout as it is, when the carry has no module.
install_build() {
  local so=(.carry_"$1"/jax_flash_mla/_jax_flash_mla*.so)
  [[ -f ${so[0]} ]] || return 1
  rm -rf jax_flash_mla && cp -r "$pristine" jax_flash_mla
  if [[ -d .carry_$1/package/jax_flash_mla ]]; then
    cp -r .carry_"$1"/package/jax_flash_mla/. jax_flash_mla/
    echo -n " (its own Python package)"
  fi
  cp "${so[@]}" jax_flash_mla/
}

# The installed build's GPU tests and sanitizers (unless skipped), tagged $1: prints the summary's fragment.
checks() {
  local tag=$1 sanitize_bg="" k
  if [[ $beside == 1 ]]; then
    # The build's package as it is now, apart from the checkout the tests use; tests/gpu_sanitize.py imports the
    # package beside its own folder.
    rm -rf "$logs/sanitize_$tag" && mkdir -p "$logs/sanitize_$tag" && cp -r jax_flash_mla tests "$logs/sanitize_$tag/"
    sanitize "$tag" "$logs/sanitize_$tag/tests/gpu_sanitize.py" > "$logs/sanitize_$tag.txt" &
    sanitize_bg=$!
  fi
  if [[ ${SKIP_TESTS:-0} != 1 ]]; then
    k=$(echo "${TEST_FORMATS:-$formats}" | sed 's/ / or /g')
    read -r -a test_args <<< "${TEST_ARGS:-}"
    XLA_PYTHON_CLIENT_MEM_FRACTION=$mem_fraction JAX_FLASH_MLA_REQUIRE_GPU=1 \
      timeout "${TEST_TIMEOUT:-240}" "$PY" -m pytest -n "$workers" -q --durations=8 tests/test_decode_gpu.py -k "$k" \
      "${test_args[@]}" > "$logs/pytest_$tag.log" 2>&1
    echo -n " tests rc=$? ($(tail -1 "$logs/pytest_$tag.log" | tr -d '=' | xargs));"
    grep -m3 -E "^[0-9.]+s (call|setup)" "$logs/pytest_$tag.log" | sed "s/^/  $tag slowest test: /" >&2
  fi
  if [[ -n $sanitize_bg ]]; then
    wait "$sanitize_bg"
    cat "$logs/sanitize_$tag.txt"
    rm -rf "$logs/sanitize_$tag"
  elif [[ ${SKIP_RACECHECK:-0} != 1 ]]; then
    sanitize "$tag" tests/gpu_sanitize.py
  fi
}

gain=${CHECK_GAIN:-}
[[ ${SKIP_BENCH:-0} == 1 ]] && gain=""
declare -a gated=()
for i in "${!builds[@]}"; do
  name=${builds[$i]}
  # A repeated name is benched only: its checks ran at its first place (or it is the baseline).
  tag=$name
  check=$((i > 0))
  if [[ " ${builds[*]:0:i} " == *" $name "* ]]; then
    tag=$name.$i
    check=0
  fi
  if ! package=$(install_build "$name"); then
    summary+=("$name: no module in .carry_$name")
    continue
  fi
  echo "==== $tag: $(head -1 .carry_"$name"/BUILD_INFO.txt 2> /dev/null)$package"
  line="$tag:"
  # Smoke run first (tests/gpu_sanitize.py's small cases, every format in one process): a build that hangs or is
  # wrong there skips its tests, racecheck and bench, which would each wait for their whole timeout (session 14
  # lost a 600 s call to a hanging build).
  if ((check)) && [[ ${SKIP_SMOKE:-0} != 1 ]]; then
    SANITIZE_FORMATS=$(echo "$formats" | tr ' ' ',') timeout "${SMOKE_TIMEOUT:-60}" "$PY" tests/gpu_sanitize.py \
      > "$logs/smoke_$tag.log" 2>&1
    rc=$?
    if ((rc != 0)); then
      why="timed out: a hang?"
      ((rc == 124)) || why="failed: $(tail -1 "$logs/smoke_$tag.log" | cut -c1-100)"
      summary+=("$line smoke rc=$rc ($why); tests, racecheck and bench skipped")
      echo "==== $tag: smoke rc=$rc ($why), skipped"
      continue
    fi
    line+=" smoke ok;"
  fi
  if ((check)) && [[ -n $gain ]]; then
    gated+=("$name")
  elif ((check)); then
    line+=$(checks "$tag")
  fi
  if [[ ${SKIP_BENCH:-0} == 1 ]]; then
    summary+=("$line")
    continue
  fi
  read -r -a bench_args <<< "${BENCH_ARGS:-}"
  bench_formats=$formats
  ((i == 0)) && bench_formats=${BASELINE_FORMATS:-$formats}
  timeout 200 "$PY" -m jax_flash_mla.bench --skip-reference --formats "$(echo "$bench_formats" | tr ' ' ',')" \
    --shapes "${SHAPES:-M1,C1,C2}" --csv "$logs/bench_$tag.csv" --png /tmp/bench_"$tag".png "${bench_args[@]}" \
    > "$logs/bench_$tag.log" 2>&1
  line+=" bench rc=$?"
  summary+=("$line")
  # Columns: loop median (us), and the decode's span where the bench table has that column (--trace: the one after
  # "max"; without it that place holds TFLOPS, so the span is "-"). Printed as they come too, so that a call cut
  # short by its time limit still shows the builds it finished.
  awk -v n="$tag" '$1 == "shape" { span = ($7 == "span") ? 7 : 0; next }
    /^(M1|C1|C2|VL) / { printf "  %-8s %-3s %-15s %9s us  span %s\n", n, $1, $2, $4, (span ? $span : "-") }' \
    "$logs/bench_$tag.log" | tee -a "$logs/table.txt"
done

# CHECK_GAIN: the checks, after every bench, of the builds whose loop figure (mean over their runs) is below
# CHECK_GAIN times the baseline's at every shape and format both benched.
for name in "${gated[@]}"; do
  ratios=$(awk -v base="${builds[0]}" -v cand="$name" '
    { b = $1; sub(/\.[0-9]+$/, "", b); key = $2 " " $3 }
    b == base { bs[key] += $4; bn[key]++ }
    b == cand { cs[key] += $4; cn[key]++ }
    END { for (k in cs) if (k in bs) printf "%s %.4f\n", k, (cs[k] / cn[k]) / (bs[k] / bn[k]) }' \
    "$logs/table.txt" 2> /dev/null | sort)
  line="$name (loop / baseline's: $(awk '{ printf "%s%s %s %s", sep, $1, $2, $3; sep = ", " }' <<< "$ratios")):"
  if awk -v g="$gain" 'NF { n++; if ($3 >= g) slower = 1 } END { exit !(n && !slower) }' <<< "$ratios"; then
    install_build "$name" > /dev/null
    echo "==== $name: checks (every loop ratio below $gain)"
    line+=$(checks "$name")
  else
    line+=" no checks (a loop ratio not below $gain)"
  fi
  summary+=("$line")
done

rm -rf jax_flash_mla && cp -r "$pristine" jax_flash_mla
echo
echo "==== summary"
printf '%s\n' "${summary[@]}"
for f in "$logs"/racecheck_*.log; do
  [[ -f $f ]] && grep -q -E "(Error|Warning): Race" "$f" || continue
  echo "==== $(basename "$f"): first hazards"
  # Device functions are printed with their whole template signature: keep the offset and the source line.
  grep -E -A1 "(Error|Warning): Race" "$f" | sed -E 's/at void .*\+(0x[0-9a-f]+) in /at +\1 in /' | cut -c1-240 | head -20
done
if [[ -n ${OUT:-} ]]; then
  n=1
  while [[ -e $OUT/compare_logs_$n.tar.gz ]]; do n=$((n + 1)); done
  tar czf "$OUT/compare_logs_$n.tar.gz" --exclude=package_pristine -C "$logs" .
fi
if [[ -f $logs/table.txt ]]; then  # none when every bench was skipped
  echo
  sort -k2,2 -k3,3 -s "$logs/table.txt"
fi
