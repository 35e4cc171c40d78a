"""The bench and accuracy command-line tools, run in-process on tiny problems (reference path on CPU)."""

import csv
import math
import re

import jax
import numpy as np
import pytest

from jax_flash_mla import __main__ as main_job
from jax_flash_mla import accuracy, bench
from jax_flash_mla.formats import BYTES_PER_TOKEN


def read_csv(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_bench_quick(tmp_path, capsys):
    csv_path = tmp_path / "bench.csv"
    bench.main(["--quick", "--shapes", "M1,C2", "--formats", "bf16,fp8_per_tensor", "--batch", "2", "--seqlen",
                "128", "--iters", "2", "--repeats", "2", "--csv", str(csv_path), "--png", str(tmp_path / "b.png")])
    columns, rows = read_csv(csv_path)
    assert tuple(columns) == bench.CSV_COLUMNS
    assert {(r["shape"], r["format"], r["path"]) for r in rows} >= {
        (s, f, "reference") for s in ("M1", "C2") for f in ("bf16", "fp8_per_tensor")}
    for r in rows:
        for key in ("us_median", "us_min", "us_max", "tflops", "gbps", "floor_us", "copy_gbps", "bf16_gemm_tflops"):
            value = float(r[key])
            assert math.isfinite(value) and value > 0, (key, r)
        assert float(r["us_min"]) <= float(r["us_median"]) <= float(r["us_max"])
    table = capsys.readouterr().out.splitlines()
    assert table[-1].startswith("C2    fp8_per_tensor")  # the table comes last


def test_bench_kernel_rows(tmp_path, monkeypatch):
    """A format listed as having a kernel gets a kernel row with its speedup over the reference (the "kernel" runs
    the reference here, as CPUs have no kernel)."""
    real_step = bench.decode_step
    monkeypatch.setattr(bench, "kernel_formats", lambda: frozenset({"bf16"}))
    monkeypatch.setattr(bench, "decode_step",
                        lambda shape, kv_format, path, *rest: real_step(shape, kv_format, "reference", *rest))
    rows = bench.main(["--quick", "--shapes", "C1", "--formats", "bf16", "--batch", "1", "--seqlen", "64",
                       "--iters", "1", "--repeats", "1", "--csv", str(tmp_path / "b.csv"),
                       "--png", str(tmp_path / "b.png")])
    kernel = next(r for r in rows if r["path"] == "kernel")
    assert kernel["speedup_vs_reference"] > 0
    assert math.isnan(kernel["speedup_vs_flashmla_bf16"])  # anchors hold for batch 128, s_k 8192 only


@pytest.mark.parametrize("device_kind, batch, seqlen, quick, applies", [
    ("NVIDIA H200", 128, 8192, False, True),
    ("NVIDIA H100 80GB HBM3", 128, 8192, False, False),  # README §3's figures are an H200's
    ("cpu", 128, 8192, False, False),
    ("NVIDIA H200", 64, 8192, False, False),
    ("NVIDIA H200", 128, 8192, True, False),
])
def test_bench_compares_to_the_anchors_only_where_they_were_measured(device_kind, batch, seqlen, quick, applies):
    assert bench.anchors_apply(device_kind, batch, seqlen, quick) is applies


def test_bench_pause_idles_outside_the_timed_runs(monkeypatch):
    slept, sleep = [], bench.time.sleep
    monkeypatch.setattr(bench.time, "sleep", lambda s: (slept.append(s), sleep(s)))
    timing = bench.time_loop(lambda i, x, args: x + 1.0, jax.numpy.float32(0), iters=2, repeats=3, pause_s=0.2)
    assert slept == [0.2] * 3
    # A timed pause would add 0.2 s / 2 calls = 100 000 us to every run; the two additions take microseconds.
    assert timing.min_us <= timing.median_us <= timing.max_us < 50_000
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--pause", "-1"])


def test_work_counts_visible_keys():
    lengths = np.array([10, 1], np.int32)
    flops, nbytes = bench.work(bench.SHAPES["C2"], lengths, "fp8_ds_mla")
    # causal, s_q 2: query 0 sees L - 1 keys, query 1 sees L
    assert flops == 2 * 128 * (576 + 512) * (9 + 10 + 0 + 1)
    assert nbytes == 11 * BYTES_PER_TOKEN["fp8_ds_mla"] + 2 * 2 * 128 * (576 * 2 + 512 * 2)
    flops, nbytes = bench.work(bench.SHAPES["M1"], lengths, "fp8_per_tensor")
    assert flops == 2 * 16 * (576 + 512) * 11
    assert nbytes == 11 * 576 + 2 * 16 * (576 + 512 * 2)


def test_rotation_sets_and_tables():
    shape = bench.SHAPES["M1"]
    assert bench.rotation_sets(shape, np.full(128, 8192), bench.L2_BYTES) == 1
    small = np.array([100, 64, 1], np.int32)
    sets = bench.rotation_sets(shape, small, bench.L2_BYTES)
    assert sets == bench.MAX_ROTATION_SETS
    assert bench.rotation_sets(shape, small, 0) == 1
    _, latent, tables = bench.build_problem(shape, small, 3, np.random.default_rng(0), jax.random.key(0))
    tables = np.asarray(tables)
    pages = [2, 1, 1]
    assert latent.shape[0] == 3 * sum(pages) and tables.shape == (3, 3, 2)
    used = [tables[s, i, :n] for s in range(3) for i, n in enumerate(pages)]
    assert sorted(np.concatenate(used).tolist()) == list(range(3 * sum(pages)))  # sets own disjoint pages


@pytest.mark.parametrize("hlo, expected", [
    ("%p = f8e4m3fn[8,8]{1,0} parameter(0)\n%q = f8e4m3fn[8,8]{1,0} parameter(1)\n"
     "ROOT %d = f32[8,8]{1,0} dot(%p, %q), lhs_contracting_dims={1}", True),
    ("%p = bf16[8,8]{1,0} parameter(0)\nROOT %d = f32[8,8]{1,0} dot(%p, %p), lhs_contracting_dims={1}", False),
    ('%c = (f32[8,8]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8"', True),
])
def test_has_fp8_matmul(hlo, expected):
    assert bench.has_fp8_matmul(hlo) is expected


def test_accuracy_quick(tmp_path, capsys):
    csv_path = tmp_path / "accuracy.csv"
    accuracy.main(["--quick", "--batch", "1", "--seqlen", "128", "--heads", "4", "--csv", str(csv_path),
                   "--png", str(tmp_path / "a.png")])
    columns, rows = read_csv(csv_path)
    assert tuple(columns) == accuracy.CSV_COLUMNS
    assert len(rows) >= 9  # 3 data sets x 3 formats, reference path at least
    for r in rows:
        error, floor = float(r["rel_l2"]), float(r["floor_rel_l2"])
        assert math.isfinite(error) and 0 < error < 0.5, r
        assert math.isfinite(float(r["max_abs_dlse"])) and math.isfinite(float(r["ratio_to_readme"]))
        if r["format"] == "bf16":
            assert floor == 0 and error < 5e-3  # the bf16 latent is the truth; only out's rounding remains
        elif r["path"] == "reference":
            assert abs(error - floor) < 0.1 * floor  # f32 math on the dequantized data lands on the floor
    assert capsys.readouterr().out.splitlines()[-1].startswith("small_latent  fp8_ds_mla")


def test_accuracy_num_sms(tmp_path, capsys):
    """--num-sms reaches the scheduler (one partition: every sequence is one split-KV chunk); 0 is refused."""
    accuracy.main(["--quick", "--batch", "1", "--seqlen", "128", "--heads", "4", "--formats", "bf16",
                   "--datasets", "gaussian", "--num-sms", "1", "--csv", str(tmp_path / "a.csv"),
                   "--png", str(tmp_path / "a.png")])
    assert ", 1 scheduler SMs" in capsys.readouterr().out
    assert {r["num_sms"] for r in read_csv(tmp_path / "a.csv")[1]} == {"1"}
    with pytest.raises(SystemExit):
        accuracy.main(["--quick", "--num-sms", "0"])
    assert "argument --num-sms: expected a positive integer, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("main, argv, message", [
    (accuracy.main, ["--quick", "--batch", "0"], "argument --batch: expected a positive integer, got 0"),
    (accuracy.main, ["--quick", "--heads", "-4"], "argument --heads: expected a positive integer, got -4"),
    (accuracy.main, ["--quick", "--seqlen", "100"], "--seqlen must be a positive multiple of 64"),
    (bench.main, ["--quick", "--batch", "0"], "argument --batch: expected a positive integer, got 0"),
    (bench.main, ["--quick", "--iters", "x"], "argument --iters: expected a positive integer, got 'x'"),
    (main_job.main, ["--heads-k", "3"], r"--heads-q \(16\) must be a multiple of --heads-k \(3\)"),
    (main_job.main, ["--max-len", "0"], "argument --max-len: expected a positive integer, got 0"),
])
def test_bad_counts_are_usage_errors(main, argv, message, capsys):
    """A zero or negative count is refused by the argument parser, not run with a default or left to a traceback."""
    with pytest.raises(SystemExit):
        main(argv)
    assert re.search(message, capsys.readouterr().err)
