"""scripts/decode_case.py, the random single case of profile_decode.py and trace_pipeline.py: every format builds and
runs (here on the reference path), with nonzero inputs and the shape's output layout."""

import importlib.util
import pathlib

import numpy as np
import pytest

from jax_flash_mla.bench import SHAPES

_spec = importlib.util.spec_from_file_location(
    "decode_case", pathlib.Path(__file__).resolve().parents[1] / "scripts" / "decode_case.py")
decode_case = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decode_case)


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_per_tensor", "fp8_ds_mla"])
@pytest.mark.parametrize("shape", ["M1", "C2"])
def test_random_case_runs_on_nonzero_inputs(kv_format, shape):
    decode, args = decode_case.random_decode_case(kv_format, SHAPES[shape], 2, 100, implementation="reference")
    q, cache, table, lengths, meta, scales = args
    assert float(np.abs(np.asarray(q, np.float32)).max()) > 0
    assert sorted(np.asarray(table).ravel().tolist()) == list(range(table.size))  # every page once, shuffled
    assert set(scales) == ({"descale_q", "descale_k"} if kv_format == "fp8_per_tensor" else set())
    out, lse = decode(*args)
    s = SHAPES[shape]
    assert out.shape == (2, s.seqlen_q, s.heads_q, 512) and lse.shape == (2, s.heads_q, s.seqlen_q)
    assert np.isfinite(np.asarray(out, np.float32)).all() and np.abs(np.asarray(out, np.float32)).sum() > 0
