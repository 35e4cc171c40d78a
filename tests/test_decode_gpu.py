"""The Hopper decode kernels (bf16, fp8_per_tensor, fp8_ds_mla) against the jnp reference, on an sm_90 GPU.

Every test is parametrized by cache format; a format whose kernel was not built (JAX_FLASH_MLA_DISABLE_FP8) skips,
and the whole module skips without a CUDA sm_90 device (CPU CI), unless JAX_FLASH_MLA_REQUIRE_GPU=1. The H200 runs
it through scripts/gpu_check.sh; `-k fp8_per_tensor` selects one format, `-m few_rows` the cases with at most 16
query rows per KV head.

Coverage: a hand-picked subset of b ∈ {1, 2, 6, 64} × s_q ∈ {1, 2, 4} × s_k ∈ {20, 140, 4096, varlen} ×
h_q ∈ {1, 3, 9, 16, 63, 64, 126, 128} × h_kv ∈ {1, 2, 8} × causal, chosen so that every value of each axis appears,
together with: padded row tiles (rows not a multiple of 64: 1, 3, 9, 16, 63, 126, 252), several row tiles per KV
head (126 x 2 = 252 rows), sequences split over many partitions (s_k 4096 with small b) and single-split ones,
zero-length sequences, causal rows that see no key (len < s_q), pages with a partial tail, shuffled block tables with
garbage (2147480000) past the used pages, and NaN in every unused cache slot (tests/oracle.py). Shapes with at most
16 query rows per KV head (h_q 1 / 3 / 9 / 16 here, determinism and the other data sets at h_q 16) run the FP8
formats' few-rows kernel (consumer_narrow.cuh); bf16 runs its 64-row kernel on every shape.

Tolerances (bf16 kernel, fp32 reference): the kernel rounds P to bf16 before P·V and the output to bf16; both give
relative errors of ~2^-9 per element that average out, so the output's rel-L2 error is ~1e-3 and the cosine
difference 1 - 2<x,y>/(|x|²+|y|²) ≈ rel²/2 ~ 1e-6: the bound 1e-5 (FlashMLA's) holds with margin. lse only sees fp32
sums of exponentials of fp32 scores (no bf16 rounding), so |Δlse| ≤ 1e-5·max(1, |lse|) is also safe.

Tolerances (fp8_per_tensor kernel vs the format's fp32 reference, which dequantizes the same e4m3 q and cache): q·k is
exact in the kernel up to the FP8 WGMMA's accumulation (e4m3 × e4m3 products are exact; Hopper adds them with a
reduced-precision (~14-bit) aligned accumulator), so the only large difference is P: the kernel rounds P (≤ 1) to
e4m3 before P·V while the reference keeps fp32 P (both normalize by the fp32 row sum). e4m3 keeps 3 mantissa bits:
a relative error δ_j ≤ 2^-4 per probability (rms 2^-4/√3 ≈ 0.036; p_j = 1, the row maximum, is exact; p < 2^-6 is
subnormal, absolute error ≤ 2^-10, which the emulation below includes). The output error Σ δ_j p_j v_j / l against
out = Σ p_j v_j / l has, for nearly orthogonal V rows, rel-L2 ≈ sqrt(Σ δ_j² p_j²) / sqrt(Σ p_j²) ≤ 2^-4 = 0.0625;
a NumPy emulation (P rounded to e4m3, 64 heads, 20 / 140 / 4096 tokens) gives 1.4–2.1e-2 (gaussian), 0.4–0.6e-2
(rope outliers: peaked P, dominated by the exact maximum) and 2.3–2.8e-2 (small latent). Bound: rel-L2 ≤ 6e-2 (the
worst case 2^-4; a wrong transpose or scale gives ~1) and the cosine difference ≤ 2e-3 (≈ rel²/2 = 1.8e-3). lse
only sees the logits (P's rounding does not enter the fp32 row sums). Hopper's FP8 WGMMA keeps only ~14 bits when it
adds into the accumulator (DeepSeek-V3 report, §3.3.2), chained here over 18 k-steps of 32: even if every step
truncated the same way, the logit error stays ≤ 18·2^-14 ≈ 1.1e-3 of the accumulator's magnitude (~3e-4 when the
errors are random), and lse ≥ the largest logit, so |Δlse| ≤ 4e-3·max(1, |lse|) holds with a margin of ~3 in the
worst case. (The same logit error moves P by up to ~1e-3·|logit|, below the e4m3 rounding for |logits| < ~50.)

Tolerances (fp8_ds_mla kernel vs the format's fp32 reference, which uses the bf16 q on the dequantized cache): the
kernel (docs/NUMERICS.md, design A) also rounds q's NoPE channels to e4m3 with one power-of-two scale per row, and P
to e4m3 (scaled per group by k_scale·16/N_g, N_g the chunk's running largest scale, with p ≤ 16 under the lazy
rescale). The emulation puts that at rel-L2 ≈ 3.0e-2 / 1e-2 / 2.6e-2 (gaussian / rope outliers / small latent: sqrt
of F1² − F0² in NUMERICS.md) against the reference; the P rounding alone is bounded by 2^-4 per probability as for
fp8_per_tensor. Bound: rel-L2 ≤ 6e-2, cosine difference ≤ 2e-3.
lse moves with the q rounding by up to max_j |Δs_j| (lse is 1-Lipschitz in the scores): over thousands of keys that
averages to ~5e-3 (NUMERICS.md, Fq − F0), but a causal row that sees 1–3 keys keeps its few scores' full error, and
the first H200 run measured |Δlse| / max(1, |lse|) = 4.7e-2 and 4.9e-2 on two such rows. So lse is compared with
the same reference run on the q the kernel computes with (oracle.round_q_like_ds_mla_kernel): what remains is the
FP8 accumulation of q·k, as for fp8_per_tensor (each 128-channel group's partial sum is promoted to fp32 exactly, so
4 k-steps of 32 per group instead of 18 chained ones): |Δlse| ≤ 4e-3·max(1, |lse|). The output keeps the format's
reference (the contract with the user), where the q and P rounding give the bound above.

Against float64 on the UNquantized data (test_fp8_per_tensor_error_vs_unquantized_oracle) the error is the format's:
per-tensor scales lose the NoPE channels' precision when RoPE carries outliers (README §4: 2.4e-1 emulated, 2.3e-1
for FlashMLA PR #54's kernel). The test prints the measured rel-L2 (shown with pytest -rP) and asserts it stays
within 1.5x of those figures (jax_flash_mla/accuracy.py's REGRESSION_FACTOR); it documents this error, it does not
hide it.
"""

from __future__ import annotations

import math
import os
import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_flash_mla as fm
from jax_flash_mla import _ffi, hlo

from jax_flash_mla.accuracy import README_EMULATION, README_KERNEL, REGRESSION_FACTOR
import stale_schedules
from oracle import (GARBAGE_BLOCK, SOFTMAX_SCALE, make_decode_inputs, oracle_decode, round_q_like_ds_mla_kernel,
                    with_scales_not_powers_of_two, with_token_scales)

# JAX_FLASH_MLA_REQUIRE_GPU=1 (scripts/gpu_check.sh) turns the skips into failures: a format that did not build or
# load then fails its tests instead of passing them silently. FP8 formats left out on purpose
# (JAX_FLASH_MLA_DISABLE_FP8, recorded in the extension's build_info) still skip.
REQUIRE_GPU = os.environ.get("JAX_FLASH_MLA_REQUIRE_GPU") == "1"


USABLE = fm.kernel_formats()


def _runs(kv_format):
    """Whether the tests of kv_format run (else they skip)."""
    if kv_format in USABLE:
        return True
    return REQUIRE_GPU and not (kv_format != "bf16" and _ffi.build_info().get("fp8_disabled", False))


pytestmark = pytest.mark.skipif(
    not REQUIRE_GPU and not USABLE,
    reason="needs a CUDA sm_90 device and a built decode kernel",
)

# Per format: cosine difference, rel-L2 of out (None: not checked), |Δlse| / max(1, |lse|) (fp8_ds_mla: against the
# reference on the kernel's rounded q, _references). Module docstring.
TOLS = {
    "bf16": dict(cos=1e-5, rel_l2=None, lse=1e-5),
    "fp8_per_tensor": dict(cos=2e-3, rel_l2=6e-2, lse=4e-3),
    "fp8_ds_mla": dict(cos=2e-3, rel_l2=6e-2, lse=4e-3),
}


def _format_param(kv_format):
    return pytest.param(kv_format, id=kv_format, marks=pytest.mark.skipif(
        not _runs(kv_format), reason=f"the {kv_format} decode kernel is not usable here (not built, or no sm_90)"))


FORMATS = [_format_param(f) for f in TOLS]

# Query rows per KV head up to which the FP8 formats run their few-rows kernel (Traits::kNarrowRows, which the
# launcher compares with q_rows_per_head_k).
FEW_ROWS = 16
# `-m few_rows` selects the cases of that kernel.
few_rows = pytest.mark.few_rows


def _case(b, s_q, h_q, h_kv, seqlens, causal):
    marks = [few_rows] if s_q * h_q // h_kv <= FEW_ROWS else []
    return pytest.param(b, s_q, h_q, h_kv, seqlens, causal, marks=marks)


# (b, s_q, h_q, h_kv, seqlens, causal); seqlens: an int (all equal) or a list (varlen).
CASES = [_case(*case) for case in [
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
    # M1's rows with its long sequences: ~31 pages per partition, the long chunks where the few-rows kernels'
    # per-WG k_full sets matter (a shared set let a wait pass on a stale phase: docs/DESIGN.md, "Few query rows").
    (32, 1, 16, 1, 8192, False),
]]


def _seqlens(rng, b, spec):
    if spec == "varlen":
        lens = rng.integers(1, 4097, size=b)
        lens[rng.choice(b, size=max(1, b // 16), replace=False)] = 0
        return lens.astype(np.int32)
    if isinstance(spec, int):
        return np.full(b, spec, np.int32)
    return np.asarray(spec, np.int32)


def _run(inp, causal, implementation, **extra):
    args, kwargs = inp.kernel_args()
    return jax.block_until_ready(fm.flash_mla_with_kvcache(
        *args, softmax_scale=SOFTMAX_SCALE, causal=causal, implementation=implementation, **kwargs, **extra))


def _references(inp, causal):
    """(out, lse) to check the kernel against: the format's jnp reference; for fp8_ds_mla the lse comes from that
    reference on the q the kernel rounds to e4m3 (module docstring)."""
    ref_out, ref_lse = _run(inp, causal, "reference")
    if inp.kv_format == "fp8_ds_mla":
        (_, *rest), kwargs = inp.kernel_args()
        # bf16, as the format's q must be: e4m3 codes times a power of two and the RoPE channels as given are exact.
        rounded_q = jax.device_put(round_q_like_ds_mla_kernel(inp.q).astype(jnp.bfloat16))
        _, ref_lse = jax.block_until_ready(fm.mla_decode_reference(
            rounded_q, *rest, softmax_scale=SOFTMAX_SCALE, causal=causal, **kwargs))
    return ref_out, ref_lse


def _cos_diff(x, y):
    x = x.astype(np.float64).ravel()
    y = y.astype(np.float64).ravel()
    denom = (x * x + y * y).sum()
    return 0.0 if denom == 0 else 1.0 - 2.0 * (x * y).sum() / denom


def _rel_l2(x, y):
    x = x.astype(np.float64).ravel()
    y = y.astype(np.float64).ravel()
    den = np.linalg.norm(y)
    return float(np.linalg.norm(x - y)) if den == 0 else float(np.linalg.norm(x - y) / den)


def _check(out, lse, ref_out, ref_lse, kv_format):
    tol = TOLS[kv_format]
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
    assert _cos_diff(out, ref_out) <= tol["cos"], f"cos diff {_cos_diff(out, ref_out):.3e}"
    if tol["rel_l2"] is not None:
        assert _rel_l2(out, ref_out) <= tol["rel_l2"], f"rel-L2 {_rel_l2(out, ref_out):.3e}"
    seen = ~empty
    err = np.abs(lse[seen] - ref_lse[seen]) / np.maximum(1.0, np.abs(ref_lse[seen]))
    assert err.size == 0 or err.max() <= tol["lse"], f"lse rel err {err.max():.3e}"


@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("b, s_q, h_q, h_kv, seqlens, causal", CASES)
def test_kernel_matches_reference(b, s_q, h_q, h_kv, seqlens, causal, kv_format):
    # crc32, not hash(): str hashes are salted per process, and a failing case must reproduce.
    rng = np.random.default_rng(zlib.crc32(repr((b, s_q, h_q, h_kv, seqlens, causal)).encode()))
    inp = make_decode_inputs(rng, b=b, s_q=s_q, h_q=h_q, h_kv=h_kv, seqlens=_seqlens(rng, b, seqlens),
                             kv_format=kv_format)
    out, lse = _run(inp, causal, "kernel")
    ref_out, ref_lse = _references(inp, causal)
    _check(out, lse, ref_out, ref_lse, kv_format)


# The combine's two kernels (cpp/kernels/smxx/combine.cu), reached through get_mla_metadata's num_sms: the deep one
# for a few sequences with many splits each (the first two cases; the first has more than its 256-split weight
# tile), the rows one for many sequences with a few splits (h_kv 2 in the last). Causal rows 0 of short splits see
# no key there, so some partials are -inf and must not be read. (b, s_q, h_q, h_kv, seqlens, causal, num_sms, the
# least largest split count that makes the case what it says.)
COMBINE_CASES = [
    (1, 1, 16, 1, [40000], False, 600, 257),
    (2, 2, 3, 1, [20000, 3000], True, 264, 100),
    (40, 2, 3, 1, "varlen", True, 132, 4),
    (24, 1, 32, 2, "varlen", False, 132, 3),
]


@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("b, s_q, h_q, h_kv, seqlens, causal, num_sms, min_splits", COMBINE_CASES)
def test_combine_of_many_splits(b, s_q, h_q, h_kv, seqlens, causal, num_sms, min_splits, kv_format):
    rng = np.random.default_rng(zlib.crc32(repr((b, s_q, h_q, h_kv, seqlens, causal, num_sms)).encode()))
    inp = make_decode_inputs(rng, b=b, s_q=s_q, h_q=h_q, h_kv=h_kv, seqlens=_seqlens(rng, b, seqlens),
                             kv_format=kv_format)
    args, kwargs = inp.kernel_args()
    meta = fm.get_mla_metadata(args[3], s_q * h_q // h_kv, h_kv, num_sms=num_sms)
    assert np.diff(np.asarray(meta.num_splits)).max() >= min_splits
    out, lse = jax.block_until_ready(fm.flash_mla_with_kvcache(
        *args, 512, meta, softmax_scale=SOFTMAX_SCALE, causal=causal, implementation="kernel", **kwargs))
    ref_out, ref_lse = _references(inp, causal)
    _check(out, lse, ref_out, ref_lse, kv_format)


@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("dist", ["rope_outliers", "small_latent"])
@pytest.mark.parametrize("s_q, h_q", [(2, 64), pytest.param(1, 16, marks=few_rows)])  # 128 rows; 16 (M1-like)
def test_kernel_other_distributions(dist, s_q, h_q, kv_format):
    rng = np.random.default_rng(7)
    inp = make_decode_inputs(rng, b=6, s_q=s_q, h_q=h_q, h_kv=1, seqlens=_seqlens(rng, 6, "varlen"),
                             kv_format=kv_format, dist=dist)
    out, lse = _run(inp, True, "kernel")
    ref_out, ref_lse = _references(inp, True)
    _check(out, lse, ref_out, ref_lse, kv_format)


@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("s_q, h_q", [(2, 128), pytest.param(1, 16, marks=few_rows)])  # 256 rows (4 tiles); 16
def test_kernel_deterministic(s_q, h_q, kv_format):
    rng = np.random.default_rng(3)
    inp = make_decode_inputs(rng, b=6, s_q=s_q, h_q=h_q, h_kv=1, seqlens=_seqlens(rng, 6, "varlen"),
                             kv_format=kv_format)
    a = _run(inp, True, "kernel")
    b = _run(inp, True, "kernel")
    for x, y in zip(a, b):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


@pytest.mark.parametrize("kv_format", FORMATS)
def test_kernel_path_is_lowered(kv_format):
    """The kernel path really is a custom call to the format's handler, not the jnp fallback."""
    rng = np.random.default_rng(4)
    inp = make_decode_inputs(rng, b=2, s_q=1, h_q=16, h_kv=1, seqlens=np.array([100, 7], np.int32),
                             kv_format=kv_format)
    args, kwargs = inp.kernel_args()
    target = f"jax_flash_mla_decode_{kv_format}"
    fn = jax.jit(lambda *a: fm.flash_mla_with_kvcache(*a, softmax_scale=SOFTMAX_SCALE, implementation="kernel",
                                                       **kwargs))
    text = fn.lower(*args).as_text()
    assert _ffi.decode_target(kv_format) == target
    assert target in text
    ref_text = jax.jit(lambda *a: fm.flash_mla_with_kvcache(*a, softmax_scale=SOFTMAX_SCALE,
                                                            implementation="reference", **kwargs)).lower(*args).as_text()
    assert target not in ref_text


@pytest.mark.parametrize("kv_format", FORMATS)
def test_exported_kernel_step_runs(kv_format):
    """A decode step exported by jax.export with the kernels (fm.export_disabled_checks) runs them and gives bit for
    bit what the same step gives under jit (serialization itself: tests/test_export.py)."""
    rng = np.random.default_rng(6)
    inp = make_decode_inputs(rng, b=3, s_q=2, h_q=64, h_kv=1, seqlens=np.array([300, 0, 4096], np.int32),
                             kv_format=kv_format)
    args, kwargs = inp.kernel_args()
    step = jax.jit(lambda q, k, t, l: fm.flash_mla_with_kvcache(
        q, k, t, l, 512, fm.get_mla_metadata(l, 2 * 64, 1), softmax_scale=SOFTMAX_SCALE, causal=True,
        implementation="kernel", **kwargs))
    exported = jax.export.export(step, disabled_checks=fm.export_disabled_checks())(*args)
    assert _ffi.decode_target(kv_format) in exported.mlir_module()
    for got, want in zip(jax.block_until_ready(exported.call(*args)), step(*args)):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("s_q, h_q", [(2, 64), pytest.param(1, 16, marks=few_rows)])  # 128 rows; 16
def test_kernel_reads_pages_past_4gib(s_q, h_q, kv_format):
    """A serving cache is larger than 4 GiB: the same pages moved to the end of such a cache (every used page more
    than 2^32 bytes past its start; the blocks before them zero) give bit for bit the same results, so no byte
    offset of a page wraps at 32 bits."""
    rng = np.random.default_rng(8)
    inp = make_decode_inputs(rng, b=2, s_q=s_q, h_q=h_q, h_kv=1, seqlens=np.array([4096, 300], np.int32),
                             kv_format=kv_format)
    (q, small, table, seqlens), kwargs = inp.kernel_args()
    page_bytes = math.prod(small.shape[1:]) * small.dtype.itemsize
    offset = -(-(2**32 + 2**26) // page_bytes)
    # Built on the device in one buffer (jnp.zeros and the update fuse in place): ~4.4 GB, no host copy.
    big = jax.jit(lambda pages: jnp.zeros((offset + pages.shape[0], *pages.shape[1:]), pages.dtype)
                  .at[offset:].set(pages))(small)
    moved = jnp.where(table == GARBAGE_BLOCK, table, table + offset)
    run = lambda cache, block_table: jax.block_until_ready(fm.flash_mla_with_kvcache(
        q, cache, block_table, seqlens, softmax_scale=SOFTMAX_SCALE, causal=True, implementation="kernel", **kwargs))
    want = run(small, table)
    got = run(big, moved)
    del big
    for x, y in zip(got, want):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    ref_out, ref_lse = _references(inp, True)
    _check(*want, ref_out, ref_lse, kv_format)


@pytest.mark.parametrize("kv_format", FORMATS)
def test_kernel_reads_a_layer_of_stacked_caches_in_place(kv_format):
    """layer=: under lax.scan over three layers of a stacked cache, each layer's decode is bit for bit the kernel's
    decode of that layer's own cache, and the kernel's k_cache operand is a view of the scan's carried stack (a
    bitcast of its bytes, out of XLA:GPU's command buffer), not a materialized layer (tests/test_api.py and
    scripts/stacked_cache_copy.py: the carried stack with writes, on the CPU)."""
    rng = np.random.default_rng(9)
    layers = [make_decode_inputs(rng, b=3, s_q=2, h_q=64, h_kv=1, seqlens=np.array([300, 0, 1000], np.int32),
                                 kv_format=kv_format) for _ in range(3)]
    (q, _, table, seqlens), kwargs = layers[0].kernel_args()
    caches = jnp.stack([jnp.asarray(inp.kernel_args()[0][1]) for inp in layers])
    run = lambda cache, **extra: fm.flash_mla_with_kvcache(q, cache, table, seqlens, softmax_scale=SOFTMAX_SCALE,
                                                           causal=True, implementation="kernel", **kwargs, **extra)

    def step(caches):
        return jax.lax.scan(lambda c, l: (c, run(c, layer=l)), caches, jnp.arange(3))[1]

    compiled = jax.jit(step).lower(caches).compile()
    chain = hlo.custom_call_operand_chain(compiled, _ffi.decode_target(kv_format), 1)  # k_cache
    name, shape = chain[-1]
    assert hlo.opcode(compiled, name) in ("parameter", "get-tuple-element"), chain  # the carried buffer, no copy
    assert np.prod(shape) == caches.size, chain
    want = [run(caches[i]) for i in range(3)]
    outs, lses = compiled(caches)
    for i in range(3):
        assert np.asarray(outs[i]).tobytes() == np.asarray(want[i][0]).tobytes()
        assert np.asarray(lses[i]).tobytes() == np.asarray(want[i][1]).tobytes()


@pytest.mark.parametrize("kv_format", FORMATS)
def test_kernel_with_precomputed_metadata_under_jit(kv_format):
    rng = np.random.default_rng(5)
    b, s_q, h_q = 6, 2, 128
    # fp8_per_tensor: descales of shape [1] (PR #54's), traced under jit like q and the cache.
    inp = make_decode_inputs(rng, b=b, s_q=s_q, h_q=h_q, h_kv=1, seqlens=_seqlens(rng, b, "varlen"),
                             kv_format=kv_format, descale_shape=(1,))
    args, kwargs = inp.kernel_args()
    descales = (kwargs.pop("descale_q"), kwargs.pop("descale_k"))
    meta = fm.get_mla_metadata(args[3], s_q * h_q, 1)
    fn = jax.jit(lambda q, k, t, l, m, dq, dk: fm.flash_mla_with_kvcache(
        q, k, t, l, 512, m, softmax_scale=SOFTMAX_SCALE, causal=True, implementation="kernel", descale_q=dq,
        descale_k=dk, **kwargs))
    out, lse = fn(*args, meta, *descales)
    ref_out, ref_lse = _references(inp, True)
    _check(out, lse, ref_out, ref_lse, kv_format)


@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("schedule", stale_schedules.SCHEDULES, ids=lambda schedule: schedule.name)
@pytest.mark.parametrize("s_q, h_q", [(2, 64), pytest.param(1, 16, marks=few_rows)])
def test_kernel_with_stale_metadata_under_jit(s_q, h_q, schedule, kv_format):
    """Under jit nothing checks the metadata: one computed for other lengths (tests/stale_schedules.py: a step
    earlier, longer sequences split past where they now end, the batch's lengths permuted) still reads every key once
    (make_chunk: a sequence's last split ends at its length, a chunk past it reads no page), only less balanced. The
    last page of each sequence holds 4 keys at twice the latent, so that keys missed at the end fail the tolerances."""
    lens = stale_schedules.LENGTHS
    inp = make_decode_inputs(np.random.default_rng(29), b=lens.size, s_q=s_q, h_q=h_q, h_kv=1, seqlens=lens,
                             kv_format=kv_format, page_gain=stale_schedules.last_page_gain)
    args, kwargs = inp.kernel_args()
    meta = schedule.metadata(s_q * h_q)
    held = stale_schedules.hazards_held(meta.tile_scheduler_metadata, meta.num_splits, lens)
    assert set(schedule.hazards) <= held, (schedule.name, held)
    fn = jax.jit(lambda *a: fm.flash_mla_with_kvcache(*a[:4], 512, a[4], softmax_scale=SOFTMAX_SCALE, causal=True,
                                                      implementation="kernel", **kwargs))
    out, lse = jax.block_until_ready(fn(*args, meta))
    ref_out, ref_lse = _references(inp, True)
    _check(out, lse, ref_out, ref_lse, kv_format)


@pytest.mark.parametrize("dist", ["gaussian", "rope_outliers", "small_latent"])
@pytest.mark.skipif(not _runs("fp8_per_tensor"), reason="the fp8_per_tensor kernel is not usable here")
def test_fp8_per_tensor_error_vs_unquantized_oracle(dist):
    """Documents the format's error: the fp8 kernel against float64 on the data before quantization.

    The same seed draws the same latent, q and block table for both formats; the bf16 copy stands in for the
    unquantized data (its own rounding, ~1e-3 rel-L2, is far below the per-tensor error measured here).
    """
    b, s_q, h_q, h_kv, seqlens = 4, 1, 64, 1, np.full(4, 4096, np.int32)
    fp8 = make_decode_inputs(np.random.default_rng(11), b=b, s_q=s_q, h_q=h_q, h_kv=h_kv, seqlens=seqlens,
                             kv_format="fp8_per_tensor", dist=dist)
    raw = make_decode_inputs(np.random.default_rng(11), b=b, s_q=s_q, h_q=h_q, h_kv=h_kv, seqlens=seqlens,
                             kv_format="bf16", dist=dist)
    np.testing.assert_array_equal(fp8.block_table, raw.block_table)
    out, lse = _run(fp8, False, "kernel")
    ref_out, ref_lse = oracle_decode(raw.q64, raw.kv64, raw.block_table, raw.cache_seqlens, SOFTMAX_SCALE, False,
                                     h_kv)
    rel = _rel_l2(np.asarray(out.astype(jnp.float32)), ref_out)
    dlse = float(np.abs(np.asarray(lse, np.float64) - ref_lse).max())
    expected = max(README_EMULATION["fp8_per_tensor"][dist], README_KERNEL["fp8_per_tensor"][dist])
    print(f"[fp8_per_tensor vs float64, unquantized {dist}] rel-L2 {rel:.3e} (README §4: {expected:.1e}), "
          f"max |dlse| {dlse:.3e}")
    assert rel <= REGRESSION_FACTOR * expected, f"rel-L2 {rel:.3e} vs README {expected:.1e}"


# docs/NUMERICS.md, design A: the F1 floor (q e4m3 per 128 channels, P e4m3; batch 16, 4096 tokens, 64 heads) and
# A itself at 32768 tokens (batch 2), where an accumulator that drifts over a long P V chain would show (the
# emulation's e8m13 model without promotion, A-PV-noprom: 3.71e-2 / 4.41e-2).
DS_MLA_F1 = {"gaussian": 3.54e-2, "rope_outliers": 3.01e-2, "small_latent": 3.74e-2}
DS_MLA_A_32K = {"gaussian": 2.82e-2, "small_latent": 3.70e-2}
DS_MLA_FACTOR, DS_MLA_CAP = 1.1, 4e-2


def _ds_mla_vs_oracle(dist, b, seqlen, metadata_num_sms=None, ds_scales="group"):
    """rel-L2 and max |dlse| of the fp8_ds_mla kernel (the decoder ds_scales names, on a cache quantized with those
    scales) against float64 on the unquantized (bf16) data, plus the rel-L2 against the format's jnp reference."""
    h_q, seqlens = 64, np.full(b, seqlen, np.int32)
    ds = make_decode_inputs(np.random.default_rng(13), b=b, s_q=1, h_q=h_q, h_kv=1, seqlens=seqlens,
                            kv_format="fp8_ds_mla", dist=dist, ds_scales=ds_scales)
    raw = make_decode_inputs(np.random.default_rng(13), b=b, s_q=1, h_q=h_q, h_kv=1, seqlens=seqlens,
                             kv_format="bf16", dist=dist)
    np.testing.assert_array_equal(ds.block_table, raw.block_table)
    args, kwargs = ds.kernel_args()
    meta = None
    if metadata_num_sms is not None:
        meta = fm.get_mla_metadata(args[3], h_q, 1, num_sms=metadata_num_sms)
    out, lse = jax.block_until_ready(fm.flash_mla_with_kvcache(
        *args, 512, meta, softmax_scale=SOFTMAX_SCALE, causal=False, implementation="kernel", ds_scales=ds_scales,
        **kwargs))
    ref_out, _ = _run(ds, False, "reference")
    out = np.asarray(out.astype(jnp.float32))
    truth_out, truth_lse = oracle_decode(raw.q64, raw.kv64, raw.block_table, raw.cache_seqlens, SOFTMAX_SCALE,
                                         False, 1)
    rel = _rel_l2(out, truth_out)
    dlse = float(np.abs(np.asarray(lse, np.float64) - truth_lse).max())
    return rel, dlse, _rel_l2(out, np.asarray(ref_out.astype(jnp.float32)))


@pytest.mark.parametrize("ds_scales", ["group", "token"])
@pytest.mark.parametrize("dist", ["gaussian", "rope_outliers", "small_latent"])
@pytest.mark.skipif(not _runs("fp8_ds_mla"), reason="the fp8_ds_mla kernel is not usable here")
def test_fp8_ds_mla_error_vs_unquantized_oracle(dist, ds_scales):
    """The fp8_ds_mla kernel against float64 on the data before quantization, at NUMERICS.md's shape: within
    1.1x the emulated F1 floor of the precision it computes in, and under 4e-2. Token scales (design S on a cache
    quantized with one scale per token) emulate to the same floor (NUMERICS.md, "One scale per token")."""
    rel, dlse, rel_ref = _ds_mla_vs_oracle(dist, b=16, seqlen=4096, ds_scales=ds_scales)
    print(f"[fp8_ds_mla {ds_scales} scales vs float64, unquantized {dist}] rel-L2 {rel:.3e} (F1 {DS_MLA_F1[dist]:.2e}), "
          f"max |dlse| {dlse:.3e}; vs the jnp reference {rel_ref:.3e}")
    assert rel <= DS_MLA_FACTOR * DS_MLA_F1[dist], f"rel-L2 {rel:.3e} vs F1 {DS_MLA_F1[dist]:.2e}"
    assert rel <= DS_MLA_CAP, f"rel-L2 {rel:.3e} > {DS_MLA_CAP}"
    assert rel_ref <= TOLS["fp8_ds_mla"]["rel_l2"]


@pytest.mark.parametrize("direction", ["up", "down"])
@pytest.mark.skipif(not _runs("fp8_ds_mla"), reason="the fp8_ds_mla kernel is not usable here")
def test_fp8_ds_mla_scale_ramp_in_one_chunk(direction):
    """Token magnitudes ramp by 2^6 along each 4096-token sequence, processed as one chunk: the running per-group
    normalizer N_g grows at every page ("up": O shrinks by N_old / N_new each time) or stays at the first page's
    ("down": later tokens' P_g are scaled down by up to 2^6). The ramp ends at the gaussian set's magnitude, so
    the largest logits are the usual ones (a ramp up to 8x the gaussian logits costs design A 7e-2 through q's
    e4m3 rounding alone, emulated). scripts/emulate_ds_mla_numerics.py's A-PV-noprom (this kernel's arithmetic)
    on such data: rel-L2 3.0e-2 (up) / 3.2e-2 (down) against the format's float64 attention. Same tolerances as
    every other case."""
    rng = np.random.default_rng(11)
    b, h_q, seqlen = 2, 64, 4096

    def gain(j, n):
        t = j / max(n - 1, 1)
        return 2.0 ** (6 * (t if direction == "up" else 1 - t) - 6)

    inp = make_decode_inputs(rng, b=b, s_q=1, h_q=h_q, h_kv=1, seqlens=np.full(b, seqlen, np.int32),
                             kv_format="fp8_ds_mla", page_gain=gain)
    args, kwargs = inp.kernel_args()
    meta = fm.get_mla_metadata(args[3], h_q, 1, num_sms=b)  # one partition per sequence: one chunk each
    out, lse = jax.block_until_ready(fm.flash_mla_with_kvcache(
        *args, 512, meta, softmax_scale=SOFTMAX_SCALE, causal=False, implementation="kernel", **kwargs))
    ref_out, ref_lse = _references(inp, False)
    _check(out, lse, ref_out, ref_lse, "fp8_ds_mla")


@pytest.mark.parametrize("s_q, h_q", [pytest.param(1, 16, marks=few_rows), (2, 64)])  # 16 rows; 128
@pytest.mark.skipif(not _runs("fp8_ds_mla"), reason="the fp8_ds_mla kernel is not usable here")
def test_fp8_ds_mla_scales_not_powers_of_two(s_q, h_q):
    """A cache from another writer, whose fp32 scales are not powers of two (amax / 448 unrounded): the per-group
    normalizer N_g, P_g's factor k_scale * 16 / N_g and O's rescale by N_old / N_new are then rounded rather than
    exact, which the format's tolerances absorb. Both kernels (few rows, 64 rows); the values ramp up by 2^3 along
    each sequence, so that N_g grows from page to page, and end below the gaussian set's magnitude (larger logits
    cost design A accuracy through q's rounding: test_fp8_ds_mla_scale_ramp_in_one_chunk)."""
    rng = np.random.default_rng(23)
    seqlens = np.array([4096, 140, 0, 77, 2049, 1000], np.int32)
    inp = make_decode_inputs(rng, b=6, s_q=s_q, h_q=h_q, h_kv=1, seqlens=seqlens, kv_format="fp8_ds_mla",
                             page_gain=lambda j, n: 2.0 ** (3 * j / max(n - 1, 1) - 4))
    inp = with_scales_not_powers_of_two(inp, rng)
    causal = s_q > 1
    out, lse = _run(inp, causal, "kernel")
    ref_out, ref_lse = _references(inp, causal)
    _check(out, lse, ref_out, ref_lse, "fp8_ds_mla")


@pytest.mark.parametrize("ds_scales", ["group", "token"])
@pytest.mark.parametrize("dist", ["gaussian", "small_latent"])
@pytest.mark.skipif(not _runs("fp8_ds_mla"), reason="the fp8_ds_mla kernel is not usable here")
def test_fp8_ds_mla_long_chunk_pv_accumulation(dist, ds_scales):
    """32768 tokens in ONE chunk (metadata for a single SM: no split-KV), 512 pages through one CTA, whose P V
    accumulates in one FP8 WGMMA accumulator (1024 k-steps): the error stays at design A's promoted level, not the
    drift an e8m13 truncating accumulator would show. Both decoders accumulate P V that way."""
    rel, dlse, rel_ref = _ds_mla_vs_oracle(dist, b=2, seqlen=32768, metadata_num_sms=1, ds_scales=ds_scales)
    print(f"[fp8_ds_mla {ds_scales} scales, 32K tokens, one chunk, {dist}] rel-L2 {rel:.3e} (emulated A {DS_MLA_A_32K[dist]:.2e}), "
          f"max |dlse| {dlse:.3e}; vs the jnp reference {rel_ref:.3e}")
    assert rel <= DS_MLA_FACTOR * DS_MLA_A_32K[dist], f"rel-L2 {rel:.3e} vs A {DS_MLA_A_32K[dist]:.2e}"
    assert rel <= DS_MLA_CAP
    assert rel_ref <= TOLS["fp8_ds_mla"]["rel_l2"]


# fp8_ds_mla's second decoder, ds_scales="token" (design S on the page pairs, docs/DESIGN.md "Design S on the page
# pairs: the build"): one FP8 + bf16 accumulator per page once the producer's prep warps have divided the RoPE slab
# by the tokens' scales. Its numerics are design A's up to the scale granularity (per token instead of per group, and
# the same q rounding), so the same tolerances hold. Caches: "token" (every page written with one scale per token,
# the fast path), "group" (the package's per-group cache: every page re-expressed by the prep warps first), "mixed"
# (every other cache page token-scaled; the block tables are shuffled, so chunks switch at random), and "ramp" (token
# scales growing along each sequence, so the running N grows and O is rescaled). Shapes with at most 16 query rows per
# KV head run design A's few-rows kernel (the decoder has no few-rows variant).
DS_TOKEN_CASES = [
    _case(6, 1, 128, 1, [4096, 140, 0, 77, 2049, 1000], False),
    _case(2, 2, 64, 1, [4096, 20], True),
    _case(4, 4, 16, 2, "varlen", True),
    _case(3, 1, 126, 1, [140, 3000, 64], False),
    _case(2, 1, 16, 1, [1000, 77], False),  # 16 rows: design A's few-rows kernel
]


@pytest.mark.parametrize("cache", ["token", "group", "mixed", "ramp"])
@pytest.mark.parametrize("b, s_q, h_q, h_kv, seqlens, causal", DS_TOKEN_CASES)
@pytest.mark.skipif(not _runs("fp8_ds_mla"), reason="the fp8_ds_mla kernel is not usable here")
def test_fp8_ds_mla_token_scales_decoder(b, s_q, h_q, h_kv, seqlens, causal, cache):
    rng = np.random.default_rng(zlib.crc32(f"{b}-{s_q}-{h_q}-{h_kv}-{cache}".encode()))
    gain = (lambda j, n: 2.0 ** (3 * j / max(n - 1, 1) - 4)) if cache == "ramp" else None
    inp = make_decode_inputs(rng, b=b, s_q=s_q, h_q=h_q, h_kv=h_kv, seqlens=_seqlens(rng, b, seqlens),
                             kv_format="fp8_ds_mla", page_gain=gain)
    num_blocks = inp.k_cache.shape[0]
    if cache != "group":
        inp = with_token_scales(inp, np.arange(num_blocks) % 2 == 0 if cache == "mixed" else np.ones(num_blocks, bool))
    out, lse = _run(inp, causal, "kernel", ds_scales="token")
    ref_out, ref_lse = _references(inp, causal)
    _check(out, lse, ref_out, ref_lse, "fp8_ds_mla")
    again = _run(inp, causal, "kernel", ds_scales="token")
    np.testing.assert_array_equal(np.asarray(again[0]).view(np.uint16), np.asarray(out).view(np.uint16))


@pytest.mark.skipif(not _runs("fp8_ds_mla"), reason="the fp8_ds_mla kernel is not usable here")
def test_fp8_ds_mla_token_scales_decoder_is_lowered():
    """ds_scales="token" lowers to the design-S target, "group" to design A's."""
    inp = make_decode_inputs(np.random.default_rng(3), b=2, s_q=1, h_q=64, h_kv=1, seqlens=[300, 64],
                             kv_format="fp8_ds_mla")
    args, kwargs = inp.kernel_args()
    for ds_scales in ("group", "token"):
        fn = jax.jit(lambda *a: fm.flash_mla_with_kvcache(*a, softmax_scale=SOFTMAX_SCALE, implementation="kernel",
                                                          ds_scales=ds_scales, **kwargs))
        text = fn.lower(*args).as_text()
        assert _ffi.decode_target("fp8_ds_mla", ds_scales) in text
        assert ds_scales == "token" or _ffi.decode_target("fp8_ds_mla", "token") not in text
