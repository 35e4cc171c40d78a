"""scripts/gpu_test_share.py: how the GPU scripts split one card among pytest workers. Every worker keeps the ~8.4
GiB it has on an H200, where all GPU tests pass, and the workers' CUDA contexts keep at least 11 GiB (session 31: 15
workers at 0.9 of an H100 failed every allocation)."""

import importlib.util
import pathlib

import pytest

_spec = importlib.util.spec_from_file_location(
    "gpu_test_share", pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gpu_test_share.py")
gpu_test_share = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_test_share)

H200_GIB = 143771 / 1024  # nvidia-smi's memory.total, MiB
H100_GIB = 81559 / 1024


@pytest.mark.parametrize("gib, workers, fraction", [
    (H200_GIB, 15, 0.06),   # 0.9 of the card in all: what the H200 runs have used
    (H100_GIB, 8, 0.105),   # 0.84 in all, 12.4 GiB left
    (0.0, 4, 0.225),        # no nvidia-smi: the old default
])
def test_defaults_from_the_card(gib, workers, fraction):
    n, f = gpu_test_share.share(gib)
    assert (n, f) == (workers, fraction)
    if gib:
        assert f * gib >= 8.3                                     # each worker ~8.4 GiB (f is rounded)
        assert gib * (1 - n * f) >= gpu_test_share.GIB_FOR_CONTEXTS  # room for the contexts


def test_overrides():
    assert gpu_test_share.share(H200_GIB, workers="8") == (8, 0.06)
    assert gpu_test_share.share(H100_GIB, total="0.8") == (8, 0.1)
    assert gpu_test_share.share(H100_GIB, workers="1", total="0.9") == (1, 0.9)
