"""Instruction mix of the loops of the decode kernels' SASS: a static count to compare builds without a GPU.

    python scripts/sass_loops.py .carry_main/jax_flash_mla/_jax_flash_mla*.so [--kernels 2ELb0] [--min-size 64]
    python scripts/sass_loops.py --sass listing.sass     # a saved `cuobjdump -sass` listing
    python scripts/sass_loops.py MODULE --issue-waits    # WGMMA issues that wait for queue room, and what follows

A loop is a predicated backward branch and the instructions it jumps over: spin-waits (`BRA.U.ANY`) and the
unconditional jumps back from out-of-line blocks (an mbarrier wait's retry path at the function's end) are left out.
Loops are listed by address, nested ones indented. The consumer's page loops are the large ones with tensor
instructions: their counts are what a warp issues per page (per page pair for bf16 / fp8_per_tensor) when every
branch inside runs, so a change that moves work out of the loop shows here before any timing. `instr` counts the
conditional paths inside too (the lazy O rescale); `min` is the fewest a pass through the loop can issue, taking
the forward branches that skip work (each inner loop once). For fp8_ds_mla's page loop that is the common pass
(no O rescale, no N_g growth, no masking) less the next page's S head, which a chunk's last page skips; the pair
loops' shortest pass is a chunk's last pair without a page B, far from their common one.
With --issue-waits it lists instead where a warp issues more WGMMAs than its queue holds and then has other work
before its next wait (DESIGN.md, "WGMMA issue waits on the chain"): issuing past the queue's depth holds the warp
until the queue has room, so work placed after the issue starts only once most of it has run. Each row is a run
of WGMMAs, how many of them were issued past the depth since the last `wait_group 0` (counted in address order,
from zero after every `wait_group 0`, unconditional jump and exit), and the instructions that follow on the
steady-state path (the back edge of a loop around the run taken, other branches not) up to the next wait,
barrier or tensor instruction. A reading aid that says where to look, not a model of the schedule.
cuobjdump comes from --cuobjdump, $CUOBJDUMP, or PATH (where the CUDA toolkit lacks it, the nvidia-cuda-cuobjdump
wheel has one); its -sass needs nvdisasm, looked up beside it first, then on PATH (the nvidia-cuda-nvdisasm wheel,
unpacked into the same folder).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys

# Kernel keys (format enum, few-rows flag) as in the mangled names; the five splitkv kernels of a full build.
KERNELS = {"0ELb0": "bf16", "1ELb0": "fp8_per_tensor", "1ELb1": "fp8_per_tensor few-rows",
           "2ELb0": "fp8_ds_mla", "2ELb1": "fp8_ds_mla few-rows", "3ELb0": "fp8_ds_mla design S"}
MANGLED = "_ZN13jax_flash_mla4sm9018splitkv_mla_kernelILNS_6config8KvFormatE{}EEEvNS0_11SplitKvArgsE"

# Opcode classes, first match wins.
CLASSES = (
    ("tensor", re.compile(r"^(HGMMA|QGMMA|IGMMA|HMMA)$")),
    ("sync", re.compile(r"^(BAR|SYNCS|WARPGROUP|MEMBAR|FENCE|DEPBAR|ERRBAR|WARPSYNC|ELECT)$")),
    ("smem", re.compile(r"^(LDS|STS|LDSM|STSM|ATOMS|REDS)$")),
    ("global", re.compile(r"^(LDG|STG|LD|ST|RED|ATOMG|UTMALDG|UTMASTG|UBLKCP|LDGSTS|LDGDEPBAR)$")),
    ("fp32", re.compile(r"^(FMUL|FFMA|FADD|FMNMX|FSEL|FSETP|FCHK|MUFU|FRND|FSWZADD)$")),
    ("convert", re.compile(r"^(F2FP|F2F|F2I|I2F|I2FP|F2IP)$")),
    ("shuffle", re.compile(r"^(SHFL|REDUX|VOTE|VOTEU|MATCH)$")),
    ("uniform", re.compile(r"^(U[A-Z0-9]+|R2UR|S2UR|S2R|CS2R|LDC)$")),
    ("branch", re.compile(r"^(BRA|BSSY|BSYNC|CALL|RET|EXIT|NOP|BMOV|YIELD)$")),
    ("integer", re.compile(r"^(IMAD|IADD3|VIADD|LOP3|SHF|LEA|ISETP|SEL|PRMT|MOV|IABS|VIMNMX|VIADDMNMX|PLOP3|P2R|R2P"
                           r"|IMNMX|POPC|FLO|BREV|BMSK|SGXT|IDP|IMUL|ISCADD)$")),
)
COLUMNS = [name for name, _ in CLASSES] + ["other"]
_LINE = re.compile(r"/\*([0-9a-f]{4,6})\*/\s+(@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)([^;]*);")
_TARGET = re.compile(r"(0x[0-9a-f]+)")


# WGMMAs a warp can have queued before issuing one more holds it, by the instruction's N
# (scripts/fence_wgmma_bench.cu, session 15: m64n64k32 ~5, m64n128k32 ~6, m64n256 two); other N count as 64.
QUEUE_DEPTH = {64: 5, 128: 6, 256: 2}
_WGMMA_SHAPE = re.compile(r"^\.(\d+)x(\d+)x(\d+)[.A-Z0-9]*")
# What ends the work that follows a run: a wait for WGMMAs or for other threads, the end.
_STOPS = ("WARPGROUP.DEPBAR", "BAR.SYNC", "BAR.ARV", "SYNCS.PHASECHK", "EXIT")


def opcode_class(opcode: str) -> str:
    for name, pattern in CLASSES:
        if pattern.match(opcode):
            return name
    return "other"


def parse(listing: str) -> list:
    """(address, predicate, opcode, modifiers, operands) of every instruction of one function's listing."""
    return [(int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3), m.group(4), m.group(5))
            for m in _LINE.finditer(listing)]


def branch_target(opcode: str, operands: str):
    """The address a branch jumps to, or None (not a branch, or a target given otherwise)."""
    target = _TARGET.search(operands) if opcode == "BRA" else None
    return int(target.group(1), 16) if target else None


def loops(instructions, min_size: int = 1) -> list:
    """(start, end) addresses of every predicated backward branch's span of at least min_size instructions
    (spin-waits excluded), in address order; the span includes the branch."""
    found = set()
    for address, predicate, opcode, modifiers, operands in instructions:
        if opcode != "BRA" or not predicate or ".U" in modifiers:
            continue
        start = branch_target(opcode, operands)
        if start is not None and start < address and (address - start) // 16 + 1 >= min_size:
            found.add((start, address))
    return sorted(found)


def shortest_pass(instructions, start: int, end: int) -> int:
    """Fewest instructions on a path from start to the loop's backward branch at end: fall-throughs and the
    forward branches that land inside the loop (an unconditional one has no fall-through; backward branches, the
    inner loops', fall through; branches that leave the loop, the out-of-line wait retries, return)."""
    body = [ins for ins in instructions if start <= ins[0] <= end]
    position = {ins[0]: i for i, ins in enumerate(body)}
    unreached = len(body) + 1
    fewest = [unreached] * len(body)
    fewest[0] = 1
    for i, (address, predicate, opcode, modifiers, operands) in enumerate(body):
        if fewest[i] == unreached:
            continue
        target = branch_target(opcode, operands)
        nexts = []
        if target is not None and address < target <= end:
            nexts.append(position[target])
        if not (not predicate and target is not None and target > address) and i + 1 < len(body):
            nexts.append(i + 1)
        for j in nexts:
            fewest[j] = min(fewest[j], fewest[i] + 1)
    return fewest[-1]


def mix(instructions, start: int, end: int) -> collections.Counter:
    return collections.Counter(opcode_class(op) for address, _, op, _, _ in instructions if start <= address <= end)


def depth(span, spans) -> int:
    """How many other spans of the list enclose this one."""
    return sum(1 for o in spans if o != span and o[0] <= span[0] and span[1] <= o[1])


def report(name: str, instructions, min_size: int) -> list:
    """Lines of the table for one kernel: its loops of at least min_size instructions, nested ones indented."""
    spans = loops(instructions, min_size)
    rows = []
    for span in spans:
        counts = mix(instructions, *span)
        where = "  " * depth(span, spans) + f"{span[0]:#07x}-{span[1]:#07x}"
        rows.append(f"{name:<26} {where:<21} {sum(counts.values()):>6} {shortest_pass(instructions, *span):>6} "
                    + " ".join(f"{counts[c]:>7}" for c in COLUMNS))
    return rows


def _waits(opcode: str, modifiers: str) -> bool:
    """A wait for WGMMAs or for other threads, or the end: what ends the work that follows a run."""
    return any((opcode + modifiers).startswith(stop) for stop in _STOPS)


def _is_work(opcode: str, modifiers: str) -> bool:
    """Neither a tensor instruction's addressing (uniform), a branch, nor the warpgroup.arrive of a run."""
    return opcode_class(opcode) not in ("uniform", "branch") and opcode + modifiers != "WARPGROUP.ARRIVE"


def _runs(instructions) -> list:
    """[first, last, count, shape, past] (instruction indices) of each run of WGMMAs in address order; past counts
    those issued when the queue's depth of WGMMAs had been issued since the last wait_group 0. A run goes on
    across uniform instructions, branches and warpgroup.arrive; anything else ends it."""
    runs, run, since_wait = [], None, 0
    for i, (address, predicate, opcode, modifiers, operands) in enumerate(instructions):
        if opcode_class(opcode) == "tensor":
            shape = _WGMMA_SHAPE.match(modifiers + operands)  # parse() ends the modifiers at the shape's "x"
            n = int(shape.group(2)) if shape else 64
            past = since_wait >= QUEUE_DEPTH.get(n, QUEUE_DEPTH[64])
            since_wait += 1
            if run is None:
                run = [i, i, 0, opcode + (shape.group(0) if shape else ""), 0]
                runs.append(run)
            run[1], run[2], run[4] = i, run[2] + 1, run[4] + past
            continue
        if _is_work(opcode, modifiers):
            run = None
        if (opcode == "WARPGROUP" and "DEPBAR" in modifiers and operands.strip().endswith("0x0")) \
                or opcode == "EXIT" or (opcode == "BRA" and not predicate):
            since_wait, run = 0, None
    return runs


def _work_after(instructions, position: dict, run_first: int, index: int):
    """(stop index or None, Counter of opcodes) of the instructions a warp runs from index up to the next wait or
    tensor instruction, on the steady-state path: the back edge of a loop around the run (a predicated backward
    branch to at most run_first) taken, so that the loop goes round; other predicated branches not (the blocks
    they skip, the out-of-line wait retries, a later loop's repeats); unconditional jumps followed. position maps
    an address to its instruction's index."""
    work, seen = collections.Counter(), set()
    i = index
    while i < len(instructions) and i not in seen:
        seen.add(i)
        address, predicate, opcode, modifiers, operands = instructions[i]
        if opcode_class(opcode) == "tensor" or _waits(opcode, modifiers):
            return i, work
        destination = position.get(branch_target(opcode, operands))
        if destination is not None and ".U" not in modifiers and (not predicate or destination <= run_first):
            i = destination
            continue
        if _is_work(opcode, modifiers):
            work[opcode] += 1
        i += 1
    return None, work


def issue_waits(instructions, min_work: int = 8) -> list:
    """(first, last, count, shape, past, work_end, stop, work) for each run of WGMMAs of which `past` were issued
    beyond the queue's depth since the last wait_group 0 (addresses for first, last and work_end), followed by at
    least min_work instructions (uniform ones and branches not counted) before the next wait or tensor
    instruction on the steady-state path; work is a Counter of those instructions' opcodes."""
    found = []
    position = {ins[0]: i for i, ins in enumerate(instructions)}
    for first, last, count, shape, past in _runs(instructions):
        if not past:
            continue
        stop, work = _work_after(instructions, position, first, last + 1)
        if sum(work.values()) >= min_work:
            end, label = ((instructions[stop][0], instructions[stop][2] + instructions[stop][3])
                          if stop is not None else (instructions[-1][0], "(no wait)"))
            found.append((instructions[first][0], instructions[last][0], count, shape, past, end, label, work))
    return found


def issue_wait_report(name: str, instructions) -> list:
    rows = []
    for first, last, count, shape, past, end, stop, work in issue_waits(instructions):
        top = ", ".join(f"{op} {n}" for op, n in work.most_common(5))
        rows.append(f"{name:<26} {first:#07x}-{last:#07x} {count:>2} x {shape:<22} {past:>2} past the queue; "
                    f"then {sum(work.values()):>4} to {end:#07x} {stop:<12} ({top})")
    return rows


def header() -> str:
    return f"{'kernel':<26} {'loop':<21} {'instr':>6} {'min':>6} " + " ".join(f"{c:>7}" for c in COLUMNS)


def dump(cuobjdump: str, module: str, key: str) -> str:
    # cuobjdump -sass runs nvdisasm from PATH: look beside cuobjdump first (the wheels' bin folders pair them).
    path = os.pathsep.join([os.path.dirname(os.path.abspath(cuobjdump)), os.environ.get("PATH", "")])
    env = dict(os.environ, PATH=path)
    run = subprocess.run([cuobjdump, "-sass", "-fun", MANGLED.format(key), module], capture_output=True, text=True,
                         env=env)
    if run.returncode != 0:
        raise SystemExit(f"sass_loops: {cuobjdump} failed on kernel {key}: {run.stderr.strip()[-400:]}")
    return run.stdout


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module", nargs="?", help="the extension module (.so) of a CUDA build")
    parser.add_argument("--sass", help="a saved cuobjdump -sass listing of one kernel, instead of a module")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"keys among {','.join(KERNELS)}")
    parser.add_argument("--min-size", type=int, default=64, help="smallest loop reported, in instructions")
    parser.add_argument("--issue-waits", action="store_true",
                        help="list WGMMA runs issued past the queue's depth with work behind them, not the loops")
    parser.add_argument("--cuobjdump", default=os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump"))
    args = parser.parse_args(argv)
    if (args.module is None) == (args.sass is None):
        parser.error("give exactly one of a module and --sass")

    def rows(name, instructions):
        return issue_wait_report(name, instructions) if args.issue_waits else report(name, instructions, args.min_size)

    if not args.issue_waits:
        print(header())
    if args.sass:
        with open(args.sass) as f:
            print("\n".join(rows(os.path.basename(args.sass), parse(f.read()))))
        return 0
    if not args.cuobjdump:
        parser.error("no cuobjdump: pass --cuobjdump or set $CUOBJDUMP")
    for key in args.kernels.split(","):
        if key not in KERNELS:
            parser.error(f"--kernels: {key!r} is not one of {','.join(KERNELS)}")
        instructions = parse(dump(args.cuobjdump, args.module, key))
        if not instructions:
            print(f"{KERNELS[key]:<26} (not in this module)")
            continue
        print("\n".join(rows(KERNELS[key], instructions)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
