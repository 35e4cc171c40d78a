#!/usr/bin/env bash
# Builds the FlashMLA-against-ours timing harness (main.cu) into .carry_fmla/flashmla_anchor, here on the CPU
# machine; carry .carry_fmla to the GPU machine. FlashMLA is not part of this repository: pass a checkout of
# github.com/deepseek-ai/FlashMLA (its csrc/ is what is read).
#   bash scripts/flashmla_anchor/build.sh /path/to/FlashMLA [cutlass source dir]
# The CUTLASS headers default to the nvidia-cutlass wheel's (pip install nvidia-cutlass==4.2.0.0 --no-deps), as for
# our own build. FlashMLA's units get its setup.py's flags for its sm90 code (without fp16:
# FLASH_MLA_DISABLE_FP16); ours get CMakeLists.txt's Release flags (-O3 -DNDEBUG: asserts are calls, which
# serialize the WGMMAs), so our bf16 kernel's SASS is the package's. Each side is compiled with its own include
# path (both projects have a params.h). About 2 minutes on two cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
src=${1:?a FlashMLA checkout}
# Located without importing cutlass_library (its import needs packages a header-only use does not), as CMake does.
cutlass=${2:-$(python3 -c 'import importlib.util as u, os
print(os.path.join(list(u.find_spec("cutlass_library").submodule_search_locations)[0], "source"))')}
out=.carry_fmla
obj=$out/obj
rm -rf "$out" && mkdir -p "$obj"
here=scripts/flashmla_anchor
arch=(-gencode arch=compute_90a,code=sm_90a)
cutlass_inc=(-I"$cutlass/include" -I"$cutlass/tools/util/include")
fmla=(-O3 -std=c++20 -DNDEBUG -D_USE_MATH_DEFINES -DFLASH_MLA_DISABLE_FP16 -Wno-deprecated-declarations
  -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ -U__CUDA_NO_HALF2_OPERATORS__
  -U__CUDA_NO_BFLOAT16_CONVERSIONS__ --expt-relaxed-constexpr --expt-extended-lambda --use_fast_math "${arch[@]}"
  -I"$src/csrc" -I"$src/csrc/kerutils/include" -I"$src/csrc/sm90" "${cutlass_inc[@]}" -I"$here")
ours=(-O3 -DNDEBUG -std=c++17 --expt-relaxed-constexpr -lineinfo "${arch[@]}" -Icpp "${cutlass_inc[@]}" -I"$here")
pids=()
compile() {  # compile <flags array name> <source> <object name>
  local -n flags=$1
  nvcc "${flags[@]}" -c "$2" -o "$obj/$3.o" & pids+=($!)
}
compile fmla "$src/csrc/sm90/decode/dense/instantiations/bf16.cu" fmla_splitkv
compile fmla "$src/csrc/smxx/decode/combine/combine.cu" fmla_combine
compile fmla "$src/csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu" fmla_sched
compile fmla "$here/flashmla_side.cu" flashmla_side
compile ours cpp/kernels/sm90/decode/instantiations/bf16.cu our_splitkv
compile ours cpp/kernels/smxx/combine.cu our_combine
compile ours cpp/kernels/smxx/sched_meta.cu our_sched
compile ours "$here/our_side.cu" our_side
compile ours "$here/main.cu" main
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
((status == 0)) || { echo "build failed" >&2; exit 1; }
nvcc "${arch[@]}" "$obj"/*.o -o "$out/flashmla_anchor"
rm -rf "$obj"
fmla_rev=$(git -C "$src" rev-parse --short HEAD 2> /dev/null || echo "(not a git checkout)")
echo "built $out/flashmla_anchor: FlashMLA $fmla_rev, ours $(git rev-parse --short HEAD)"
