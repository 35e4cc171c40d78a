"""scripts/loop_excess.py (reads the bench's CSVs): the excess of the timed loop over the profiled span, and the
tensor load it is ranked by, on rows whose values are known."""

import csv
import importlib.util
import pathlib

import pytest

_spec = importlib.util.spec_from_file_location(
    "loop_excess", pathlib.Path(__file__).resolve().parents[1] / "scripts" / "loop_excess.py")
loop_excess = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(loop_excess)

COLUMNS = ("shape", "format", "path", "us_median", "loop_overhead_us", "span_us", "tflops", "bf16_gemm_tflops",
           "fp8_gemm_tflops")


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow(dict(zip(COLUMNS, row)))


def test_excess_and_tensor_load(tmp_path):
    path = tmp_path / "bench_main.csv"
    # bf16: 600 TFLOPS at a 550 µs loop is 660 TFLOPS at the 500 µs span, 0.94 of the 700 bf16 GEMM rate.
    # fp8_per_tensor: 330 µs span at 400 TFLOPS per its 360 µs loop: 436.4 TFLOPS, 0.3636 of the 1200 FP8 rate.
    write_csv(path, [
        ("C1", "bf16", "kernel", 550.0, 20.0, 500.0, 600.0, 700.0, 1200.0),
        ("C1", "fp8_per_tensor", "kernel", 360.0, 20.0, 330.0, 400.0, 700.0, 1200.0),
        ("C1", "bf16", "reference", 3000.0, 20.0, "", 100.0, 700.0, 1200.0),  # no span: left out
    ])
    rows = loop_excess.excess_rows(str(path))
    assert [r[:3] for r in rows] == [("bench_main", "C1", "bf16"), ("bench_main", "C1", "fp8_per_tensor")]
    bf16, fp8 = rows
    assert bf16[6] == pytest.approx(30.0) and bf16[7] == pytest.approx(0.06) and bf16[8] == pytest.approx(660 / 700)
    assert fp8[6] == pytest.approx(10.0) and fp8[8] == pytest.approx(400 * 360 / 330 / 1200)


def test_cli_sorts_by_load_and_fails_without_spans(tmp_path, capsys):
    path = tmp_path / "b.csv"
    write_csv(path, [
        ("C2", "bf16", "kernel", 1000.0, 15.0, 900.0, 580.0, 700.0, 1300.0),
        ("M1", "bf16", "kernel", 310.0, 15.0, 290.0, 120.0, 700.0, 1300.0),
    ])
    assert loop_excess.main([str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[1] == "M1" and lines[2].split()[1] == "C2"
    empty = tmp_path / "none.csv"
    write_csv(empty, [("C1", "bf16", "kernel", 550.0, 20.0, "", 600.0, 700.0, 1200.0)])
    assert loop_excess.main([str(empty)]) == 1
