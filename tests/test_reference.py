"""mla_decode_reference against the float64 oracle (tests/oracle.py), for every cache format.

Both sides read the same dequantized cache, so they may differ only by float32 accumulation and the bfloat16
rounding of out: |out - oracle| <= 2^-8·|oracle| (bf16 unit roundoff) + 2^-14·max|V| (float32 slack), and
|lse - oracle| <= 1e-4·(1 + |lse|).

Coverage, sized for a 2-core CPU (each case compiles its own shapes):
* full product of b ∈ {1, 3}, s_q ∈ {1, 2, 4}, causal, format, and the small head configs (h_q, h_kv) ∈
  {(1, 1), (9, 1), (16, 1), (16, 2)};
* for the large head configs (64 and 128 heads over 1 or 2 KV heads) every (heads, format) pair, with
  (b, s_q, causal) rotating through four combinations so each appears with every head config;
* the README §4 data sets (RoPE outliers, small latent) for every format on one mid-size shape.
Lengths: b = 1 uses 77 (a partial page); b = 3 uses [130, 0, 1] (zero length mid-batch; 1 < s_q under causal leaves
rows that see nothing) or [64, 5, 191] (a full page). Every cache holds NaN in its unused slots and pages, and
every block table a garbage entry (2147480000) past the used pages.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flash_mla.formats import KV_FORMATS
from jax_flash_mla.reference import CHUNK_BYTES, chunk_pages, mla_decode_reference
from oracle import SOFTMAX_SCALE, make_decode_inputs, oracle_decode, with_scales_not_powers_of_two

reference = jax.jit(mla_decode_reference, static_argnames=("softmax_scale", "causal", "kv_format", "chunk_tokens"))

SEQLENS = {1: [77], 3: [130, 0, 1]}
SMALL_HEADS = [(1, 1), (9, 1), (16, 1), (16, 2)]
LARGE_HEADS = [(64, 1), (64, 2), (128, 1), (128, 2)]
LARGE_ROTATION = [(3, 2, True), (1, 1, False), (3, 4, True), (1, 4, False)]  # (b, s_q, causal)
LARGE_CASES = [
    (h_q, h_kv, kv_format, *LARGE_ROTATION[i % len(LARGE_ROTATION)])
    for i, ((h_q, h_kv), kv_format) in enumerate(itertools.product(LARGE_HEADS, KV_FORMATS))
]


def run_and_check(inputs, causal, fn=reference):
    args, kwargs = inputs.kernel_args()
    out, lse = fn(*args, softmax_scale=SOFTMAX_SCALE, causal=causal, **kwargs)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    b, s_q, h_q, _ = inputs.q.shape
    assert out.shape == (b, s_q, h_q, 512) and lse.shape == (b, h_q, s_q)
    out, lse = np.asarray(out, np.float64), np.asarray(lse)

    want_out, want_lse = oracle_decode(
        inputs.q64, inputs.kv64, inputs.block_table, inputs.cache_seqlens, SOFTMAX_SCALE, causal, inputs.h_kv
    )
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    # Rows that see no key: lse exactly +inf and out exactly 0.
    unseen = np.isinf(want_lse)  # [b, h_q, s_q]
    np.testing.assert_array_equal(np.isinf(lse), unseen)
    assert (lse[unseen] > 0).all()
    assert (out.transpose(0, 2, 1, 3)[unseen] == 0).all()

    v_max = np.abs(np.nan_to_num(inputs.kv64[..., :512], nan=0.0)).max()  # NaN marks the unused slots
    np.testing.assert_allclose(out, want_out, rtol=2**-8, atol=2**-14 * v_max)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-4, atol=1e-4)
    return out, lse


@pytest.mark.parametrize("kv_format", KV_FORMATS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h_q,h_kv", SMALL_HEADS)
@pytest.mark.parametrize("s_q", [1, 2, 4])
@pytest.mark.parametrize("b", [1, 3])
def test_small_heads(b, s_q, h_q, h_kv, causal, kv_format):
    rng = np.random.default_rng([b, s_q, h_q, h_kv])
    inputs = make_decode_inputs(rng, b=b, s_q=s_q, h_q=h_q, h_kv=h_kv, seqlens=SEQLENS[b], kv_format=kv_format)
    run_and_check(inputs, causal)


@pytest.mark.parametrize("h_q,h_kv,kv_format,b,s_q,causal", LARGE_CASES)
def test_large_heads(h_q, h_kv, kv_format, b, s_q, causal):
    seqlens = [64, 5, 191] if b == 3 else [200]
    inputs = make_decode_inputs(
        np.random.default_rng(h_q + h_kv), b=b, s_q=s_q, h_q=h_q, h_kv=h_kv, seqlens=seqlens, kv_format=kv_format
    )
    run_and_check(inputs, causal)


@pytest.mark.parametrize("kv_format", KV_FORMATS)
@pytest.mark.parametrize("dist", ["rope_outliers", "small_latent"])
def test_data_sets(dist, kv_format):
    inputs = make_decode_inputs(
        np.random.default_rng(7), b=3, s_q=2, h_q=16, h_kv=1, seqlens=[64, 5, 191], kv_format=kv_format, dist=dist
    )
    run_and_check(inputs, causal=True)


def test_fp8_ds_mla_scales_not_powers_of_two():
    """An fp8_ds_mla cache written elsewhere, with fp32 scales that are not powers of two, decodes by its scales."""
    rng = np.random.default_rng(17)
    inputs = make_decode_inputs(rng, b=3, s_q=2, h_q=16, h_kv=1, seqlens=[64, 5, 191], kv_format="fp8_ds_mla")
    inputs = with_scales_not_powers_of_two(inputs, rng)
    scales = inputs.k_cache[..., 512:528].copy().view("<f4")
    assert (np.frexp(scales[np.isfinite(scales)])[0] != 0.5).mean() > 0.9  # mostly not powers of two
    run_and_check(inputs, causal=True)


GAINS = {"flat": None, "rising": lambda j, n: 2.0**j, "falling": lambda j, n: 2.0**-j}


@pytest.mark.parametrize("kv_format", KV_FORMATS)
@pytest.mark.parametrize("gain", GAINS)
@pytest.mark.parametrize("chunk_tokens", [64, 128])
@pytest.mark.parametrize("s_q,causal", [(4, True), (1, False)])
def test_keys_in_chunks(s_q, causal, chunk_tokens, gain, kv_format):
    """The online softmax over key chunks meets the same oracle bounds. A rising magnitude ramp raises the row max
    in every chunk (each step rescales what came before), a falling one leaves it in the first; 191 tokens end
    mid-chunk, and the table (4 pages) is padded to whole chunks of 128 tokens."""
    inputs = make_decode_inputs(
        np.random.default_rng([s_q, chunk_tokens]), b=3, s_q=s_q, h_q=16, h_kv=2, seqlens=[191, 0, 1],
        kv_format=kv_format, page_gain=GAINS[gain],
    )
    assert inputs.block_table.shape[1] == 4
    run_and_check(inputs, causal, fn=functools.partial(reference, chunk_tokens=chunk_tokens))


def test_long_context_scratch_stays_bounded():
    """128 sequences of 32K tokens (a 2.8 GB fp8_ds_mla cache): the compiled fallback's scratch stays within a few
    chunks' worth, where gathering every key in float32 at once took 28 GB."""
    b, pages = 128, 512
    shapes = (jax.ShapeDtypeStruct((b, 2, 128, 576), jnp.bfloat16),
              jax.ShapeDtypeStruct((b * pages, 64, 1, 656), jnp.uint8),
              jax.ShapeDtypeStruct((b, pages), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32))
    compiled = reference.lower(*shapes, softmax_scale=SOFTMAX_SCALE, causal=True, kv_format="fp8_ds_mla").compile()
    assert compiled.memory_analysis().temp_size_in_bytes <= 4 * CHUNK_BYTES


@pytest.mark.parametrize("chunk_tokens", [0, 96, -64, 64.0, True, np.bool_(True)])
def test_chunk_tokens_must_be_whole_pages(chunk_tokens):
    inputs = make_decode_inputs(np.random.default_rng(0), b=1, s_q=1, h_q=4, h_kv=1, seqlens=[70], kv_format="bf16")
    args, kwargs = inputs.kernel_args()
    with pytest.raises(ValueError, match="chunk_tokens must be a positive multiple of 64"):
        mla_decode_reference(*args, softmax_scale=SOFTMAX_SCALE, causal=False, chunk_tokens=chunk_tokens, **kwargs)


def test_chunk_pages_fit_the_budget():
    # bf16 C1 of the benchmark (b 128, h_q 128, s_q 1): 4 * 128 * (576 + 256) bytes a token, 9 pages under 256 MiB.
    assert chunk_pages(b=128, s_q=1, h_q=128, h_kv=1, max_blocks=128) == 9
    assert chunk_pages(b=1, s_q=1, h_q=16, h_kv=1, max_blocks=3) == 3  # everything fits: one chunk
    assert chunk_pages(b=4096, s_q=4, h_q=128, h_kv=1, max_blocks=64) == 1  # never less than a page
    assert chunk_pages(b=1, s_q=1, h_q=1, h_kv=1, max_blocks=8, chunk_tokens=256) == 4
    assert chunk_pages(b=1, s_q=1, h_q=1, h_kv=1, max_blocks=8, chunk_tokens=np.int64(128)) == 2


def test_all_zero_lengths():
    inputs = make_decode_inputs(np.random.default_rng(0), b=2, s_q=2, h_q=4, h_kv=1, seqlens=[0, 0], kv_format="bf16")
    out, lse = run_and_check(inputs, causal=False)
    assert (out == 0).all() and np.isposinf(lse).all()


def test_table_without_columns_is_an_error():
    """As for the decode: a block table needs a column even when every sequence is empty."""
    inputs = make_decode_inputs(np.random.default_rng(0), b=2, s_q=1, h_q=4, h_kv=1, seqlens=[0, 0], kv_format="bf16")
    q, k_cache, _, seqlens = inputs.kernel_args()[0]
    with pytest.raises(ValueError, match="block_table must have at least one column"):
        reference(q, k_cache, jnp.zeros((2, 0), jnp.int32), seqlens, softmax_scale=SOFTMAX_SCALE, causal=False,
                  kv_format="bf16")


def test_descales_of_shape_1():
    inputs = make_decode_inputs(
        np.random.default_rng(1), b=3, s_q=2, h_q=16, h_kv=1, seqlens=[130, 0, 1],
        kv_format="fp8_per_tensor", descale_shape=(1,),
    )
    assert inputs.descale_q.shape == inputs.descale_k.shape == (1,)
    run_and_check(inputs, causal=True)


@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_page_order_does_not_matter(kv_format):
    """Moving every page in the pool (and its block_table entry with it) leaves the result bit-identical."""
    inputs = make_decode_inputs(
        np.random.default_rng(2), b=3, s_q=2, h_q=16, h_kv=2, seqlens=[130, 0, 191], kv_format=kv_format
    )
    args, kwargs = inputs.kernel_args()
    shuffled = reference(*args, softmax_scale=SOFTMAX_SCALE, causal=True, **kwargs)

    # new_position[p] = where page p moves: the used pages to the front in (sequence, page) order, i.e. a sorted table.
    table = inputs.block_table
    used = table[table < len(inputs.k_cache)]
    order = np.concatenate([used, np.setdiff1d(np.arange(len(inputs.k_cache)), used)])
    new_position = np.argsort(order).astype(np.int32)
    sorted_table = np.where(table < len(inputs.k_cache), new_position[np.minimum(table, len(order) - 1)], table)
    assert (sorted_table[sorted_table < len(order)] == np.arange(len(used))).all()
    args = (args[0], jnp.asarray(inputs.k_cache[order]), jnp.asarray(sorted_table), args[3])
    in_order = reference(*args, softmax_scale=SOFTMAX_SCALE, causal=True, **kwargs)

    for got, want in zip(in_order, shuffled):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_jit_matches_eager(kv_format):
    inputs = make_decode_inputs(
        np.random.default_rng(3), b=3, s_q=4, h_q=9, h_kv=1, seqlens=[130, 0, 1], kv_format=kv_format
    )
    eager = run_and_check(inputs, causal=True, fn=mla_decode_reference)
    jitted = run_and_check(inputs, causal=True)
    for got, want in zip(jitted, eager):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_eager_call_is_one_program(kv_format, compilations):
    """Outside jit the reference compiles one XLA program for a new shape, not one per operation (up to 78), and
    none for a shape it has seen."""
    inputs = make_decode_inputs(np.random.default_rng(5), b=2, s_q=3, h_q=5, h_kv=1, seqlens=[150, 9],
                                kv_format=kv_format)
    args, kwargs = inputs.kernel_args()
    before = len(compilations)  # (making the inputs compiled some)
    mla_decode_reference(*args, softmax_scale=SOFTMAX_SCALE, causal=True, **kwargs)
    assert len(compilations) - before == 1
    mla_decode_reference(*args, softmax_scale=SOFTMAX_SCALE, causal=True, **kwargs)
    assert len(compilations) - before == 1


def test_page_gain_scales_each_page_of_the_sequence():
    """The oracle's magnitude ramp (page_gain) scales page j of each sequence by the gain, before quantization."""
    kw = dict(b=2, s_q=1, h_q=4, h_kv=1, seqlens=np.array([200, 64], np.int32), kv_format="bf16")
    plain = make_decode_inputs(np.random.default_rng(3), **kw)
    ramp = make_decode_inputs(np.random.default_rng(3), page_gain=lambda j, n: 2.0 ** (j - n), **kw)
    np.testing.assert_array_equal(plain.block_table, ramp.block_table)
    for i, n in enumerate((4, 1)):
        for j in range(n):
            page = plain.block_table[i, j]
            np.testing.assert_array_equal(ramp.kv64[page], plain.kv64[page] * 2.0 ** (j - n))  # powers of two: exact
