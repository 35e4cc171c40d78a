"""The FP8 kernels' ldmatrix / stmatrix lane mappings (V^T transpose, P store), replayed on the host by
scripts/emulate_vt_transpose.py: data lands where the P V WGMMA expects it, and no access conflicts on banks."""

import importlib.util
import pathlib

import numpy as np
import pytest

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "emulate_vt_transpose.py"
_spec = importlib.util.spec_from_file_location("emulate_vt_transpose", _SCRIPT)
emu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(emu)


def test_p_column_is_a_pairwise_permutation_of_each_16_tokens():
    cols = [emu.p_column(t) for t in range(64)]
    assert sorted(cols) == list(range(64))
    assert all(c // 16 == t // 16 for t, c in enumerate(cols))
    assert all(cols[t + 1] == cols[t] + 1 for t in range(0, 64, 2))


# The K slot's swizzle: 64-byte boxes for fp8_per_tensor, 128-byte for fp8_ds_mla.
SLOT_SWIZZLES = pytest.mark.parametrize("slot_swizzle", [64, 128], ids=["fp8_per_tensor", "fp8_ds_mla"])


@SLOT_SWIZZLES
@pytest.mark.parametrize("wg", [0, 1])
@pytest.mark.parametrize("valid", [64, 100, 37, 16, 1, 0])
def test_transpose_v(wg, valid, slot_swizzle):
    emu.run(wg, valid, np.random.default_rng(valid), slot_swizzle)


@pytest.mark.parametrize("tokens_per_wg", [64, 32])  # fp8_per_tensor (page owner), fp8_ds_mla (each WG half)
def test_store_p(tokens_per_wg):
    emu.run_store_p(tokens_per_wg, np.random.default_rng(tokens_per_wg))


@SLOT_SWIZZLES
@pytest.mark.parametrize("valid", [64, 100, 37, 33, 1, 0])
def test_narrow_v_fragments_and_p_store(valid, slot_swizzle):
    emu.run_narrow(valid, np.random.default_rng(valid), slot_swizzle)
