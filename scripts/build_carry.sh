#!/usr/bin/env bash
# Builds the extension here (no GPU needed) for the GPU machine's Python 3.12 + jaxlib 0.11.2, and leaves it in
# .carry/jax_flash_mla/ (git-ignored). The GPU run carries it with carry=[".carry"]; scripts/gpu_check.sh copies it
# into the package. Incremental: the CMake tree stays in build/carry-<tag>, and ccache is used when installed.
#
# Environment (all optional):
#   CARRY_PYTHON              Python whose jax / nanobind to build against (default /work/venv312/bin/python)
#   CUTLASS_DIR               CUTLASS root; default: the nvidia-cutlass wheel in CARRY_PYTHON's site-packages
#                             (installed there with --no-deps when missing)
#   JAX_FLASH_MLA_DISABLE_FP8 ON to leave the FP8 formats out (default OFF)
#   PTXAS_VERBOSE             ON for ptxas register / smem / spill reports (default OFF)
#   HANG_TRAP                 ON for a debugging build whose mbarrier waits trap after 10 s (default OFF)
#   EVENT_TRACE               ON for a debugging build that stamps pipeline events (scripts/trace_pipeline.py)
#   JOBS                      parallel compile jobs (default: number of cores)
set -euo pipefail
cd "$(dirname "$0")/.."

py=${CARRY_PYTHON:-/work/venv312/bin/python}
disable_fp8=${JAX_FLASH_MLA_DISABLE_FP8:-OFF}
ptxas_verbose=${PTXAS_VERBOSE:-OFF}
hang_trap=${HANG_TRAP:-OFF}
event_trace=${EVENT_TRACE:-OFF}
jobs=${JOBS:-$(nproc)}
start=$SECONDS

"$py" -c "import jax, jaxlib, nanobind" || { echo "build_carry: $py lacks jax / jaxlib / nanobind" >&2; exit 1; }
tag=$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
build=build/carry-$tag

if [[ -z "${CUTLASS_DIR:-}" ]]; then
  if ! "$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('cutlass_library') is None)"; then
    echo "build_carry: installing nvidia-cutlass==4.2.0.0 (headers only, --no-deps) into $py" >&2
    "$py" -m pip install -q --no-deps nvidia-cutlass==4.2.0.0
  fi
fi

generator=()
command -v ninja > /dev/null && generator=(-G Ninja)
cmake -S . -B "$build" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$("$py" -c 'import sys; print(sys.executable)')" \
  -DJAX_FLASH_MLA_CUDA=ON \
  -DJAX_FLASH_MLA_DISABLE_FP8="$disable_fp8" \
  -DJAX_FLASH_MLA_PTXAS_VERBOSE="$ptxas_verbose" \
  -DJAX_FLASH_MLA_HANG_TRAP="$hang_trap" \
  -DJAX_FLASH_MLA_EVENT_TRACE="$event_trace" \
  ${CUTLASS_DIR:+-DCUTLASS_DIR="$CUTLASS_DIR"}
cmake --build "$build" -j "$jobs"

so=$(ls "$build"/_jax_flash_mla*.so)
mkdir -p .carry/jax_flash_mla
rm -f .carry/jax_flash_mla/_jax_flash_mla*.so
cp "$so" .carry/jax_flash_mla/

# Import check with the target Python, CPU only: the package source plus the carried module in a scratch dir.
check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
cp -r jax_flash_mla "$check"/
rm -f "$check"/jax_flash_mla/_jax_flash_mla*.so
cp .carry/jax_flash_mla/_jax_flash_mla*.so "$check"/jax_flash_mla/
info=$(cd "$check" && JAX_PLATFORMS=cpu PYTHONPATH= "$py" -c "
import jax, jax_flash_mla._ffi as f
assert f.extension_available(), f.unavailable_reason()
print('jax', jax.__version__, '| build', f.build_info())")

{
  echo "built:  $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git rev-parse --short HEAD)$([[ -z "$(git status --porcelain -- cpp CMakeLists.txt)" ]] || echo ' + uncommitted changes')"
  echo "python: $("$py" -c 'import sys; print(sys.version.split()[0])')"
  echo "module: $(basename "$so") ($(du -h "$so" | cut -f1))"
  [[ $hang_trap == OFF ]] || echo "HANG_TRAP=$hang_trap: a debugging build (mbarrier waits trap after 10 s); no timing"
  [[ $event_trace == OFF ]] || echo "EVENT_TRACE=$event_trace: a debugging build (pipeline event stamps); no timing"
  echo "$info"
} > .carry/BUILD_INFO.txt
cat .carry/BUILD_INFO.txt
echo "build_carry: done in $((SECONDS - start)) s"
