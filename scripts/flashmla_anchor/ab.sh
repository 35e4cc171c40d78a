#!/usr/bin/env bash
# Harness builds of our bf16 kernel judged by their ratio to FlashMLA's, which runs interleaved with ours in each
# process, so the card's state cancels (session 37). Build each candidate here first (build.sh in a git worktree at
# its commit, its .carry_fmla copied to .carry_fmla_<name>), carry those folders, then on the GPU machine:
#   bash scripts/flashmla_anchor/ab.sh [rounds, default 3] [shapes, default C1,C2] main cand1 cand2 ...
# Runs the builds one after another, `rounds` times, each process timing every shape twice. Prints each run's lines
# as they come, then per build and shape the per-call ratios ours / FlashMLA (median of 100 calls after an L2 flush,
# do_bench's way) in run order, and their median. A run's second repeat of a shape comes right after its first
# and runs slower for both decodes (the card's state), so the table keeps them apart: "r1" and "r2".
set -uo pipefail
rounds=${1:-3}
shapes=${2:-C1,C2}
shift 2 || { echo "usage: $0 rounds shapes build..." >&2; exit 2; }
(($# > 0)) || { echo "usage: $0 rounds shapes build..." >&2; exit 2; }
log=$(mktemp)
for ((i = 1; i <= rounds; ++i)); do
  for name in "$@"; do
    echo "== $name round $i" | tee -a "$log"
    timeout 90 ".carry_fmla_$name/flashmla_anchor" "$shapes" 2 2>&1 | grep --line-buffered -E '^C[0-9] |^M[0-9] |FAIL' |
      tee -a "$log"
  done
done
python3 - "$log" <<'PYEOF'
import re, statistics, sys
ratios = {}  # (build, shape, repeat) -> [ratio per round]
build, seen, flash = None, {}, {}
for line in open(sys.argv[1]):
    m = re.match(r"== (\S+) round", line)
    if m:
        build, seen, flash = m.group(1), {}, {}
        continue
    m = re.match(r"(\S+)\s+(FlashMLA|ours)\s+per call median\s+([0-9.]+)", line)
    if not m:
        continue
    shape, side, median = m.group(1), m.group(2), float(m.group(3))
    if side == "FlashMLA":
        flash[shape] = median
        continue
    seen[shape] = seen.get(shape, 0) + 1
    ratios.setdefault((build, shape, seen[shape]), []).append(median / flash[shape])
print(f'{"build":<12}{"shape":<7}{"repeat":<8}{"ours / FlashMLA per call, by round":<42}{"median":>8}')
for (build, shape, rep), rs in ratios.items():
    print(f'{build:<12}{shape:<7}{"r" + str(rep):<8}{" ".join(f"{r:.3f}" for r in rs):<42}{statistics.median(rs):>8.3f}')
PYEOF
rm -f "$log"
