"""scripts/sass_loops.py (static instruction mix of the kernels' loops) on a hand-written SASS listing: which
backward branches count as loops, how nesting shows, and how opcodes are classed."""

import importlib.util
import pathlib

_spec = importlib.util.spec_from_file_location(
    "sass_loops", pathlib.Path(__file__).resolve().parents[1] / "scripts" / "sass_loops.py")
sass_loops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_loops)

# An outer loop 0x0010-0x00a0 around an inner one 0x0030-0x0070; a spin-wait at 0x0080; an out-of-line retry block
# at the end that jumps back unconditionally (not a loop).
LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                  /* 0x00000a0000017a02 */
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;  /* 0x0000000000000000 */
        /*0020*/                   FFMA R2, R3, R4, R2 ;                   /* 0x0000000000000000 */
        /*0030*/                   LDSM.16.MT88.4 R12, [R8] ;              /* 0x0000000000000000 */
        /*0040*/                   PRMT R20, R12, R18, R13 ;               /* 0x0000000000000000 */
        /*0050*/                   STSM.16.M88.4 [R188], R20 ;             /* 0x0000000000000000 */
        /*0060*/                   UIADD3 UR4, UR4, 0x1, URZ ;             /* 0x0000000000000000 */
        /*0070*/               @P0 BRA 0x30 ;                              /* 0x0000000000000000 */
        /*0080*/               @P1 BRA.U.ANY 0x80 ;                        /* 0x0000000000000000 */
        /*0090*/                   F2FP.E4M3.F32.PACK_AB R5, R6, R7 ;      /* 0x0000000000000000 */
        /*00a0*/              @!P2 BRA 0x10 ;                              /* 0x0000000000000000 */
        /*00b0*/                   EXIT ;                                  /* 0x0000000000000000 */
        /*00c0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR17+0x10], R152 ; /* 0x0000000000000000 */
        /*00d0*/              @!P0 BRA 0xc0 ;                              /* 0x0000000000000000 */
        /*00e0*/                   BRA 0x20 ;                              /* 0x0000000000000000 */
"""


def test_loops_are_predicated_backward_branches():
    instructions = sass_loops.parse(LISTING)
    assert len(instructions) == 15
    assert sass_loops.loops(instructions) == [(0x10, 0xA0), (0x30, 0x70), (0xC0, 0xD0)]
    assert sass_loops.loops(instructions, min_size=5) == [(0x10, 0xA0), (0x30, 0x70)]


def test_mix_classes_the_opcodes():
    counts = sass_loops.mix(sass_loops.parse(LISTING), 0x10, 0xA0)
    assert counts == {"tensor": 1, "fp32": 1, "smem": 2, "integer": 1, "uniform": 1, "branch": 3, "convert": 1}
    assert sass_loops.opcode_class("QGMMA") == "tensor" and sass_loops.opcode_class("R2UR") == "uniform"
    assert sass_loops.opcode_class("XYZZY") == "other"


def test_report_indents_nested_loops(tmp_path, capsys):
    path = tmp_path / "k.sass"
    path.write_text(LISTING)
    assert sass_loops.main(["--sass", str(path), "--min-size", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["kernel", "loop", "instr", "min"]
    assert lines[1].split()[1:4] == ["0x00010-0x000a0", "10", "10"]  # no forward branch: every pass issues all
    assert "  0x00030-0x00070" in lines[2] and lines[2].split()[1:4] == ["0x00030-0x00070", "5", "5"]
    assert len(lines) == 3


# A loop 0x10-0xa0 with a skippable block (0x30-0x50, as the lazy rescale) and an if / else (then 0x70-0x80 with
# its jump over the else, else 0x90); a wait retry out of line (0xb0) that returns.
BRANCHES = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   FADD R2, R3, R4 ;
        /*0020*/               @P0 BRA 0x60 ;
        /*0030*/                   FMUL R5, R5, R6 ;
        /*0040*/                   FMUL R7, R7, R6 ;
        /*0050*/               @P3 BRA 0xb0 ;
        /*0060*/               @P1 BRA 0x90 ;
        /*0070*/                   FADD R2, R2, R4 ;
        /*0080*/                   BRA 0xa0 ;
        /*0090*/                   FMUL R2, R2, R4 ;
        /*00a0*/              @!P2 BRA 0x10 ;
        /*00b0*/                   BRA 0x60 ;
"""


def test_shortest_pass_takes_the_skipping_branches():
    instructions = sass_loops.parse(BRANCHES)
    assert sass_loops.loops(instructions) == [(0x10, 0xA0)]
    assert sum(sass_loops.mix(instructions, 0x10, 0xA0).values()) == 10
    # 0x10, 0x20 -> 0x60 -> 0x90, 0xa0: the skipped block and the shorter arm.
    assert sass_loops.shortest_pass(instructions, 0x10, 0xA0) == 5


# Issue waits: four m64n256 P V k-steps (the queue holds two) and then the exponentials before a barrier, as main's
# bf16 WG1 had until session 41; after a wait_group 0, two k-steps (within the depth) followed by the same work.
def _issue_listing(first_run: int) -> str:
    lines, address = [], 0

    def emit(text):
        nonlocal address
        lines.append(f"        /*{address:04x}*/                   {text} ;")
        address += 0x10

    emit("WARPGROUP.ARRIVE")
    for _ in range(first_run):
        emit("HGMMA.64x256x16.F32.BF16 R24, gdesc[UR20].tnspB, R24")
        emit("UIADD3 UR20, UR34, 0x2, URZ")
    emit("@P0 BRA 0x400")  # a predicated branch: the scan follows its fall-through
    for _ in range(10):
        emit("MUFU.EX2 R4, R4")
    emit("BAR.SYNC.DEFER_BLOCKING 0x5, 0x100")
    emit("WARPGROUP.DEPBAR.LE gsb0, 0x0")
    for _ in range(2):
        emit("HGMMA.64x256x16.F32.BF16 R24, gdesc[UR20].tnspB, R24")
    for _ in range(10):
        emit("FMUL R4, R4, R5")
    emit("BAR.SYNC.DEFER_BLOCKING 0x6, 0x100")
    return "\n".join(lines)


def test_issue_waits_flag_work_behind_an_issue_past_the_queue():
    found = sass_loops.issue_waits(sass_loops.parse(_issue_listing(4)))
    assert len(found) == 1
    first, last, count, shape, past, end, stop, work = found[0]
    assert (first, count, shape, past) == (0x10, 4, "HGMMA.64x256x16.F32.BF16", 2)
    assert work == {"MUFU": 10} and stop.startswith("BAR.SYNC")
    # Two k-steps fit the queue: nothing to report, before or after the wait_group 0.
    assert sass_loops.issue_waits(sass_loops.parse(_issue_listing(2))) == []
    # Work below the threshold is not reported.
    assert sass_loops.issue_waits(sass_loops.parse(_issue_listing(4)), min_work=11) == []


def test_issue_waits_report(tmp_path, capsys):
    path = tmp_path / "k.sass"
    path.write_text(_issue_listing(4))
    assert sass_loops.main(["--sass", str(path), "--issue-waits"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "4 x HGMMA.64x256x16" in lines[0] and "2 past the queue" in lines[0]


# An early S at a loop's end (18 k-steps of m64n64k32, the queue holds five) and the next pass's transpose at the
# loop's top, before its wait_group 0: the work is found across the back edge.
EARLY_S = "\n".join(
    [f"        /*{0x10 * i:04x}*/                   LDSM.16.MT88.4 R8, [R9] ;" for i in range(1, 9)]
    + ["        /*0090*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;",
       "        /*00a0*/                   WARPGROUP.ARRIVE ;"]
    + [f"        /*{0xb0 + 0x10 * i:04x}*/                   QGMMA.64x64x32.F32.E4M3.E4M3 R152, gdesc[UR20], R152 ;"
       for i in range(18)]
    + ["        /*01d0*/               @P0 BRA 0x10 ;",
       "        /*01e0*/                   EXIT ;"])


def test_issue_waits_follow_the_loop_around_the_run():
    found = sass_loops.issue_waits(sass_loops.parse(EARLY_S))
    assert len(found) == 1
    first, last, count, shape, past, end, stop, work = found[0]
    assert (first, last, count, past) == (0xB0, 0x1C0, 18, 13) and shape.startswith("QGMMA.64x64x32")
    assert work == {"LDSM": 8} and end == 0x90 and stop.startswith("WARPGROUP.DEPBAR")
