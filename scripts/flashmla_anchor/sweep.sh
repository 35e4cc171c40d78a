#!/usr/bin/env bash
# Serving shapes against FlashMLA: harness builds (build.sh, each copied to .carry_fmla_<name>) run the shapes below,
# or those of $SHAPES, each process timing FlashMLA's bf16 decode and ours interleaved (main.cu), twice per shape.
# On the GPU machine, with the builds' folders carried:
#   bash scripts/flashmla_anchor/sweep.sh base [new]
# Prints two tables, per call (one call after a write that evicts L2, as triton's do_bench times: the anchors'
# method, and at small shapes the regime of serving, where each layer's cache comes from DRAM) and loop (50 calls
# back to back: at small shapes the cache stays in L2 between calls), each with FlashMLA's and each build's figure
# in both repeats, the split-KV kernel alone (second repeat) and the ratio to FlashMLA in the same process. Each
# build's log goes to $OUT (default /tmp) as sweep_<name>.log.
# The shapes (h_kv 1): small batches with long sequences (the latency end of serving), the head counts of tensor-
# parallel shards (16 / 32 / 64 / 128 heads), speculative decoding's s_q 2, varlen batches, short sequences.
set -uo pipefail
(($# >= 1)) || { echo "usage: $0 build [build2]" >&2; exit 2; }
shapes=${SHAPES:-M1,C1,C2,b1s8192h128q1,b1s32768h128q1,b1s65536h16q1,b2s16384h64q1,b4s16384h128q1,b8s8192h16q1,\
b8s4096h128q2c,b16s2048h128q1,b64s4096h16q1,b64s4096h32q1,b64s4096h64q1,b64s4096h128q1,b64s4096h16q2c,\
b64s4096h32q2c,b64s4096h64q2c,b32s8192h128q2c,b128s4096h128q1v,b64s8192h16q1v,b32s4096h128q2cv,b128s1024h128q1,\
b32s512h16q1,b256s2048h16q1}
out=${OUT:-/tmp}
logs=()
for name in "$@"; do
  timeout 200 ".carry_fmla_$name/flashmla_anchor" "$shapes" 2 > "$out/sweep_$name.log" 2>&1
  echo "$name rc=$?"
  grep -E "MISMATCH|FAIL|unknown" "$out/sweep_$name.log"
  logs+=("$out/sweep_$name.log")
done
python3 - "${logs[@]}" <<'PYEOF'
import re, sys
def read(path):
    rows = {}  # shape -> side -> [(per call, loop, split-KV alone loop, split-KV alone per call) per repeat]
    for line in open(path):
        m = re.match(r"(\S+)\s+(FlashMLA|ours)\s+per call median\s+([0-9.]+).*loop median\s+([0-9.]+).*"
                     r"alone, loop median\s+([0-9.]+)(?: us, per call median\s+([0-9.]+))?", line)
        if m:
            alone_call = float(m[6]) if m[6] else float("nan")
            rows.setdefault(m[1], {}).setdefault(m[2], []).append((float(m[3]), float(m[4]), float(m[5]), alone_call))
    return rows
runs = [read(p) for p in sys.argv[1:]]
names = [p.rsplit("sweep_", 1)[1][:-4] for p in sys.argv[1:]]
# Two tables: per call (after a write that evicts L2: the cache comes from DRAM, as in serving) and loop (50 calls
# back to back: at small shapes the cache stays in L2). Each: µs per call in repeats 1 / 2, the split-KV kernel
# alone in repeat 2, and the ratio of the whole decode to FlashMLA's in the same process, repeat 2.
for title, k, ka in (("per call", 0, 3), ("loop", 1, 2)):
    print(f"{'shape':17s} | {title} µs r1/r2: FlashMLA " + " ".join(f"{n:>13s}" for n in names)
          + " | split-KV alone r2: FlashMLA " + " ".join(f"{n:>7s}" for n in names) + " | / FlashMLA r2")
    for shape in runs[0]:
        if not all(shape in r for r in runs):
            continue
        flash = runs[-1][shape]["FlashMLA"]
        figs = " ".join(f"{r[shape]['ours'][0][k]:6.1f}/{r[shape]['ours'][-1][k]:<6.1f}" for r in runs)
        alone = " ".join(f"{r[shape]['ours'][-1][ka]:7.1f}" for r in runs)
        ratios = " ".join(f"{r[shape]['ours'][-1][k] / r[shape]['FlashMLA'][-1][k]:6.3f}" for r in runs)
        print(f"{shape:17s} | {flash[0][k]:13.1f}/{flash[-1][k]:<7.1f} {figs} | {flash[-1][ka]:17.1f} {alone} "
              f"| {ratios}")
    print()
PYEOF
