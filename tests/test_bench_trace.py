"""`bench --trace`: the decode kernels' times per call, parsed from synthetic profiler trace events (CPU only)."""

import csv
import math

from jax_flash_mla import bench

SPLITKV = "void jax_flash_mla::sm90::splitkv_mla_kernel<(jax_flash_mla::config::KvFormat)0, false>(SplitKvArgs)"
COMBINE = "jax_flash_mla::(anonymous namespace)::combine_kernel(DecodeParams)"
MANGLED_SPLITKV = "_ZN13jax_flash_mla4sm9018splitkv_mla_kernelILNS_6config8KvFormatE0ELb0EEEvNS0_11SplitKvArgsE"
GPU, HOST = 7, 701


def metadata():
    return [{"ph": "M", "pid": HOST, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": HOST, "name": "process_sort_index", "args": {"sort_index": HOST}},
            {"ph": "M", "pid": GPU, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": GPU, "tid": 3, "name": "thread_name", "args": {"name": "Stream #3(Compute)"}}]


def kernel(name, ts, dur, pid=GPU, **args):
    event = {"ph": "X", "pid": pid, "tid": 3, "ts": ts, "dur": dur, "name": name}
    if args:
        event["args"] = args
    return event


def test_calls_with_combine_and_glue():
    """Three calls of splitkv + combine + a glue fusion; host events (even ones named like the kernels), a memcpy
    and the trace's trailing {} are left out."""
    events = metadata() + [
        # Unsorted, as the profiler writes them.
        kernel("loop_select_fusion", 150.0, 2.0),
        kernel(SPLITKV, 100.0, 40.0, kernel_details="regs:168 grid:132,1,1"),
        kernel(COMBINE, 141.0, 5.0),
        kernel(SPLITKV, 200.0, 44.0),
        kernel(COMBINE, 246.0, 6.0),
        kernel("loop_select_fusion", 255.0, 2.0),
        kernel(MANGLED_SPLITKV, 300.0, 42.0),
        kernel(COMBINE, 340.0, 7.0),  # starts before splitkv_mla ends (programmatic dependent launch)
        kernel("loop_select_fusion", 350.0, 2.0),
        kernel("MemcpyD2H", 353.0, 30.0, memcpy_details="kind_src:device kind_dst:pinned size:4"),
        kernel(SPLITKV, 120.0, 1000.0, pid=HOST),
        kernel("PjitFunction(loop)", 90.0, 400.0, pid=HOST),
        {},
    ]
    times = bench.decode_kernel_times(events, iters=3)
    assert times["span_us"] == 47.0  # median of 46, 52, 47 (not 49: the overlap counts once)
    # (47 + 52 + 49) / 3: splitkv_mla + combine + glue per call, the third call's overlap once; no memcpy, no host
    assert times["gpu_busy_us"] == 148.0 / 3
    assert times["splitkv_us"] == 42.0  # median of 40, 44, 42
    assert times["combine_us"] == 6.0  # median of 5, 6, 7


def test_call_without_combine():
    """A call whose combine was skipped counts its splitkv_mla alone; a combine is never taken from a later call."""
    events = metadata() + [kernel(SPLITKV, 0.0, 30.0), kernel("loop_add_fusion", 31.0, 1.0),
                           kernel(SPLITKV, 100.0, 40.0), kernel(COMBINE, 141.0, 4.0), kernel(COMBINE, 150.0, 9.0)]
    times = bench.decode_kernel_times(events, iters=2)
    assert times["span_us"] == 37.5  # median of 30, 45
    assert times["gpu_busy_us"] == 42.0  # (30 + 1 + 40 + 4 + 9) / 2
    assert times["splitkv_us"] == 35.0  # median of 30, 40
    assert times["combine_us"] == 4.0  # the one call with a combine (the later combine is no call's)


def test_runs_back_to_back():
    """Two profiled runs of two calls each: the span and the kernels' durations come from the last run, each run's
    span listed in order; the busy time is per call over both runs."""
    events = metadata() + [kernel(SPLITKV, 0.0, 30.0), kernel(COMBINE, 29.0, 3.0),
                           kernel(SPLITKV, 40.0, 32.0), kernel(COMBINE, 71.0, 3.0),
                           kernel(SPLITKV, 200.0, 36.0), kernel(COMBINE, 235.0, 5.0),
                           kernel(SPLITKV, 250.0, 38.0), kernel(COMBINE, 287.0, 5.0)]
    times = bench.decode_kernel_times(events, iters=2)
    assert times["span_by_run_us"] == "33.0 41.0"  # medians of 32, 34 and of 40, 42
    assert times["span_us"] == 41.0
    assert times["splitkv_us"] == 37.0 and times["combine_us"] == 5.0
    assert times["gpu_busy_us"] == (32.0 + 34.0 + 40.0 + 42.0) / 4


def test_busy_and_gaps():
    """Overlaps count once; gaps inside [begin, end) longer than min_gap, as (offset from begin, length)."""
    intervals = [(0.0, 10.0), (5.0, 10.0), (20.0, 1.0), (22.0, 3.0), (40.0, 5.0)]
    assert bench.busy_and_gaps(intervals) == (24.0, [(15.0, 5.0), (25.0, 15.0)])  # 0-15, 20-21, 22-25, 40-45
    busy, gaps = bench.busy_and_gaps(intervals, begin=8.0, end=50.0, min_gap=2.0)
    assert busy == 7.0 + 1.0 + 3.0 + 5.0
    assert gaps == [(7.0, 5.0), (17.0, 15.0), (37.0, 5.0)]  # 15-20, 25-40, 45-50; 21-22 is too short


def test_no_splitkv_is_nan():
    """The reference path, or a CPU: no splitkv_mla launch on a device, so no figures (host ones do not count)."""
    events = metadata() + [kernel("loop_dot_fusion", 0.0, 300.0), kernel(COMBINE, 301.0, 5.0),
                           kernel(SPLITKV, 0.0, 30.0, pid=HOST)]
    times = bench.decode_kernel_times(events, iters=1)
    assert set(times) == {"span_us", "gpu_busy_us", "splitkv_us", "combine_us", "span_by_run_us"}
    assert times["span_by_run_us"] == ""
    assert all(math.isnan(v) for k, v in times.items() if k != "span_by_run_us")


def test_bench_trace_cli(tmp_path, monkeypatch, capsys):
    """--trace on a CPU: the kernel case (the reference, as in test_cli) is profiled into its folder (two runs of the
    loop, the donated carry passed from one to the next); with no splitkv_mla there the new columns are NaN, and the
    table gets its span column after max."""
    real_step = bench.decode_step
    monkeypatch.setattr(bench, "kernel_formats", lambda: frozenset({"bf16"}))
    monkeypatch.setattr(bench, "decode_step",
                        lambda shape, kv_format, path, *rest: real_step(shape, kv_format, "reference", *rest))
    bench.main(["--quick", "--shapes", "M1", "--formats", "bf16", "--batch", "1", "--seqlen", "64", "--iters", "1",
                "--repeats", "1", "--skip-reference", "--trace", str(tmp_path / "trace"), "--trace-runs", "2",
                "--csv", str(tmp_path / "b.csv"), "--png", str(tmp_path / "b.png")])
    assert bench.trace_events(str(tmp_path / "trace" / "M1_bf16"))  # the profiled run was written
    with open(tmp_path / "b.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert all(math.isnan(float(row[k])) for k in ("span_us", "gpu_busy_us", "splitkv_us", "combine_us"))
    assert row["span_by_run_us"] == ""
    assert float(row["traced_loop_us"]) > 0  # the profiled run's wall time per call
    assert row["trace_runs"] == "2"
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("shape"))
    assert header.split()[3:8] == ["us", "min", "max", "span", "TFLOPS"]


def test_trace_runs_needs_trace(tmp_path):
    for args in (["--trace-runs", "2"], ["--trace", str(tmp_path), "--trace-runs", "0"]):
        try:
            bench.main(["--quick", "--shapes", "M1", "--formats", "bf16", *args])
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(f"{args} was accepted")
