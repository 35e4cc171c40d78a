"""scripts/gpu_compare.sh without a GPU: a copy of the script runs in a scratch tree with two fake builds, a stub
nvidia-smi and a stub Python that records what it is asked to run. Checks the steps each build gets (the first build
is the baseline, only benched), that SKIP_BENCH=1 leaves every bench out, and that the table shows a span only where
the bench printed that column (with --trace; without it the same place holds TFLOPS), and that CHECK_GAIN checks only
a build whose loop figure beats the baseline's. The stub bench reports the installed module's contents as the loop
figure (500.0 for an empty one), so each fake build times as its test says."""

import os
import pathlib
import shutil
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gpu_compare.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

# The bench's table as jax_flash_mla.bench prints it: "span" follows "max" only with --trace.
STUB_PYTHON = r"""#!/usr/bin/env bash
echo "$*" >> "$CALLS"
case "$*" in
  *gpu_test_share*) echo "2 0.4" ;;
  *jax_flash_mla.bench*)
    us=$(cat jax_flash_mla/_jax_flash_mla.so); us=${us:-500.0}
    if [[ "$*" == *--trace* ]]; then
      printf 'shape format path us min max span TFLOPS\nC1 bf16 kernel %s 490.0 510.0 450.5 99\n' "$us"
    else
      printf 'shape format path us min max TFLOPS GB/s\nC1 bf16 kernel %s 490.0 510.0 99 2000\n' "$us"
    fi ;;
  *pytest*) echo "3 passed in 1.00s" ;;
esac
"""


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "scripts" / "gpu_compare.sh")
    (root / "jax_flash_mla").mkdir()
    for name in ("base", "cand", "fast", "slow"):
        (root / f".carry_{name}" / "jax_flash_mla").mkdir(parents=True)
        loop_us = {"fast": b"490.0", "slow": b"510.0"}.get(name, b"")
        (root / f".carry_{name}" / "jax_flash_mla" / "_jax_flash_mla.so").write_bytes(loop_us)
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'Stub GPU, 0, 1 MiB'\n")
    (stubs / "python").write_text(STUB_PYTHON)
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    return root, stubs, tmp_path / "calls.txt", tmp_path / "logs"


def run(tree, **env):
    root, stubs, calls, logs = tree
    full_env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", PYTHON=str(stubs / "python"),
                    CALLS=str(calls), COMPARE_LOGS=str(logs), BUILDS="base cand", FORMATS="bf16",
                    SKIP_RACECHECK="1", SHAPES="C1")
    full_env.update(env)
    full_env.pop("OUT", None)
    out = subprocess.run(["bash", str(root / "scripts" / "gpu_compare.sh")], env=full_env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    ran = calls.read_text().splitlines() if calls.exists() else []
    return out, ran


def summary(out):
    return out.split("==== summary\n", 1)[1].splitlines()


def test_baseline_is_benched_and_the_candidate_checked(tree):
    out, ran = run(tree)
    assert summary(out)[:2] == ["base: bench rc=0",
                                "cand: smoke ok; tests rc=0 (3 passed in 1.00s); bench rc=0"]
    assert sum("jax_flash_mla.bench" in c for c in ran) == 2
    assert sum("-m pytest" in c for c in ran) == 1


def test_skip_bench_runs_no_bench(tree):
    out, ran = run(tree, SKIP_BENCH="1")
    assert summary(out)[:2] == ["base:", "cand: smoke ok; tests rc=0 (3 passed in 1.00s);"]
    assert not any("jax_flash_mla.bench" in c for c in ran)
    assert sum("-m pytest" in c for c in ran) == 1


@pytest.mark.parametrize("bench_args, span", [("", "-"), ("--trace /tmp/trace", "450.5")])
def test_table_shows_a_span_only_from_the_span_column(tree, bench_args, span):
    out, _ = run(tree, BENCH_ARGS=bench_args)
    rows = [line.split() for line in out.splitlines() if line.startswith("  base ")]
    assert rows and all(row[1:4] == ["C1", "bf16", "500.0"] and row[-2:] == ["span", span] for row in rows)


def test_check_gain_checks_only_a_faster_build_after_every_bench(tree):
    out, ran = run(tree, BUILDS="base fast slow base", CHECK_GAIN="0.995")
    assert summary(out)[:6] == [
        "base: bench rc=0",
        "fast: smoke ok; bench rc=0",
        "slow: smoke ok; bench rc=0",
        "base.3: bench rc=0",
        "fast (loop / baseline's: C1 bf16 0.9800): tests rc=0 (3 passed in 1.00s);",
        "slow (loop / baseline's: C1 bf16 1.0200): no checks (a loop ratio not below 0.995)",
    ]
    steps = [("bench" if "jax_flash_mla.bench" in c else "tests") for c in ran
             if "jax_flash_mla.bench" in c or "-m pytest" in c]
    assert steps == ["bench"] * 4 + ["tests"]


def test_check_gain_needs_the_whole_margin(tree):
    root = tree[0]
    (root / ".carry_fast" / "jax_flash_mla" / "_jax_flash_mla.so").write_bytes(b"498.0")
    out, ran = run(tree, BUILDS="base fast", CHECK_GAIN="0.995")
    assert summary(out)[2] == "fast (loop / baseline's: C1 bf16 0.9960): no checks (a loop ratio not below 0.995)"
    assert not any("-m pytest" in c for c in ran)
