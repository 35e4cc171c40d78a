"""Decode timing: `python -m jax_flash_mla.bench` times the Hopper kernel and the jnp reference side by side.

Shapes of shared README §3 (h_kv 1; batch 128 and s_k 8192 unless --batch / --seqlen say otherwise):
M1 = h_q 16, s_q 1; C1 = h_q 128, s_q 1; C2 = h_q 128, s_q 2, causal; VL = h_q 128, s_q 1, lengths uniform in
[1, 2 s_k]. Every format is timed on the kernel path (where `kernel_formats()` has it) and on the jnp reference
(`implementation="reference"`), on gaussian data quantized per format (fp8_per_tensor: amax / 448 descales).

Timing is device time without an event API: `iters` decode calls run inside one jitted `lax.fori_loop` (static trip
count) and the wall time after `block_until_ready` is divided by `iters`; compile and two warm-up runs are excluded;
the median and the min-max over `repeats` runs are reported. The metadata is computed once, outside the loop (once
per step for all layers, as in serving). Each iteration passes its inputs and a running checksum through
`lax.optimization_barrier` and also feeds the checksum into the block table (`depend`: a real data dependency that
costs one tiny fusion), so XLA cannot hoist the decode out of the loop; one element of out and of lse, picked at a
checksum-dependent index, joins the checksum, so nothing is dead and nothing can be computed partially. When one
set of q + cache is smaller than twice the GPU's L2, the loop rotates among several sets (disjoint pages of one
pool, each set with its own block table and q) so that no call finds its cache in L2. The loop's own cost (rotation
slices, table dependency, checksum) is timed per shape with an empty step and printed; it is included in the
numbers, not subtracted.

The ceilings are measured in the same run with the same loops: device copy bandwidth (a 2 GiB `x = x * s` as the
loop state, counting read + write); bf16 and fp8 (e4m3) GEMM rates (8192³, f32 accumulation; inputs through the
barrier only, as a `depend` on a 128 MB operand would cost a pass over it; fp8 only where XLA lowers it to fp8
math). A ceiling far above README §3's, or a time under its floor, is flagged: the loop did not do the work.
TFLOPS count 2·s_q·Σs_k·h_q·(576 + 512) (causal: the visible keys); bytes count Σs_k·h_kv·bytes_per_token + q +
out. The floor is max(bytes / copy bandwidth, FLOPs / GEMM rate of the format's precision).

`--trace` runs each kernel case's loop once more under `jax.profiler.trace` and reports, from the profiler's (CUPTI)
kernel records, the span of the decode's own kernels per call (splitkv_mla start to combine end: what a CUDA-event
timing of the decode alone, as FlashMLA's benchmark does, sees) and the device's busy time per call (the loop's glue
fusions included; combine starts early, by programmatic dependent launch, and its record includes its wait for
splitkv_mla, so the kernels' durations are not summed). The loop figure stays in the table: it is what this jitted
loop pays a call, measured without the profiler, which sees a shorter period per call (docs/PERF.md, session 25). The
two runs do not execute alike: while a profiler session is active, XLA launches the thunks of its command buffers (CUDA
graphs) one by one, unless XLA_FLAGS has `--xla_enable_command_buffers_during_profiling=true`; the timed runs replay
the graphs. And the card idles while the profiler starts, so the profiled run starts rested, the timed runs after
their warm-ups: `--trace-runs N` profiles N runs back to back and takes the span from the last (N = 2 + repeats: the
load history of the timed runs). `scripts/loop_modes.sh` times the loop with and without command buffers. The run's
XLA_FLAGS are printed with the device.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import json
import math
import os
import re
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import KV_FORMATS, PAGE_SIZE, flash_mla_with_kvcache, get_mla_metadata, kernel_formats
from ._cli import fmt, format_inputs, list_flag, output_path, positive_int, pyplot, sized, write_csv
from .formats import BYTES_PER_TOKEN, HEAD_DIM_QK, HEAD_DIM_V, Q_DTYPES

HEADS_KV = 1
L2_BYTES = 60e6  # H200
MAX_ROTATION_SETS = 64


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    seqlen_q: int
    heads_q: int
    causal: bool
    varlen: bool  # lengths uniform in [1, 2 * seqlen], else all equal to seqlen


SHAPES = {
    "M1": Shape("M1", 1, 16, False, False),
    "C1": Shape("C1", 1, 128, False, False),
    "C2": Shape("C2", 2, 128, True, False),
    "VL": Shape("VL", 1, 128, False, True),
}
# README §3, measured on one H200 at batch 128, s_k 8192 (µs).
ANCHORS_US = {
    "FlashMLA bf16": {"M1": 309, "C1": 489, "C2": 908},
    "PR #54 fp8": {"M1": 218, "C1": 432, "C2": 825},
    "plain jnp bf16": {"M1": 2393, "C1": 3032, "C2": 3911},
}
ANCHOR_BATCH, ANCHOR_SEQLEN = 128, 8192
ANCHOR_DEVICE = "H200"  # in jax's device_kind ("NVIDIA H200")
README_CEILINGS = {"copy": 4243.0, "bf16_gemm": 708.0, "fp8_gemm": 1287.0}  # GB/s, TFLOPS, TFLOPS

CSV_COLUMNS = ("shape", "format", "path", "batch", "seqlen_q", "heads_q", "heads_kv", "causal", "sum_seqlen_k",
               "rotation_sets", "iters", "repeats", "us_median", "us_min", "us_max", "tflops", "gbps",
               "frac_copy_bw", "frac_bf16_gemm", "frac_fp8_gemm", "floor_us", "floor_over_us",
               "speedup_vs_reference", "speedup_vs_flashmla_bf16", "speedup_vs_pr54_fp8", "loop_overhead_us",
               "unrolled", "pause_s", "copy_gbps", "bf16_gemm_tflops", "fp8_gemm_tflops", "span_us", "gpu_busy_us",
               "splitkv_us", "combine_us", "traced_loop_us", "trace_runs", "span_by_run_us")


class Timing(NamedTuple):
    median_us: float
    min_us: float
    max_us: float
    # The profiled run's own wall time per call (NaN without trace_dir): the timed runs measure more per call than
    # the profiled timeline's period (docs/PERF.md, session 25); this says whether the profiler's run does too.
    traced_us: float = math.nan


def depend(x, checksum):
    """`x`, made to depend on the loop's checksum: zeroed if the checksum is NaN, which XLA cannot rule out."""
    return jnp.where(jnp.isnan(checksum), jnp.zeros_like(x), x)


def _pick(x, checksum):
    """One element of `x` at an index that depends on the checksum, so XLA cannot shrink what produces `x`."""
    return lax.dynamic_index_in_dim(x.reshape(-1), jnp.isnan(checksum).astype(jnp.int32), keepdims=False)


def time_loop(body, carry, args=(), *, iters: int, repeats: int, unroll: bool = False, trace_dir=None,
              pause_s: float = 0.0, trace_runs: int = 1) -> Timing:
    """Device µs of one `carry = body(i, carry, args)`.

    `iters` of them run in one jitted fori_loop (a static trip count) whose carry is donated, so the loop state
    needs no initial copy; time = wall time after block_until_ready / iters. Compile and two warm-up runs are
    excluded; median, min and max over `repeats` runs. `unroll`: straight-line code instead of a while loop (whose
    predicate may cost a host round trip per iteration on a GPU); only for bodies whose iterations stay apart
    through real data dependencies: unrolled, XLA drops the optimization barriers, fuses elementwise iterations
    into one pass and merges identical ones. `trace_dir`: `trace_runs` more runs, back to back, under the profiler,
    written there (traced_us: the last one's wall time per call).
    `pause_s`: the device idles that long before each timed run, as it does before the profiled one (whether the
    card's clock under back-to-back runs is what sets the loop figure apart from the profiled period).
    """
    def loop(carry, args):
        return lax.fori_loop(0, iters, lambda i, c: body(i, c, args), carry, unroll=unroll)

    run = jax.jit(loop, donate_argnums=0).lower(carry, args).compile()
    for _ in range(2):
        carry = jax.block_until_ready(run(carry, args))
    seconds = []
    for _ in range(repeats):
        time.sleep(pause_s)
        start = time.perf_counter()
        carry = jax.block_until_ready(run(carry, args))
        seconds.append(time.perf_counter() - start)
    traced_us = math.nan
    if trace_dir:  # after the timed runs, which must not pay for the profiler
        with jax.profiler.trace(trace_dir):
            for _ in range(trace_runs):
                start = time.perf_counter()
                carry = jax.block_until_ready(run(carry, args))
                traced_us = (time.perf_counter() - start) * 1e6 / iters
    us = np.asarray(seconds) * 1e6 / iters
    return Timing(float(np.median(us)), float(us.min()), float(us.max()), traced_us)


def time_per_call(step, args, *, iters: int, repeats: int, unroll: bool = False, trace_dir=None,
                  pause_s: float = 0.0, trace_runs: int = 1) -> Timing:
    """Device µs of one `step(i, checksum, *args)` (see the module docstring for the loop).

    `args` and the running checksum pass through an optimization barrier each iteration, so no part of the step is
    loop-invariant; a step may also feed the checksum into a small input through `depend` (a data dependency that
    survives every XLA pass). One element of each output, picked at a checksum-dependent index, joins the checksum.
    """
    def body(i, checksum, args):
        args, checksum = lax.optimization_barrier((args, checksum))
        outputs = step(i, checksum, *args)
        return checksum + sum(_pick(x, checksum).astype(jnp.float32) for x in jax.tree.leaves(outputs))
    return time_loop(body, jnp.float32(0), args, iters=iters, repeats=repeats, unroll=unroll, trace_dir=trace_dir,
                     pause_s=pause_s, trace_runs=trace_runs)


# ---------------------------------------------------------------------------------------------------------------
# Profiler traces

# On a device process, CUPTI names copies, memsets, allocations and its own overhead after their type (kernels after
# the kernel) and gives each a *_details arg (kernels: kernel_details); traces without args still have the names.
NOT_KERNEL_NAME = re.compile(r"Memcpy|Memset|MemoryAlloc|MemoryFree|MemoryResidency|Overhead")
NOT_KERNEL_ARGS = ("memcpy_details", "memset_details", "memalloc_details", "memfree_details",
                   "memory_residency_details")
NO_KERNEL_TIMES = dict(span_us=math.nan, gpu_busy_us=math.nan, splitkv_us=math.nan, combine_us=math.nan,
                       span_by_run_us="")


def trace_events(trace_dir) -> list:
    """The events of the newest Chrome trace that `jax.profiler.trace(trace_dir)` wrote."""
    paths = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz"))
    with gzip.open(max(paths, key=os.path.getmtime), "rt") as f:
        return json.load(f)["traceEvents"]


def _is_kernel(event) -> bool:
    args = event.get("args") or {}
    return "kernel_details" in args or not (NOT_KERNEL_NAME.match(event["name"])
                                            or any(key in args for key in NOT_KERNEL_ARGS))


def device_pids(events) -> set:
    """The trace's GPU device processes (the host's events are on others)."""
    return {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and e["args"]["name"].startswith("/device:GPU")}


def busy_and_gaps(intervals, begin=None, end=None, min_gap=2.0):
    """How long (start, duration, ...) intervals sorted by start cover of [begin, end) (default: from the first start
    to the last end), overlaps counted once (combine overlaps splitkv_mla under programmatic dependent launch), and
    the uncovered gaps in it longer than `min_gap`, as (offset from begin, length)."""
    if begin is None:
        begin = intervals[0][0] if intervals else 0.0
    if end is None:
        end = max((s + d for s, d, *_ in intervals), default=begin)
    busy, gaps, cursor = 0.0, [], begin
    for start, duration, *_ in intervals:
        s, e = max(start, begin), min(start + duration, end)
        if e <= cursor:
            continue
        if s > cursor:
            if s - cursor > min_gap:
                gaps.append((cursor - begin, s - cursor))
            cursor = s
        busy += e - cursor
        cursor = e
    if end - cursor > min_gap:
        gaps.append((cursor - begin, end - cursor))
    return busy, gaps


def decode_kernel_times(events, iters: int) -> dict:
    """Device µs per call from the trace events of back-to-back loops of `iters` decode calls each; NaNs without
    splitkv_mla launches.

    span_us: median over the last run's calls from a call's splitkv_mla start to the end of its last decode kernel
    (span_by_run_us: the same for each run in order, space-separated: the card rested before the first run only);
    gpu_busy_us: the time the device processes' kernels cover (overlaps once), the loop's glue included, / all calls;
    splitkv_us / combine_us: median duration of each kernel alone over the last run (combine: over the calls that
    launched one; NaN if none did). A call is one splitkv_mla launch and the first combine launch after it, if any,
    before the next splitkv_mla.
    """
    devices = device_pids(events)
    kernels = sorted((e for e in events if e.get("ph") == "X" and e["pid"] in devices and _is_kernel(e)),
                     key=lambda e: e["ts"])
    calls = []  # each call's decode kernels
    for e in kernels:
        if "splitkv_mla" in e["name"]:
            calls.append([e])
        elif "combine" in e["name"] and calls and len(calls[-1]) == 1:
            calls[-1].append(e)
    if not calls:
        return dict(NO_KERNEL_TIMES)
    # Under programmatic dependent launch, combine starts before splitkv_mla ends: the span counts the overlap once.
    span = lambda some: float(np.median([max(e["ts"] + e["dur"] for e in call) - call[0]["ts"] for call in some]))
    last = calls[-iters:]
    combines = [call[1]["dur"] for call in last if len(call) == 2]
    by_run = [calls[i:i + iters] for i in range(0, len(calls), iters)]
    return dict(span_us=span(last), span_by_run_us=" ".join(f"{span(run):.1f}" for run in by_run),
                gpu_busy_us=busy_and_gaps([(e["ts"], e["dur"]) for e in kernels])[0] / len(calls),
                splitkv_us=float(np.median([call[0]["dur"] for call in last])),
                combine_us=float(np.median(combines)) if combines else math.nan)


# ---------------------------------------------------------------------------------------------------------------
# Ceilings

def _matmul_tn(a, b):
    """a [m, k] · b [n, k]ᵀ with f32 accumulation (the operand layout cuBLAS's fp8 GEMM takes without transposes)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def has_fp8_matmul(hlo_text: str) -> bool:
    """Whether compiled HLO multiplies e4m3 operands directly (cuBLAS fp8 call, or a dot on f8 values)."""
    if "__cublas$lt$matmul$f8" in hlo_text:
        return True
    dtypes = {}  # instruction name -> element type; HLO text defines each value before its uses
    for line in hlo_text.splitlines():
        definition = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[", line)
        if definition:
            dtypes[definition.group(1)] = definition.group(2)
        dot = re.search(r"\bdot\(([^)]*)\)", line)
        if dot and any(dtypes.get(operand.split()[-1].lstrip("%")) == "f8e4m3fn"
                       for operand in dot.group(1).split(",") if operand.strip()):
            return True
    return False


def fp8_gemm_unsupported_reason(size: int):
    """None when XLA on this device lowers an e4m3 × e4m3 GEMM to fp8 math, else why not."""
    if jax.devices()[0].platform != "gpu":
        return f"measured on GPUs only (this is {jax.devices()[0].platform})"
    operand = jax.ShapeDtypeStruct((size, size), jnp.float8_e4m3fn)
    try:
        hlo_text = jax.jit(_matmul_tn).lower(operand, operand).compile().as_text()
    except Exception as e:  # noqa: BLE001 - any compile failure means "not supported"; say which
        return f"XLA cannot compile it: {str(e).splitlines()[0]}"
    return None if has_fp8_matmul(hlo_text) else "XLA upcasts the e4m3 operands instead of using fp8 math"


class Ceilings(NamedTuple):
    copy_gbps: float
    bf16_gemm_tflops: float
    fp8_gemm_tflops: float  # NaN when not measured
    fp8_note: str  # why there is no fp8 figure ("" when there is)

    def gemm_tflops(self, kv_format) -> float:
        """The rate of the format's precision: fp8 for the fp8 formats where it was measured, else bf16."""
        if kv_format != "bf16" and not math.isnan(self.fp8_gemm_tflops):
            return self.fp8_gemm_tflops
        return self.bf16_gemm_tflops


def measure_ceilings(*, copy_bytes, gemm_size, iters, repeats) -> Ceilings:
    key_x, key_a, key_b = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(key_x, (copy_bytes // 4,), jnp.float32)
    # The buffer is the loop state: every iteration reads all of it and writes all of it (the barrier keeps XLA
    # from merging iterations); the scale is a traced 1.0 that XLA cannot fold away.
    copy_gbps = 2 * copy_bytes / time_loop(lambda i, x, scale: lax.optimization_barrier(x * scale), x,
                                           jnp.float32(1), iters=iters, repeats=repeats).median_us / 1e3
    del x  # donated to the loop
    Progress.note(f"copy {copy_bytes / 2**30:.2f} GiB: {copy_gbps:.4g} GB/s")

    flops = 2 * gemm_size ** 3
    a = jax.random.normal(key_a, (gemm_size, gemm_size), jnp.bfloat16)
    b = jax.random.normal(key_b, (gemm_size, gemm_size), jnp.bfloat16)
    timing = time_per_call(lambda i, checksum, a, b: _matmul_tn(a, b), (a, b), iters=iters, repeats=repeats)
    bf16_tflops = flops / timing.median_us / 1e6
    Progress.note(f"bf16 GEMM {gemm_size}^3: {bf16_tflops:.4g} TFLOPS")

    fp8_tflops, fp8_note = math.nan, fp8_gemm_unsupported_reason(gemm_size)
    if fp8_note is None:
        a8, b8 = a.astype(jnp.float8_e4m3fn), b.astype(jnp.float8_e4m3fn)
        timing = time_per_call(lambda i, checksum, a, b: _matmul_tn(a, b), (a8, b8), iters=iters, repeats=repeats)
        fp8_tflops, fp8_note = flops / timing.median_us / 1e6, ""
        Progress.note(f"fp8 GEMM {gemm_size}^3: {fp8_tflops:.4g} TFLOPS")
    else:
        Progress.note(f"fp8 GEMM skipped: {fp8_note}")
    return Ceilings(copy_gbps, bf16_tflops, fp8_tflops, fp8_note)


# ---------------------------------------------------------------------------------------------------------------
# Decode problems

def sequence_lengths(shape: Shape, batch: int, seqlen: int, rng) -> np.ndarray:
    if shape.varlen:
        return rng.integers(1, 2 * seqlen + 1, batch).astype(np.int32)
    return np.full(batch, seqlen, np.int32)


def work(shape: Shape, lengths, kv_format):
    """(FLOPs, bytes) of one decode: FLOPs over the visible keys, bytes = cache read once + q + out."""
    if shape.causal:
        visible = lengths[:, None] - shape.seqlen_q + 1 + np.arange(shape.seqlen_q)[None, :]
    else:
        visible = np.repeat(lengths[:, None], shape.seqlen_q, axis=1)
    flops = 2 * shape.heads_q * (HEAD_DIM_QK + HEAD_DIM_V) * int(np.clip(visible, 0, None).sum())
    rows = len(lengths) * shape.seqlen_q * shape.heads_q
    io_bytes = rows * (HEAD_DIM_QK * Q_DTYPES[kv_format].itemsize + HEAD_DIM_V * 2)
    return flops, int(lengths.sum()) * HEADS_KV * BYTES_PER_TOKEN[kv_format] + io_bytes


def rotation_sets(shape: Shape, lengths, l2_bytes: float) -> int:
    """Input sets to rotate among so that a set's pages have left L2 before its next use (1 if one set is large)."""
    pages = int(np.ceil(lengths / PAGE_SIZE).sum())
    set_bytes = pages * PAGE_SIZE * HEADS_KV * min(BYTES_PER_TOKEN.values()) + len(lengths) * shape.seqlen_q * \
        shape.heads_q * HEAD_DIM_QK
    if set_bytes >= 2 * l2_bytes:
        return 1
    return min(MAX_ROTATION_SETS, 1 + math.ceil(2 * l2_bytes / set_bytes))


def build_problem(shape: Shape, lengths, sets: int, rng, key):
    """bf16 q sets [sets, b, s_q, h_q, 576], latent pool [sets * pages, 64, 1, 576], block tables [sets, b, w].

    Set s owns pages [s * pages, (s + 1) * pages) of the pool, shuffled over its sequences; table entries past a
    sequence's last page are 0 (never read).
    """
    pages = np.ceil(lengths / PAGE_SIZE).astype(np.int64)
    set_pages = int(pages.sum())
    starts = np.concatenate([[0], np.cumsum(pages)])
    tables = np.zeros((sets, len(lengths), int(pages.max())), np.int32)
    for s in range(sets):
        ids = s * set_pages + rng.permutation(set_pages)
        for i, n in enumerate(pages):
            tables[s, i, :n] = ids[starts[i]:starts[i + 1]]
    key_q, key_latent = jax.random.split(key)
    q_sets = jax.random.normal(key_q, (sets, len(lengths), shape.seqlen_q, shape.heads_q, HEAD_DIM_QK), jnp.bfloat16)
    latent = jax.random.normal(key_latent, (sets * set_pages, PAGE_SIZE, HEADS_KV, HEAD_DIM_QK), jnp.bfloat16)
    return q_sets, latent, jnp.asarray(tables)


def decode_step(shape: Shape, kv_format: str, implementation: str, ds_scales: str = "group"):
    """Decode with input set i % sets; the block table carries the checksum dependency."""
    extra = {"ds_scales": ds_scales} if kv_format == "fp8_ds_mla" else {}
    def step(i, checksum, q_sets, tables, cache, seqlens, meta, scales):
        j = i % q_sets.shape[0]
        return flash_mla_with_kvcache(q_sets[j], cache, depend(tables[j], checksum), seqlens, HEAD_DIM_V, meta,
                                      causal=shape.causal, kv_format=kv_format, implementation=implementation,
                                      **scales, **extra)
    return step


def empty_step(i, checksum, q_sets, tables, *unused):
    """The loop's own work without a decode: the rotation's slices, the table dependency and the checksum."""
    j = i % q_sets.shape[0]
    return q_sets[j], depend(tables[j], checksum)


class Progress:
    """Progress on stderr: notes, and one numbered line per timed case."""

    def __init__(self, total_cases: int):
        self.total, self.done = total_cases, 0

    @staticmethod
    def note(text):
        print(f"[bench] {text}", file=sys.stderr, flush=True)

    def case(self, text):
        self.done += 1
        print(f"[bench {self.done}/{self.total}] {text}", file=sys.stderr, flush=True)


def anchors_apply(device_kind: str, batch: int, seqlen: int, quick: bool) -> bool:
    """README §3's anchors were measured on an H200 at batch 128, s_k 8192: another card (an H100, the CPU) or
    problem gets no speedups over them."""
    return not quick and (batch, seqlen) == (ANCHOR_BATCH, ANCHOR_SEQLEN) and ANCHOR_DEVICE in device_kind


def result_row(shape: Shape, kv_format, path, timing: Timing, lengths, ceilings: Ceilings, with_anchors: bool):
    """One CSV row: the timing, its rates, fractions of the ceilings, floor and speedups over README anchors."""
    us = timing.median_us
    flops, nbytes = work(shape, lengths, kv_format)
    tflops, gbps = flops / us / 1e6, nbytes / us / 1e3
    floor_us = max(nbytes / ceilings.copy_gbps / 1e3, flops / ceilings.gemm_tflops(kv_format) / 1e6)
    def speedup(anchor):
        return ANCHORS_US[anchor][shape.name] / us if with_anchors else math.nan
    return dict(
        shape=shape.name, format=kv_format, path=path, batch=len(lengths), seqlen_q=shape.seqlen_q,
        heads_q=shape.heads_q, heads_kv=HEADS_KV, causal=shape.causal, sum_seqlen_k=int(lengths.sum()),
        us_median=us, us_min=timing.min_us, us_max=timing.max_us, tflops=tflops, gbps=gbps,
        frac_copy_bw=gbps / ceilings.copy_gbps, frac_bf16_gemm=tflops / ceilings.bf16_gemm_tflops,
        frac_fp8_gemm=tflops / ceilings.fp8_gemm_tflops, floor_us=floor_us, floor_over_us=floor_us / us,
        speedup_vs_reference=math.nan, speedup_vs_flashmla_bf16=speedup("FlashMLA bf16"),
        speedup_vs_pr54_fp8=speedup("PR #54 fp8"), copy_gbps=ceilings.copy_gbps,
        bf16_gemm_tflops=ceilings.bf16_gemm_tflops, fp8_gemm_tflops=ceilings.fp8_gemm_tflops)


def bench_shape(shape: Shape, kv_formats, *, batch, seqlen, anchors, skip_reference, ceilings, iters, repeats,
                progress: Progress, seed, unroll=False, trace_root=None, pause_s=0.0, trace_runs=1, ds_scales="group"):
    """Times every (format, path) of one shape; returns CSV rows, plus rows with no_kernel=True for the table.

    `trace_root`: each kernel case is also traced, into <trace_root>/<shape>_<format>, for `decode_kernel_times`.
    `pause_s`: idle seconds before each timed run of a decode (time_loop). `trace_runs`: runs of the profiled loop.
    """
    rng = np.random.default_rng([seed, list(SHAPES).index(shape.name)])
    lengths = sequence_lengths(shape, batch, seqlen, rng)
    # The rotation targets a GPU's L2; elsewhere one set.
    sets = rotation_sets(shape, lengths, L2_BYTES if jax.devices()[0].platform == "gpu" else 0)
    q_sets, latent, tables = build_problem(shape, lengths, sets, rng, jax.random.key(seed))
    seqlens = jnp.asarray(lengths)
    meta = get_mla_metadata(seqlens, shape.seqlen_q * shape.heads_q // HEADS_KV, HEADS_KV)
    overhead = time_per_call(empty_step, (q_sets, tables), iters=iters, repeats=repeats, unroll=unroll).median_us
    progress.note(f"{shape.name}: batch {batch}, sum s_k {int(lengths.sum())}, {sets} rotation set(s), loop "
                  f"overhead {overhead:.1f} us")
    with_anchors = anchors and shape.name in ANCHORS_US["FlashMLA bf16"]
    setup = dict(rotation_sets=sets, iters=iters, repeats=repeats, loop_overhead_us=overhead, unrolled=unroll,
                 pause_s=pause_s)
    usable = kernel_formats()
    rows = []
    for kv_format in kv_formats:
        q_in, cache, scales = format_inputs(kv_format, q_sets, latent, ds_scales)
        if kv_format not in usable:
            rows.append(dict(shape=shape.name, format=kv_format, path="kernel", no_kernel=True))
        paths = (["kernel"] if kv_format in usable else []) + ([] if skip_reference else ["reference"])
        by_path = {}
        for path in paths:
            traced = trace_root and path == "kernel"
            trace_dir = os.path.join(trace_root, f"{shape.name}_{kv_format}") if traced else None
            timing = time_per_call(decode_step(shape, kv_format, path, ds_scales),
                                   (q_in, tables, cache, seqlens, meta, scales),
                                   iters=iters, repeats=repeats, unroll=unroll, trace_dir=trace_dir, pause_s=pause_s,
                                   trace_runs=trace_runs)
            kernel_times = decode_kernel_times(trace_events(trace_dir), iters) if trace_dir else NO_KERNEL_TIMES
            by_path[path] = result_row(shape, kv_format, path, timing, lengths, ceilings, with_anchors) | setup | \
                kernel_times | dict(traced_loop_us=timing.traced_us, trace_runs=trace_runs if trace_dir else 0)
            traced_note = ""
            if trace_dir:
                traced_note = (f"; decode kernels' span {kernel_times['span_us']:.1f} us (splitkv_mla "
                               f"{kernel_times['splitkv_us']:.1f}, combine {kernel_times['combine_us']:.1f}; "
                               f"the profiled run's loop {timing.traced_us:.1f} us")
                if trace_runs > 1:
                    traced_note += f"; spans of the {trace_runs} profiled runs: {kernel_times['span_by_run_us']} us"
                traced_note += ")"
            progress.case(f"{shape.name} {kv_format} {path}: {timing.median_us:.1f} us "
                          f"({timing.min_us:.1f}-{timing.max_us:.1f}){traced_note}")
        if len(by_path) == 2:
            by_path["kernel"]["speedup_vs_reference"] = by_path["reference"]["us_median"] / \
                by_path["kernel"]["us_median"]
        rows.extend(by_path.values())
        del q_in, cache, scales
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Output

# Table columns: header, width, row key, format.
TABLE = (("us", 10, "us_median", ".1f"), ("min", 10, "us_min", ".1f"), ("max", 10, "us_max", ".1f"),
         ("TFLOPS", 8, "tflops", ".3g"), ("GB/s", 8, "gbps", ".4g"), ("%copy", 7, "frac_copy_bw", ".0%"),
         ("%bf16mm", 8, "frac_bf16_gemm", ".0%"), ("%fp8mm", 7, "frac_fp8_gemm", ".0%"),
         ("floor", 7, "floor_us", ".0f"), ("fl/us", 6, "floor_over_us", ".2f"),
         ("xref", 6, "speedup_vs_reference", ".1f"),
         ("xFlashMLA", 10, "speedup_vs_flashmla_bf16", ".2f"), ("xPR54", 7, "speedup_vs_pr54_fp8", ".2f"))
SPAN_COLUMN = ("span", 8, "span_us", ".1f")  # with --trace, after "max"


# A time this far under its floor means the loop did not run what it was meant to (hoisted or dead code).
IMPLAUSIBLE_FLOOR_RATIO = 1.05


def print_table(rows, traced=False):
    columns = TABLE[:3] + (SPAN_COLUMN,) + TABLE[3:] if traced else TABLE
    print(f"{'shape':<6}{'format':<16}{'path':<10}" + "".join(f"{h:>{w}}" for h, w, _, _ in columns))
    for r in rows:
        if r.get("no_kernel"):
            cells = "  no kernel"
        else:
            cells = "".join(f"{fmt(r[k], s):>{w}}" for _, w, k, s in columns)
            cells += " !" if r["floor_over_us"] > IMPLAUSIBLE_FLOOR_RATIO else ""
        print(f"{r['shape']:<6}{r['format']:<16}{r['path']:<10}{cells}")


def plot(rows, path) -> bool:
    """One panel per shape: µs of each (format, path), the floor of each format, README anchors where they apply."""
    plt = pyplot()
    if plt is None:
        return False
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.5 * len(shapes), 4), squeeze=False)
    for ax, name in zip(axes[0], shapes):
        subset = [r for r in rows if r["shape"] == name]
        x = np.arange(len(subset))
        colors = ["tab:blue" if r["path"] == "kernel" else "tab:gray" for r in subset]
        ax.bar(x, [r["us_median"] for r in subset], 0.6, color=colors)
        ax.scatter(x, [r["floor_us"] for r in subset], marker="_", s=300, color="k", label="floor")
        for (label, anchor), style in zip(ANCHORS_US.items(), ("--", ":", "-.")):
            if not math.isnan(subset[0]["speedup_vs_pr54_fp8"]):
                ax.axhline(anchor[name], linestyle=style, color="tab:red", linewidth=1, label=label)
        ax.set_xticks(x, [f"{r['format']}\n{r['path']}" for r in subset], fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("us per call (blue kernel, gray reference)")
        ax.set_title(name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _vs_readme(value, ceiling, unit) -> str:
    """A measured ceiling next to README §3's; one far above it means the loop did not run what it should."""
    text = f"{value:.4g} {unit} (README {README_CEILINGS[ceiling]:.0f}"
    if value > 1.5 * README_CEILINGS[ceiling]:
        text += "; IMPLAUSIBLY HIGH: the timed loop did not do the work"
    return text + ")"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m jax_flash_mla.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: batch 8, s_k 512, 3 iterations x 3 repeats, 256 MiB copy, 1024^3 GEMMs")
    parser.add_argument("--shapes", default=",".join(SHAPES), type=list_flag(tuple(SHAPES), "--shapes"),
                        help="comma list of M1,C1,C2,VL (default all)")
    parser.add_argument("--formats", default=",".join(KV_FORMATS), type=list_flag(KV_FORMATS, "--formats"),
                        help=f"comma list of {','.join(KV_FORMATS)} (default all)")
    parser.add_argument("--skip-reference", action="store_true", help="time the kernels only")
    parser.add_argument("--batch", type=positive_int, help=f"sequences (default {ANCHOR_BATCH}; quick 8)")
    parser.add_argument("--seqlen", type=positive_int,
                        help=f"s_k; VL draws lengths in [1, 2 s_k] (default {ANCHOR_SEQLEN}; quick 512)")
    parser.add_argument("--iters", type=positive_int, help="decode calls per timed loop (default 50; quick 3)")
    parser.add_argument("--repeats", type=positive_int, help="timed loops per case (default 10; quick 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--unroll", action="store_true",
                        help="time the decode calls as straight-line code, not in a while loop (the ceilings keep "
                             "the loop); each call still waits on the last one's output. On the H200 it shrank the "
                             "empty-loop overhead (21 -> 4 us) but not the per-call times (docs/PERF.md, session 4)")
    parser.add_argument("--trace", nargs="?", const="", metavar="DIR",
                        help="also trace each kernel case's loop once with the profiler (into DIR, default "
                             "bench_trace under $OUT, else the cwd) and report the decode kernels' device time per "
                             "call (CSV span_us, gpu_busy_us, splitkv_us, combine_us, and traced_loop_us, the "
                             "profiled run's wall time per call; table column span)")
    parser.add_argument("--trace-runs", type=int, default=1, metavar="N",
                        help="with --trace, profile N back-to-back runs of each loop (default 1), the span from the "
                             "last (CSV span_by_run_us: each run's); N = 2 + repeats gives the profiled runs the "
                             "load history of the timed ones (two warm-ups and the repeats)")
    parser.add_argument("--pause", type=float, default=0.0, metavar="SECONDS",
                        help="let the GPU idle this long before each timed run of a decode (default 0: runs back to "
                             "back); the profiled run of --trace follows the profiler's start-up, an idle time too")
    parser.add_argument("--ds-scales", choices=("group", "token"), default="group",
                        help="fp8_ds_mla: a cache with one scale per 128 channels (default) or per token, decoded by "
                             "the decoder of that name (flash_mla_with_kvcache's ds_scales)")
    parser.add_argument("--csv", help="CSV path (default bench.csv under $OUT, else the cwd)")
    parser.add_argument("--png", help="PNG path (default bench.png under $OUT, else the cwd)")
    args = parser.parse_args(argv)
    batch, seqlen = sized(args.batch, args.quick, 8, ANCHOR_BATCH), sized(args.seqlen, args.quick, 512, ANCHOR_SEQLEN)
    iters, repeats = sized(args.iters, args.quick, 3, 50), sized(args.repeats, args.quick, 3, 10)
    if not 0 <= args.pause <= 60:
        parser.error("--pause must be between 0 and 60 seconds")
    if not 1 <= args.trace_runs <= 100 or (args.trace_runs > 1 and args.trace is None):
        parser.error("--trace-runs must be between 1 and 100, and needs --trace")
    usable = kernel_formats()
    device = f"jax {jax.__version__} on {jax.devices()[0].device_kind}; kernels usable: {sorted(usable) or 'none'}"
    if args.ds_scales == "token":
        device += "; fp8_ds_mla with token scales (ds_scales='token')"
    if os.environ.get("XLA_FLAGS"):
        device += f"; XLA_FLAGS={os.environ['XLA_FLAGS']}"
    Progress.note(device)
    ceilings = measure_ceilings(copy_bytes=2**28 if args.quick else 2**31, gemm_size=1024 if args.quick else 8192,
                                iters=iters, repeats=repeats)
    progress = Progress(len(args.shapes) * sum((f in usable) + (not args.skip_reference) for f in args.formats))
    anchors = anchors_apply(jax.devices()[0].device_kind, batch, seqlen, args.quick)
    trace_root = None if args.trace is None else output_path(args.trace, "bench_trace")
    rows = []
    for name in args.shapes:
        rows += bench_shape(SHAPES[name], args.formats, batch=batch, seqlen=seqlen, anchors=anchors,
                            skip_reference=args.skip_reference, ceilings=ceilings, iters=iters, repeats=repeats,
                            progress=progress, seed=args.seed, unroll=args.unroll, trace_root=trace_root,
                            pause_s=args.pause, trace_runs=args.trace_runs, ds_scales=args.ds_scales)

    measured = [r for r in rows if not r.get("no_kernel")]
    csv_path, png_path = output_path(args.csv, "bench.csv"), output_path(args.png, "bench.png")
    write_csv(measured, csv_path, CSV_COLUMNS)
    plotted = bool(measured) and plot(measured, png_path)
    fp8 = (_vs_readme(ceilings.fp8_gemm_tflops, "fp8_gemm", "TFLOPS") if not ceilings.fp8_note
           else f"not measured: {ceilings.fp8_note}")
    print(f"\n{device}")
    print(f"batch {batch}, s_k {seqlen} (VL: uniform in [1, {2 * seqlen}]), h_kv {HEADS_KV}; {iters} calls per "
          f"loop, {repeats} loops; median (min-max) us per call" + ("; QUICK: smoke numbers" if args.quick else ""))
    print(f"ceilings: copy {_vs_readme(ceilings.copy_gbps, 'copy', 'GB/s')}; bf16 GEMM "
          f"{_vs_readme(ceilings.bf16_gemm_tflops, 'bf16_gemm', 'TFLOPS')}; fp8 GEMM {fp8}")
    print(f"README §3 anchors ({ANCHOR_DEVICE}, us, M1/C1/C2): " + "; ".join(
        f"{label} {'/'.join(str(v) for v in by_shape.values())}" for label, by_shape in ANCHORS_US.items())
        + ("" if anchors else f"; not compared here (they hold on an {ANCHOR_DEVICE} at batch {ANCHOR_BATCH}, "
                              f"s_k {ANCHOR_SEQLEN})"))
    print("floor = max(bytes / copy, FLOPs / GEMM rate of the format: fp8 for fp8 formats when measured); "
          "fl/us = floor / time ('!' over 1: not a real measurement); xref = reference / kernel; xFlashMLA, xPR54 = "
          "anchor / time (> 1 is faster)")
    if trace_root:
        runs = "one more run" if args.trace_runs == 1 else f"the last of {args.trace_runs} more runs, back to back,"
        print(f"span = median device time per call from splitkv_mla's start to combine's end (profiler records of "
              f"{runs} of the loop; the other rates and fractions use us); traces under {trace_root}")
    print(f"CSV {csv_path}" + (f"; PNG {png_path}" if plotted else ""))
    print_table(rows, traced=bool(trace_root))
    return measured


if __name__ == "__main__":
    main()
