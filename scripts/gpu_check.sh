#!/usr/bin/env bash
# The one script the team runs on the GPU machine: repo root as cwd, $OUT a folder whose files come back.
#   1. machine: nvidia-smi, Python and JAX versions
#   2. the extension: the module carried in .carry/ (scripts/build_carry.sh, carry=[".carry"]) if there, else one
#      already in jax_flash_mla/, else a build here (cmake; needs nanobind and CUTLASS headers, e.g. from .whl/)
#   3. pytest with the GPU tests required (JAX_FLASH_MLA_REQUIRE_GPU=1: a skip becomes a failure), over
#      PYTEST_WORKERS processes (pytest-xdist, when installed) that share the GPU: the tests' time goes mostly into
#      drawing and quantizing inputs on the CPU; -rP shows what the accuracy tests print
#   4. python -m jax_flash_mla.bench; compute-sanitizer memcheck, racecheck and synccheck (the last two on our
#      kernels only) on tests/gpu_sanitize.py; python -m jax_flash_mla.accuracy; scripts/gpu_serving_check.py
#      (if present)
#   5. a summary table, printed last ($OUT brings back at most 8 files: keep the logs few)
# The machine has no network: nothing is downloaded. Wheels carried in .whl/ are installed with --no-index.
# Exit status: non-zero when any step failed.
#
# Environment (optional): PYTHON (default python3); PYTEST_ARGS (default: the GPU tests and the API tests; CI runs
# the CPU suite); PYTEST_WORKERS (default from the card's memory, scripts/gpu_test_share.py; 1 runs pytest in this
# process); BENCH_ARGS (extra arguments of jax_flash_mla.bench); SERVING_ARGS (of scripts/gpu_serving_check.py);
# CARRY_DIR (default .carry); SKIP_TESTS, SKIP_SANITIZE, SKIP_ACCURACY, SKIP_SERVING, SKIP_BENCH =1 to leave a step
# out (one command may run 10 minutes at most: in one process the three formats' tests took ~10 min on the H200,
# the bench ~1 min without the reference, ~3 min with it; split them over calls on the warm machine).
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."

OUT=${OUT:-/tmp/jax_flash_mla_gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
t0=$SECONDS
declare -A status=()
declare -a order=()
record() { order+=("$1"); status[$1]=$2; }
section() { echo; echo "==== $* ===="; }

# --- 1. machine ---------------------------------------------------------------------------------------------------
section machine
if command -v nvidia-smi > /dev/null; then
  nvidia-smi 2>&1
  gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
else
  echo "nvidia-smi not found"
  gpu="none (no nvidia-smi)"
fi
"$PY" -c "import sys, platform; print('python', sys.version.split()[0], platform.platform())"
pyver=$("$PY" -c "import sys; print(sys.version.split()[0])")

if compgen -G ".whl/*.whl" > /dev/null; then
  section "carried wheels (.whl/)"
  ls .whl/*.whl
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
jaxver=$("$PY" -c "import jax, jaxlib; print(f'jax {jax.__version__} / jaxlib {jaxlib.__version__}')" 2>&1 | tail -1)
echo "$jaxver"
"$PY" -c "import jax; print('devices:', jax.devices())" 2>&1 | tail -1

# --- 2. the extension ---------------------------------------------------------------------------------------------
section extension
ext_src=none
shopt -s nullglob
carry_dir=${CARRY_DIR:-.carry}
carried=("$carry_dir"/jax_flash_mla/_jax_flash_mla*.so)
present=(jax_flash_mla/_jax_flash_mla*.so)
if ((${#carried[@]})); then
  rm -f jax_flash_mla/_jax_flash_mla*.so
  cp "${carried[@]}" jax_flash_mla/
  ext_src="carried ($carry_dir)"
  [[ -f $carry_dir/BUILD_INFO.txt ]] && cat "$carry_dir/BUILD_INFO.txt"
elif ((${#present[@]})); then
  ext_src="already in jax_flash_mla/"
elif command -v cmake > /dev/null; then
  echo "no carried module: building with cmake (log: $OUT/build.log)"
  gen=()
  command -v ninja > /dev/null && gen=(-G Ninja)
  if cmake -S . -B build/gpu "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DJAX_FLASH_MLA_CUDA=ON \
        -DPython_EXECUTABLE="$("$PY" -c 'import sys; print(sys.executable)')" > "$OUT/build.log" 2>&1 &&
     cmake --build build/gpu -j "$(nproc)" >> "$OUT/build.log" 2>&1; then
    cp build/gpu/_jax_flash_mla*.so jax_flash_mla/
    ext_src="built here (cmake)"
  else
    tail -30 "$OUT/build.log"
    ext_src="cmake build FAILED"
  fi
else
  echo "no carried module and no cmake: trying pip (log: $OUT/build.log)"
  rm -rf /tmp/jfm_pip_build
  if "$PY" -m pip install --no-build-isolation --no-deps --no-index --target /tmp/jfm_pip_build . \
        > "$OUT/build.log" 2>&1; then
    cp /tmp/jfm_pip_build/jax_flash_mla/_jax_flash_mla*.so jax_flash_mla/
    ext_src="built here (pip)"
  else
    tail -30 "$OUT/build.log"
    ext_src="pip build FAILED"
  fi
fi
shopt -u nullglob
echo "extension: $ext_src"
ext_info=$("$PY" -c "
import jax_flash_mla._ffi as f
print('available' if f.extension_available() else 'NOT available (%s)' % f.unavailable_reason(),
      '| formats:', ','.join(sorted(f.kernel_formats())) or '-', '| build:', f.build_info())" 2>&1 | tail -1)
echo "$ext_info"
if [[ $ext_info == available* ]]; then record extension ok; else record extension FAIL; fi

# --- 3. tests -----------------------------------------------------------------------------------------------------
if [[ ${SKIP_TESTS:-0} == 1 ]]; then
  record pytest "skipped (SKIP_TESTS=1)"
else
  read -r -a pytest_args <<< "${PYTEST_ARGS:--q -rP --durations=8 tests/test_decode_gpu.py tests/test_sched_meta.py tests/test_api.py}"
  # Each worker is a JAX process: a share of the GPU's memory each instead of the default 75 % for the first.
  read -r workers mem_fraction < <("$PY" scripts/gpu_test_share.py)
  worker_env=()
  if ((workers > 1)) && "$PY" -c "import xdist" 2> /dev/null; then
    pytest_args=(-n "$workers" "${pytest_args[@]}")
    worker_env=(XLA_PYTHON_CLIENT_MEM_FRACTION="$mem_fraction")
  fi
  section "pytest ${pytest_args[*]}"
  t=$SECONDS
  env "${worker_env[@]}" JAX_FLASH_MLA_REQUIRE_GPU=1 "$PY" -m pytest "${pytest_args[@]}" 2>&1 |
    tee "$OUT/pytest.log"
  rc=$?
  tests_line=$(grep -E "^(=+ )?[0-9]+ (passed|failed|error)|no tests ran" "$OUT/pytest.log" | tail -1 | tr -d '=' |
               xargs)
  record pytest "$([[ $rc == 0 ]] && echo ok || echo "FAIL rc=$rc") | ${tests_line:-no summary line} | $((SECONDS - t)) s"
fi

# --- 4. benchmark, compute-sanitizer, accuracy, serving ----------------------------------------------------------
# (racecheck over the whole program instruments every XLA kernel and does not finish: it is filtered to ours.)
run_step() {  # name, log file, seconds, command...
  local name=$1 log=$2 limit=$3; shift 3
  section "$name: $*"
  local t=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$log"
  local rc=$?
  local tail_line
  tail_line=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|ok=" "$OUT/$log" | tail -1 | xargs)
  record "$name" "$([[ $rc == 0 ]] && echo ok || echo "FAIL rc=$rc") | ${tail_line:-log: $log} | $((SECONDS - t)) s"
}
if [[ ${SKIP_BENCH:-0} != 1 ]]; then
  read -r -a bench_args <<< "${BENCH_ARGS:-}"
  # --trace: the decode kernels' device span per call next to the loop figure (docs/PERF.md "Current figures").
  run_step bench bench.log 420 "$PY" -m jax_flash_mla.bench --csv "$OUT/bench.csv" --png "$OUT/bench.png" \
    --trace /tmp/jax_flash_mla_trace "${bench_args[@]}"
fi
if [[ ${SKIP_SANITIZE:-0} != 1 ]] && command -v compute-sanitizer > /dev/null; then
  # One process per format: with several kernels in one process compute-sanitizer segfaulted (rc 139, session 5)
  # where each format alone ran clean.
  for f in $("$PY" -c "import jax_flash_mla as fm; print(' '.join(sorted(fm.kernel_formats())))"); do
    SANITIZE_FORMATS=$f run_step "memcheck $f" sanitize.log 150 compute-sanitizer --tool memcheck --error-exitcode 1 \
      "$PY" tests/gpu_sanitize.py
    SANITIZE_FORMATS=$f run_step "racecheck $f" sanitize.log 150 compute-sanitizer --tool racecheck --error-exitcode 1 \
      --kernel-name kns=splitkv_mla "$PY" tests/gpu_sanitize.py
    # Barriers used against their PTX contract (session 22: an aligned bar.sync that the two warpgroups pass at
    # different instructions).
    SANITIZE_FORMATS=$f run_step "synccheck $f" sanitize.log 150 compute-sanitizer --tool synccheck --error-exitcode 1 \
      --kernel-name kns=splitkv_mla "$PY" tests/gpu_sanitize.py
  done
fi
[[ ${SKIP_ACCURACY:-0} != 1 ]] &&
  run_step accuracy accuracy.log 240 "$PY" -m jax_flash_mla.accuracy --csv "$OUT/accuracy.csv" --png /tmp/accuracy.png
[[ ${SKIP_SERVING:-0} != 1 && -f scripts/gpu_serving_check.py ]] &&
  run_step serving serving.log 300 "$PY" scripts/gpu_serving_check.py ${SERVING_ARGS:-}

# --- 5. summary ---------------------------------------------------------------------------------------------------
failed=0
for k in "${order[@]}"; do [[ ${status[$k]} == FAIL* ]] && failed=1; done
{
  echo
  echo "==== summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), $((SECONDS - t0)) s) ===="
  printf '%-10s | %s\n' gpu "$gpu" python "$pyver" jax "$jaxver" module "$ext_src" ext "$ext_info"
  for k in "${order[@]}"; do
    printf '%-10s | %s\n' "$k" "${status[$k]}"
  done
  echo "files in \$OUT: $(cd "$OUT" && ls | xargs)"
}
exit $failed
