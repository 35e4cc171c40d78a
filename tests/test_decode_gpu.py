"""The Hopper BF16 decode kernel against the jnp reference, on an sm_90 GPU.

Skipped without a CUDA sm_90 device or without the built bf16 kernel (CPU CI). The H200 runs it through
scripts/gpu_check.sh.

Coverage: a hand-picked subset of b ∈ {1, 2, 6, 64} × s_q ∈ {1, 2, 4} × s_k ∈ {20, 140, 4096, varlen} ×
h_q ∈ {1, 3, 9, 16, 63, 64, 126, 128} × h_kv ∈ {1, 2, 8} × causal, chosen so that every value of each axis appears,
together with: padded row tiles (rows not a multiple of 64: 1, 3, 9, 16, 63, 126, 252), several row tiles per KV
head (126 x 2 = 252 rows), sequences split over many partitions (s_k 4096 with small b) and single-split ones,
zero-length sequences, causal rows that see no key (len < s_q), pages with a partial tail, shuffled block tables with
garbage (2147480000) past the used pages, and NaN in every unused cache slot (tests/oracle.py).

Tolerances (bf16 kernel, fp32 reference): the kernel rounds P to bf16 before P·V and the output to bf16; both give
relative errors of ~2^-9 per element that average out, so the output's rel-L2 error is ~1e-3 and the cosine
difference 1 - 2<x,y>/(|x|²+|y|²) ≈ rel²/2 ~ 1e-6: the bound 1e-5 (FlashMLA's) holds with margin. lse only sees fp32
sums of exponentials of fp32 scores (no bf16 rounding), so |Δlse| ≤ 1e-5·max(1, |lse|) is also safe.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_flash_mla as fm
from jax_flash_mla import _ffi

from oracle import SOFTMAX_SCALE, make_decode_inputs

pytestmark = pytest.mark.skipif(
    "bf16" not in fm.kernel_formats(),
    reason="needs a CUDA sm_90 device and the built bf16 decode kernel",
)

COS_TOL = 1e-5
LSE_TOL = 1e-5

# (b, s_q, h_q, h_kv, seqlens, causal); seqlens: an int (all equal) or a list (varlen).
CASES = [
    (1, 1, 1, 1, 20, False),
    (1, 2, 3, 1, 140, True),
    (2, 1, 9, 1, [140, 20], False),
    (2, 4, 16, 2, [140, 3], True),  # len 3 < s_q 4: causal row 0 sees no key
    (6, 2, 9, 1, [0, 140, 20, 4096, 1, 64], True),  # zero-length, one-token and exactly-one-page sequences
    (6, 1, 63, 1, [4096, 0, 4096, 77, 129, 4033], False),
    (2, 1, 64, 8, 4096, False),
    (2, 4, 128, 8, [140, 4096], True),  # 64 rows per KV head
    (6, 2, 126, 1, [20, 4096, 140, 0, 1000, 2049], True),  # 252 rows: 4 row tiles, the last padded
    (6, 1, 126, 2, [4096, 20, 140, 333, 64, 65], False),
    (64, 1, 128, 1, 4096, False),
    (64, 2, 16, 1, "varlen", True),
    (64, 4, 3, 1, "varlen", False),
    (64, 1, 64, 2, 140, False),
    (1, 4, 128, 1, 4096, True),  # one long sequence over every partition
    (2, 1, 16, 1, [0, 0], False),  # nothing to attend at all
]


def _seqlens(rng, b, spec):
    if spec == "varlen":
        lens = rng.integers(1, 4097, size=b)
        lens[rng.choice(b, size=max(1, b // 16), replace=False)] = 0
        return lens.astype(np.int32)
    if isinstance(spec, int):
        return np.full(b, spec, np.int32)
    return np.asarray(spec, np.int32)


def _run(inp, causal, implementation):
    args, kwargs = inp.kernel_args()
    return jax.block_until_ready(fm.flash_mla_with_kvcache(
        *args, softmax_scale=SOFTMAX_SCALE, causal=causal, implementation=implementation, **kwargs))


def _cos_diff(x, y):
    x = x.astype(np.float64).ravel()
    y = y.astype(np.float64).ravel()
    denom = (x * x + y * y).sum()
    return 0.0 if denom == 0 else 1.0 - 2.0 * (x * y).sum() / denom


def _check(out, lse, ref_out, ref_lse):
    out = np.asarray(out.astype(jnp.float32))
    ref_out = np.asarray(ref_out.astype(jnp.float32))
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    # Every row written and finite (XLA may hand over uninitialized memory: a missed row shows as garbage/NaN).
    assert np.isfinite(out).all(), "non-finite output"
    assert not np.isnan(lse).any() and not np.isneginf(lse).any(), "lse NaN or -inf"
    # Rows that see no key: out exactly 0 and lse +inf, and only those.
    empty = np.isposinf(ref_lse)  # [b, h_q, s_q]
    np.testing.assert_array_equal(np.isposinf(lse), empty)
    empty_rows = np.transpose(empty, (0, 2, 1))  # [b, s_q, h_q]
    assert (out[empty_rows] == 0).all(), "rows without keys must be exactly 0"
    assert _cos_diff(out, ref_out) <= COS_TOL, f"cos diff {_cos_diff(out, ref_out):.3e}"
    seen = ~empty
    err = np.abs(lse[seen] - ref_lse[seen]) / np.maximum(1.0, np.abs(ref_lse[seen]))
    assert err.size == 0 or err.max() <= LSE_TOL, f"lse rel err {err.max():.3e}"


@pytest.mark.parametrize("b, s_q, h_q, h_kv, seqlens, causal", CASES)
def test_kernel_matches_reference(b, s_q, h_q, h_kv, seqlens, causal):
    rng = np.random.default_rng(hash((b, s_q, h_q, h_kv, str(seqlens), causal)) % 2**32)
    inp = make_decode_inputs(rng, b=b, s_q=s_q, h_q=h_q, h_kv=h_kv, seqlens=_seqlens(rng, b, seqlens),
                             kv_format="bf16")
    out, lse = _run(inp, causal, "kernel")
    ref_out, ref_lse = _run(inp, causal, "reference")
    _check(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("dist", ["rope_outliers", "small_latent"])
def test_kernel_other_distributions(dist):
    rng = np.random.default_rng(7)
    inp = make_decode_inputs(rng, b=6, s_q=2, h_q=64, h_kv=1, seqlens=_seqlens(rng, 6, "varlen"),
                             kv_format="bf16", dist=dist)
    out, lse = _run(inp, True, "kernel")
    ref_out, ref_lse = _run(inp, True, "reference")
    _check(out, lse, ref_out, ref_lse)


def test_kernel_deterministic():
    rng = np.random.default_rng(3)
    inp = make_decode_inputs(rng, b=6, s_q=2, h_q=128, h_kv=1, seqlens=_seqlens(rng, 6, "varlen"), kv_format="bf16")
    a = _run(inp, True, "kernel")
    b = _run(inp, True, "kernel")
    for x, y in zip(a, b):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_kernel_path_is_lowered():
    """The kernel path really is a custom call to the bf16 handler, not the jnp fallback."""
    rng = np.random.default_rng(4)
    inp = make_decode_inputs(rng, b=2, s_q=1, h_q=16, h_kv=1, seqlens=np.array([100, 7], np.int32),
                             kv_format="bf16")
    args, kwargs = inp.kernel_args()
    fn = jax.jit(lambda *a: fm.flash_mla_with_kvcache(*a, softmax_scale=SOFTMAX_SCALE, implementation="kernel",
                                                       **kwargs))
    text = fn.lower(*args).as_text()
    assert _ffi.decode_target("bf16") == "jax_flash_mla_decode_bf16"
    assert "jax_flash_mla_decode_bf16" in text
    ref_text = jax.jit(lambda *a: fm.flash_mla_with_kvcache(*a, softmax_scale=SOFTMAX_SCALE,
                                                            implementation="reference", **kwargs)).lower(*args).as_text()
    assert "jax_flash_mla_decode_bf16" not in ref_text


def test_kernel_with_precomputed_metadata_under_jit():
    rng = np.random.default_rng(5)
    b, s_q, h_q = 6, 2, 128
    inp = make_decode_inputs(rng, b=b, s_q=s_q, h_q=h_q, h_kv=1, seqlens=_seqlens(rng, b, "varlen"),
                             kv_format="bf16")
    args, kwargs = inp.kernel_args()
    meta = fm.get_mla_metadata(args[3], s_q * h_q, 1)
    fn = jax.jit(lambda q, k, t, l, m: fm.flash_mla_with_kvcache(q, k, t, l, 512, m, softmax_scale=SOFTMAX_SCALE,
                                                                 causal=True, implementation="kernel", **kwargs))
    out, lse = fn(*args, meta)
    ref_out, ref_lse = _run(inp, True, "reference")
    _check(out, lse, ref_out, ref_lse)
