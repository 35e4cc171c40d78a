"""scripts/gpu_multi_check.py (issue 7's two-GPU run) on two of the 8 CPU devices with the jnp reference: its
attention and example checks pass for a supported strategy, and fail when what they compare disagrees."""

import importlib.util
import pathlib

import jax
import pytest

_spec = importlib.util.spec_from_file_location(
    "gpu_multi_check", pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gpu_multi_check.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

pytestmark = pytest.mark.skipif(len(jax.devices("cpu")) < 2, reason="needs 2 CPU devices (tests/conftest.py)")
ARGS = ["--platform", "cpu", "--implementation", "reference", "--skip-timing", "--formats", "bf16", "--steps", "1"]


@pytest.mark.parametrize("strategy", ["heads", "batch"])
def test_sharded_decode_checks_pass(strategy, capsys):
    assert check.main(ARGS + ["--strategies", strategy]) == 0
    table = capsys.readouterr().out.splitlines()[-2:]
    assert all(" ok " in row for row in table), table
    assert "bitwise=True collectives=none" in table[0]


def test_example_check_fails_when_logits_differ():
    # No tolerance at all: the heads strategy's all-reduce reorders sums, so the logits differ in the last bits.
    assert check.main(ARGS + ["--strategies", "heads", "--logits-rtol", "0"]) == 1
