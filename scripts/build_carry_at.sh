#!/usr/bin/env bash
# Builds the extension of another commit (an experiment, a baseline) for an A/B on the GPU machine:
#   bash scripts/build_carry_at.sh NAME REV     ->  .carry_NAME/ here, from REV's cpp/ and CMakeLists.txt
# A detached git worktree at REV runs scripts/build_carry.sh (same environment variables; ccache makes repeats
# cheap); the worktree is removed afterwards. Then, on the GPU machine: carry=[".carry_NAME", ...] and
# BUILDS="... NAME" bash scripts/gpu_compare.sh (which runs this checkout's tests and bench on each module).
# WITH_PACKAGE=1 also keeps REV's Python package in .carry_NAME/package/jax_flash_mla: for an experiment whose module
# needs its own Python side (a new workspace dtype, say), gpu_compare.sh then runs that build with REV's package.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# == 2 ]] || { echo "usage: $0 NAME REV" >&2; exit 2; }
name=$1
rev=$(git rev-parse --verify "$2^{commit}")
tree=$(mktemp -d)/tree
trap 'git worktree remove --force "$tree" > /dev/null 2>&1 || true' EXIT
git worktree add --detach -q "$tree" "$rev"
# build_carry.sh builds in the worktree (its own CMake tree) and leaves the module in "$tree/.carry".
(cd "$tree" && bash scripts/build_carry.sh)
rm -rf ".carry_$name"
cp -r "$tree/.carry" ".carry_$name"
if [[ ${WITH_PACKAGE:-0} == 1 ]]; then
  mkdir -p ".carry_$name/package"
  cp -r "$tree/jax_flash_mla" ".carry_$name/package/"
  find ".carry_$name/package" \( -name '*.so' -o -name __pycache__ \) -prune -exec rm -rf {} +
fi
echo "build_carry_at: .carry_$name from $(git rev-parse --short "$rev")"
