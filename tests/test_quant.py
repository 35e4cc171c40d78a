"""Cache formats: fp8_ds_mla byte layout, scale rounding, round-trip error bounds, and cache writes.

Round-trip bounds (rounding to nearest errs by at most half a unit in the last place):
* bf16 keeps 8 significant bits: |x̂ - x| <= 2^-8·|x|.
* e4m3 keeps 4 significant bits down to its smallest normal 2^-6, then steps by 2^-9. A value stored as
  e4m3(x / s)·s therefore errs by at most max(2^-4·|x|, 2^-10·s) while |x| <= 448·s; beyond that it saturates to
  ±448·s. fp8_ds_mla tile scales are powers of two >= amax/448, so the division is exact and nothing saturates.
"""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_flash_mla.formats import KV_FORMATS
from jax_flash_mla import dequantize_kv_cache, quant, quantize_kv_cache, write_kv_cache
from jax_flash_mla.reference import mla_decode_reference
from oracle import GARBAGE_BLOCK, SOFTMAX_SCALE, decode_cache, oracle_decode

PER_TENSOR_SCALE = np.float32(0.037)  # deliberately not a power of two


def scale_for(kv_format):
    return PER_TENSOR_SCALE if kv_format == "fp8_per_tensor" else None


def wide_range_latent(rng, shape):
    """Gaussian values spread over six decades, so every tile also holds values in e4m3's subnormal range."""
    return (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, shape)).astype(np.float32)


def as_bytes(x):
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8)


# --- fp8_ds_mla byte layout -------------------------------------------------------------------------------------


def test_ds_mla_bytes_by_hand():
    kv = np.zeros(576, np.float32)
    kv[0] = 448.0  # tile 0: amax 448 -> scale 1, stored as e4m3 max 0x7E
    kv[128] = -3.0  # tile 1: amax 3 -> scale 2^-7 (3/448 = 0.0067 <= 2^-7), -3 / 2^-7 = -384 -> 0xFC
    kv[300] = 0.5  # tile 2: amax 0.5 -> scale 2^-9, 0.5 / 2^-9 = 256 -> 0x78
    kv[512] = 1.0  # RoPE channel 0, bf16 0x3F80
    kv[575] = -2.0  # RoPE channel 63, bf16 0xC000
    raw = as_bytes(quantize_kv_cache(kv, "fp8_ds_mla"))

    assert raw.shape == (656,)
    assert raw[0] == 0x7E and raw[128] == 0xFC and raw[300] == 0x78
    assert not raw[1:128].any() and not raw[129:300].any() and not raw[301:512].any()
    scale_bytes = [0x00, 0x00, 0x80, 0x3F, 0x00, 0x00, 0x00, 0x3C, 0x00, 0x00, 0x00, 0x3B, 0x00, 0x00, 0x00, 0x39]
    assert raw[512:528].tolist() == scale_bytes  # LE float32: 1, 2^-7, 2^-9, 2^-13 (the all-zero tile's floor)
    assert raw[528:530].tolist() == [0x80, 0x3F] and raw[654:656].tolist() == [0x00, 0xC0]
    assert not raw[530:654].any()


def test_ds_mla_layout_matches_numpy_encoding():
    rng = np.random.default_rng(0)
    kv = wide_range_latent(rng, (3, 64, 2, 576))
    raw = as_bytes(quantize_kv_cache(kv, "fp8_ds_mla"))
    assert raw.shape == (3, 64, 2, 656)

    tiles = kv[..., :512].reshape(3, 64, 2, 4, 128)
    scales = raw[..., 512:528].copy().view("<f4")  # [..., 4]
    powers = 2.0 ** np.arange(-13, 20)
    amax = np.abs(tiles).max(-1)
    want_scales = powers[np.argmax(powers[None] >= (amax[..., None] / 448), axis=-1)]  # smallest power >= amax/448
    np.testing.assert_array_equal(scales, want_scales)
    want_nope = (tiles / scales[..., None]).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(raw[..., :512], want_nope.reshape(3, 64, 2, 512))
    np.testing.assert_array_equal(raw[..., 528:], kv[..., 512:].astype(ml_dtypes.bfloat16).view(np.uint8))


# Tile amax -> scale: amax/448 rounded up to a power of two, floored at 1e-4 (so at 2^-13).
SCALE_CASES = [
    (448.0, 1.0),
    (448.0 * 2.0**-5, 2.0**-5),
    (448.0 * 2.0**10, 2.0**10),
    (float(np.nextafter(np.float32(448), np.float32(1e9))), 2.0),
    (float(np.nextafter(np.float32(448), np.float32(0))), 1.0),
    (300.0, 1.0),
    (448.0 * 2.0**-13, 2.0**-13),
    (448.0 * 2.0**-14, 2.0**-13),  # 2^-14 < 1e-4 < 2^-13
    (448e-4, 2.0**-13),
    (1e-30, 2.0**-13),
    (0.0, 2.0**-13),
]


@pytest.mark.parametrize("amax,scale", SCALE_CASES)
def test_ds_mla_scale_is_power_of_two_rounded_up(amax, scale):
    kv = np.zeros((4, 576), np.float32)
    kv[np.arange(4), np.arange(4) * 128 + 5] = [amax, -amax, amax / 2, 0]  # row r puts its value in tile r
    raw = as_bytes(quantize_kv_cache(kv, "fp8_ds_mla"))
    scales = raw[:, 512:528].copy().view("<f4")
    assert scales[0, 0] == scales[1, 1] == scale
    assert scales[2, 2] == (scale / 2 if amax / 2 / 448 > 2.0**-13 else 2.0**-13)
    assert (scales[3] == 2.0**-13).all() and (scales[:3, 3] == 2.0**-13).all()


def test_ds_mla_dequantize_accepts_an_e4m3_view():
    raw = quantize_kv_cache(wide_range_latent(np.random.default_rng(1), (5, 576)), "fp8_ds_mla")
    as_e4m3 = jax.lax.bitcast_convert_type(raw, jnp.float8_e4m3fn)
    np.testing.assert_array_equal(
        dequantize_kv_cache(raw, "fp8_ds_mla", dtype=jnp.float32),
        dequantize_kv_cache(as_e4m3, "fp8_ds_mla", dtype=jnp.float32),
    )


# --- round trips ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_dequantize_inverts_the_hand_decoder(kv_format):
    """dequantize_kv_cache agrees with the oracle's byte decoder (float32 vs float64 of the same values)."""
    cache = quantize_kv_cache(wide_range_latent(np.random.default_rng(2), (64, 576)), kv_format, scale_for(kv_format))
    got = dequantize_kv_cache(cache, kv_format, scale_for(kv_format), dtype=jnp.float32)
    assert got.dtype == jnp.float32 and got.shape == (64, 576)
    np.testing.assert_allclose(got, decode_cache(cache, kv_format, scale_for(kv_format)), rtol=2**-23, atol=0)
    assert dequantize_kv_cache(cache, kv_format, scale_for(kv_format)).dtype == jnp.bfloat16


def test_bf16_round_trip():
    kv = wide_range_latent(np.random.default_rng(3), (64, 576))
    back = np.asarray(dequantize_kv_cache(quantize_kv_cache(kv, "bf16"), "bf16", dtype=jnp.float32))
    assert (np.abs(back - kv) <= 2.0**-8 * np.abs(kv)).all()


def test_fp8_per_tensor_round_trip():
    s = PER_TENSOR_SCALE
    kv = wide_range_latent(np.random.default_rng(4), (64, 576))
    kv = np.clip(kv, -448 * s, 448 * s)
    back = np.asarray(dequantize_kv_cache(quantize_kv_cache(kv, "fp8_per_tensor", s), "fp8_per_tensor", s, jnp.float32))
    # 2^-20·|x| covers the float32 roundings of x / s and e4m3 · s.
    bound = np.maximum(2.0**-4 * np.abs(kv), 2.0**-10 * s) + 2.0**-20 * np.abs(kv)
    assert (np.abs(back - kv) <= bound).all()
    assert (np.abs(kv) < 2.0**-6 * s).any()  # the subnormal branch of the bound was exercised


def test_fp8_ds_mla_round_trip():
    kv = wide_range_latent(np.random.default_rng(5), (64, 576))
    cache = quantize_kv_cache(kv, "fp8_ds_mla")
    back = np.asarray(dequantize_kv_cache(cache, "fp8_ds_mla", dtype=jnp.float32))
    scales = np.repeat(as_bytes(cache)[:, 512:528].copy().view("<f4"), 128, axis=-1)  # [64, 512]
    nope, rope = kv[:, :512], kv[:, 512:]
    assert (np.abs(back[:, :512] - nope) <= np.maximum(2.0**-4 * np.abs(nope), 2.0**-10 * scales)).all()
    assert (np.abs(back[:, 512:] - rope) <= 2.0**-8 * np.abs(rope)).all()
    assert (np.abs(nope) < 2.0**-6 * scales).any()


def test_ds_mla_token_scales_store_the_token_largest_four_times():
    """ds_scales="token": each token's four scales are the largest of its per-group ones, and its NoPE bytes are
    e4m3(value / that scale); the round trip keeps the e4m3 bound with the token's scale."""
    rng = np.random.default_rng(12)
    kv = wide_range_latent(rng, (3, 64, 2, 576))
    kv[..., 128:256] *= 2.0**-9  # a group far below its token's largest
    group = as_bytes(quantize_kv_cache(kv, "fp8_ds_mla"))
    token = as_bytes(quantize_kv_cache(kv, "fp8_ds_mla", ds_scales="token"))
    kmax = group[..., 512:528].copy().view("<f4").max(-1, keepdims=True)  # [..., 1]
    np.testing.assert_array_equal(token[..., 512:528].copy().view("<f4"), np.repeat(kmax, 4, axis=-1))
    want_nope = (kv[..., :512] / kmax).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(token[..., :512], want_nope)
    np.testing.assert_array_equal(token[..., 528:], group[..., 528:])
    back = np.asarray(dequantize_kv_cache(token, "fp8_ds_mla", dtype=jnp.float32))
    nope = kv[..., :512]
    assert (np.abs(back[..., :512] - nope) <= np.maximum(2.0**-4 * np.abs(nope), 2.0**-10 * kmax)).all()
    assert (np.abs(nope) < 2.0**-6 * kmax).any()  # the subnormal branch of the bound was exercised


def test_ds_mla_token_scales_write():
    rng = np.random.default_rng(13)
    cache = make_cache(rng, "fp8_ds_mla", num_blocks=3, h_kv=1)
    new_kv = rng.standard_normal((2, 3, 1, 576), dtype=np.float32)
    table = np.array([[2, 0], [1, 0]], np.int32)
    positions = np.array([[0, 5, 70], [63, 64, -1]], np.int32)
    got = as_bytes(write_kv_cache(cache, new_kv, table, positions, "fp8_ds_mla", ds_scales="token"))
    want = as_bytes(quantize_kv_cache(new_kv, "fp8_ds_mla", ds_scales="token"))
    np.testing.assert_array_equal(got[2, 0, 0], want[0, 0, 0])
    np.testing.assert_array_equal(got[0, 6, 0], want[0, 2, 0])
    np.testing.assert_array_equal(got[1, 63, 0], want[1, 0, 0])
    np.testing.assert_array_equal(got[0, 0, 0], want[1, 1, 0])


def test_fp8_per_tensor_saturates_instead_of_nan():
    kv = np.zeros(576, np.float32)
    kv[:6] = [1e6, -1e6, np.inf, -np.inf, 449.0, 900.0]
    back = np.asarray(dequantize_kv_cache(quantize_kv_cache(kv, "fp8_per_tensor", 1.0), "fp8_per_tensor", 1.0,
                                          jnp.float32))
    np.testing.assert_array_equal(back[:6], [448, -448, 448, -448, 448, 448])
    back = dequantize_kv_cache(quantize_kv_cache(kv, "fp8_per_tensor", 2.0), "fp8_per_tensor", 2.0, jnp.float32)
    assert back[5] == 896.0 and back[4] == 448.0


@pytest.mark.parametrize("kv_format", KV_FORMATS)
@pytest.mark.parametrize("scale_shape", [(), (1,)])
def test_quantize_is_jittable(kv_format, scale_shape):
    kv = jnp.asarray(wide_range_latent(np.random.default_rng(6), (2, 64, 1, 576)), jnp.bfloat16)
    scale = None if kv_format != "fp8_per_tensor" else np.full(scale_shape, PER_TENSOR_SCALE)
    jitted = jax.jit(quantize_kv_cache, static_argnames="kv_format")(kv, kv_format=kv_format, scale=scale)
    np.testing.assert_array_equal(as_bytes(jitted), as_bytes(quantize_kv_cache(kv, kv_format, scale)))


def test_ds_mla_eager_calls_are_one_program_each(compilations):
    """Outside jit, fp8_ds_mla's quantization and dequantization each compile one XLA program for a new shape, where
    their operations one by one took 39."""
    kv = jax.device_put(wide_range_latent(np.random.default_rng(9), (3, 7, 576)))
    cache = quantize_kv_cache(kv, "fp8_ds_mla")
    dequantize_kv_cache(cache, "fp8_ds_mla", dtype=jnp.float32)
    assert len(compilations) == 2


# --- write_kv_cache -------------------------------------------------------------------------------------------


def make_cache(rng, kv_format, num_blocks=6, h_kv=2):
    latent = rng.standard_normal((num_blocks, 64, h_kv, 576), dtype=np.float32)
    return quantize_kv_cache(latent, kv_format, scale_for(kv_format))


@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_write_lands_on_page_and_slot(kv_format):
    rng = np.random.default_rng(8)
    cache = make_cache(rng, kv_format)
    block_table = np.array([[4, 1, GARBAGE_BLOCK], [0, 5, -3]], np.int32)
    positions = np.array(
        [
            [0, 63, 64, 100, -1, 130],  # 130: page 2 holds the garbage block id -> dropped
            [127, 5, -64, 64, 150, 192],  # 150: block id -3 -> dropped; 192 is past max_blocks -> dropped
        ],
        np.int32,
    )
    new_kv = rng.standard_normal((2, 6, 2, 576), dtype=np.float32)
    got = as_bytes(write_kv_cache(cache, new_kv, block_table, positions, kv_format, scale_for(kv_format)))

    want = as_bytes(cache).copy()
    new_bytes = as_bytes(quantize_kv_cache(new_kv, kv_format, scale_for(kv_format)))
    for (i, j), (page, slot) in {
        (0, 0): (4, 0), (0, 1): (4, 63), (0, 2): (1, 0), (0, 3): (1, 36),
        (1, 0): (5, 63), (1, 1): (0, 5), (1, 3): (5, 0),
    }.items():
        want[page, slot] = new_bytes[i, j]
    np.testing.assert_array_equal(got, want)  # bit for bit, everything else untouched


def test_write_accepts_an_e4m3_view_of_a_ds_mla_cache():
    rng = np.random.default_rng(9)
    raw = make_cache(rng, "fp8_ds_mla")
    args = (rng.standard_normal((1, 2, 2, 576), dtype=np.float32), np.array([[3, 2]]), np.array([[70, 3]]))
    view = write_kv_cache(jax.lax.bitcast_convert_type(raw, jnp.float8_e4m3fn), *args, "fp8_ds_mla")
    assert view.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(as_bytes(view), as_bytes(write_kv_cache(raw, *args, "fp8_ds_mla")))


def full_cache_ops(hlo_text, shape):
    """Opcodes of the entry computation's instructions (parameters aside) that produce an array of the cache's shape."""
    entry = hlo_text[hlo_text.index("\nENTRY") :]
    dims = ",".join(map(str, shape))
    return re.findall(rf"^\s*(?:ROOT )?%\S+ = \w+\[{dims}\]\{{[^}}]*\}} (?!parameter)([\w-]+)\(", entry, re.M)


def write_hlo(kv_format, donate, fn=write_kv_cache):
    rng = np.random.default_rng(10)
    cache = make_cache(rng, kv_format, num_blocks=8, h_kv=1)
    new_kv = jnp.asarray(rng.standard_normal((2, 1, 1, 576), dtype=np.float32), jnp.bfloat16)
    block_table, positions = np.array([[7, 2], [5, 1]], np.int32), np.array([[70], [3]], np.int32)
    jitted = jax.jit(fn, static_argnames="kv_format", donate_argnums=(0,) if donate else ())
    lowered = jitted.lower(cache, new_kv, block_table, positions, kv_format=kv_format, scale=scale_for(kv_format))
    return lowered.compile().as_text(), cache.shape


@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_donated_write_is_in_place(kv_format):
    """With the cache donated, the output aliases it and the cache is never copied.

    The uint8 fp8_ds_mla cache compiles to the scatter alone. XLA's CPU backend widens bf16 / fp8 scatters to
    f32 / f16 (two full-cache converts, still no copy); its GPU backend scatters those types natively.
    """
    hlo, shape = write_hlo(kv_format, donate=True)
    assert "input_output_alias={ {}: (0, {}" in hlo
    ops = full_cache_ops(hlo, shape)
    assert "copy" not in ops
    if kv_format == "fp8_ds_mla":
        assert len(ops) == 1, ops


@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_in_place_checks_can_fail(kv_format):
    """Writes that cannot be in place fail the checks above, so their passing means something."""
    hlo, shape = write_hlo(kv_format, donate=False)
    assert "input_output_alias" not in hlo
    if kv_format == "fp8_ds_mla":
        assert "copy" in full_cache_ops(hlo, shape)

        def write_and_read_old(cache, *args, **kwargs):  # the old cache stays live, so XLA must copy it
            return write_kv_cache(cache, *args, **kwargs), cache[0, 0]

        hlo, shape = write_hlo(kv_format, donate=True, fn=write_and_read_old)
        assert "copy" in full_cache_ops(hlo, shape)


SCAN_TABLE = np.array([[3, 0, GARBAGE_BLOCK], [1, 4, 2]], np.int32)
SCAN_SEQLENS = np.array([63, 130], np.int32)  # the new tokens go to slot 63 of page 3 and slot 2 of page 2


def decode_step(kv_format, scale, descale_q, slice_and_set=False):
    """One decode step of a model: lax.scan over the layers' stacked caches appends a token to each, then attends.

    With ``slice_and_set`` it writes the way to avoid: cache[layer] out, write, set back.
    """

    def layer_step(caches, xs):
        layer, kv, q = xs
        write = (SCAN_TABLE, SCAN_SEQLENS[:, None], kv_format, scale)
        if slice_and_set:
            caches = caches.at[layer].set(write_kv_cache(caches[layer], kv, *write))
        else:
            caches = write_kv_cache(caches, kv, *write, layer=layer)
        out, lse = mla_decode_reference(q, caches[layer], SCAN_TABLE, SCAN_SEQLENS + 1, softmax_scale=SOFTMAX_SCALE,
                                        causal=True, kv_format=kv_format, descale_q=descale_q, descale_k=scale)
        return caches, (out, lse)

    def step(caches, new_kv, q):
        return jax.lax.scan(layer_step, caches, (jnp.arange(len(new_kv)), new_kv, q))

    return jax.jit(step, donate_argnums=0)


def scan_inputs(rng, kv_format, layers=3):
    caches = jnp.stack([make_cache(rng, kv_format, num_blocks=5, h_kv=1) for _ in range(layers)])
    new_kv = rng.standard_normal((layers, 2, 1, 1, 576), dtype=np.float32)
    q = rng.standard_normal((layers, 2, 1, 8, 576), dtype=np.float32)
    if kv_format == "fp8_per_tensor":
        return caches, new_kv, (q / 0.02).astype(ml_dtypes.float8_e4m3fn), np.float32(0.02)
    return caches, new_kv, q.astype(ml_dtypes.bfloat16), None


@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_scan_over_layers_writes_then_decodes(kv_format):
    caches, new_kv, q, descale_q = scan_inputs(np.random.default_rng(11), kv_format)
    scale = scale_for(kv_format)
    want_caches = [write_kv_cache(caches[i], new_kv[i], SCAN_TABLE, SCAN_SEQLENS[:, None], kv_format, scale)
                   for i in range(len(caches))]
    caches, (out, lse) = decode_step(kv_format, scale, descale_q)(caches, new_kv, q)

    for i, want_cache in enumerate(want_caches):
        np.testing.assert_array_equal(as_bytes(caches[i]), as_bytes(want_cache))
        q64 = q[i].astype(np.float64) * (1.0 if descale_q is None else np.float64(descale_q))
        kv64 = decode_cache(want_cache, kv_format, scale)
        want_out, want_lse = oracle_decode(q64, kv64, SCAN_TABLE, SCAN_SEQLENS + 1, SOFTMAX_SCALE, True, 1)
        v_max = np.abs(kv64[..., :512]).max()
        np.testing.assert_allclose(np.asarray(out[i], np.float64), want_out, rtol=2**-8, atol=2**-14 * v_max)
        np.testing.assert_allclose(lse[i], want_lse, rtol=1e-4, atol=1e-4)


def stacked_cache_updates(hlo_text, shape):
    """Copies and dynamic-update-slices of the stacked caches anywhere in the module (loop bodies included)."""
    dims = ",".join(map(str, shape))
    return re.findall(rf"= \w+\[{dims}\]\{{[^}}]*\}} (copy|dynamic-update-slice)\(", hlo_text)


def test_scan_over_layers_updates_in_place():
    """Passing layer= keeps the loop's cache update a scatter into the carried stack; slice-and-set does not."""
    caches, new_kv, q, _ = scan_inputs(np.random.default_rng(12), "fp8_ds_mla")
    hlo = decode_step("fp8_ds_mla", None, None).lower(caches, new_kv, q).compile().as_text()
    assert "input_output_alias={ {0}: (0, {}" in hlo
    assert not stacked_cache_updates(hlo, caches.shape)
    hlo = decode_step("fp8_ds_mla", None, None, slice_and_set=True).lower(caches, new_kv, q).compile().as_text()
    assert stacked_cache_updates(hlo, caches.shape)


def test_write_to_a_layer_of_stacked_caches():
    rng = np.random.default_rng(13)
    caches = jnp.stack([make_cache(rng, "fp8_ds_mla") for _ in range(3)])
    args = (rng.standard_normal((1, 2, 2, 576), dtype=np.float32), np.array([[3, 2]]), np.array([[70, 3]]))
    got = write_kv_cache(caches, *args, "fp8_ds_mla", layer=1)
    np.testing.assert_array_equal(got[1], write_kv_cache(caches[1], *args, "fp8_ds_mla"))
    np.testing.assert_array_equal(got[::2], caches[::2])
    for outside in (-1, 3):
        np.testing.assert_array_equal(write_kv_cache(caches, *args, "fp8_ds_mla", layer=outside), caches)


# --- argument errors ------------------------------------------------------------------------------------------

KV = np.zeros((2, 576), np.float32)
CACHE = np.zeros((3, 64, 1, 576), ml_dtypes.bfloat16)
NEW_KV = np.zeros((2, 1, 1, 576), np.float32)
TABLE = np.zeros((2, 4), np.int32)
POS = np.zeros((2, 1), np.int32)

ERROR_CASES = [
    (lambda: quantize_kv_cache(KV, "fp8"), ValueError,
     "kv_format must be one of ('bf16', 'fp8_per_tensor', 'fp8_ds_mla'), got 'fp8'"),
    (lambda: dequantize_kv_cache(CACHE, None), ValueError, "kv_format must be one of"),
    (lambda: write_kv_cache(CACHE, NEW_KV, TABLE, POS, "int8"), ValueError, "kv_format must be one of"),
    (lambda: quantize_kv_cache(KV, "fp8_per_tensor"), ValueError, "scale is required for kv_format='fp8_per_tensor'"),
    (lambda: dequantize_kv_cache(np.zeros(576, ml_dtypes.float8_e4m3fn), "fp8_per_tensor"), ValueError,
     "scale is required for kv_format='fp8_per_tensor'"),
    (lambda: quantize_kv_cache(KV, "fp8_ds_mla", 1.0), ValueError,
     "scale is only used by kv_format='fp8_per_tensor', got a scale for 'fp8_ds_mla'"),
    (lambda: quantize_kv_cache(KV, "fp8_ds_mla", ds_scales="tile"), ValueError,
     "ds_scales must be 'group' or 'token', got 'tile'"),
    (lambda: quantize_kv_cache(KV, "bf16", ds_scales="token"), ValueError,
     "ds_scales='token' is only used by kv_format='fp8_ds_mla', got 'bf16'"),
    (lambda: write_kv_cache(CACHE, NEW_KV, TABLE, POS, "bf16", ds_scales=None), ValueError,
     "ds_scales must be 'group' or 'token', got None"),
    (lambda: quantize_kv_cache(KV, "fp8_per_tensor", np.int32(2)), TypeError,
     "scale must be a floating-point (float32) scalar, got dtype int32"),
    (lambda: quantize_kv_cache(KV, "fp8_per_tensor", np.ones(2, np.float32)), ValueError,
     "scale must have shape () or (1,), got (2,)"),
    (lambda: quantize_kv_cache(KV, "fp8_per_tensor", np.float32(0)), ValueError,
     "scale must be a positive finite number, got 0.0"),
    (lambda: dequantize_kv_cache(np.zeros(576, ml_dtypes.float8_e4m3fn), "fp8_per_tensor", np.float32(-0.5)),
     ValueError, "scale must be a positive finite number, got -0.5"),
    (lambda: write_kv_cache(CACHE.astype(ml_dtypes.float8_e4m3fn), NEW_KV, TABLE, POS, "fp8_per_tensor",
                            np.full(1, np.nan, np.float32)), ValueError,
     "scale must be a positive finite number, got nan"),
    (lambda: quantize_kv_cache(KV.astype(np.int32), "bf16"), TypeError,
     "kv must be a floating-point array (bfloat16 or float32), got dtype int32"),
    (lambda: quantize_kv_cache(np.zeros((2, 512), np.float32), "bf16"), ValueError,
     "kv last dim must be 576, got shape (2, 512)"),
    (lambda: dequantize_kv_cache(CACHE.astype(np.float32), "bf16"), TypeError,
     "cache dtype must be bfloat16 for kv_format='bf16', got float32"),
    (lambda: dequantize_kv_cache(np.zeros(656, np.int8), "fp8_ds_mla"), TypeError,
     "cache dtype must be uint8 or float8_e4m3fn for kv_format='fp8_ds_mla', got int8"),
    (lambda: dequantize_kv_cache(np.zeros((2, 576), np.uint8), "fp8_ds_mla"), ValueError,
     "cache last dim must be 656 for kv_format='fp8_ds_mla', got shape (2, 576)"),
    (lambda: write_kv_cache(CACHE[:, :32], NEW_KV, TABLE, POS, "bf16"), ValueError,
     "cache must have shape [num_blocks, 64, h_kv, 576], got (3, 32, 1, 576)"),
    (lambda: write_kv_cache(CACHE, NEW_KV.astype(np.int8), TABLE, POS, "bf16"), TypeError,
     "new_kv must be a floating-point array"),
    (lambda: write_kv_cache(CACHE, NEW_KV[..., :512], TABLE, POS, "bf16"), ValueError, "new_kv last dim must be 576"),
    (lambda: write_kv_cache(CACHE, np.zeros((2, 1, 2, 576), np.float32), TABLE, POS, "bf16"), ValueError,
     "new_kv must have shape [b, s_new, h_kv=1, 576], got (2, 1, 2, 576)"),
    (lambda: write_kv_cache(CACHE, NEW_KV, TABLE.astype(np.float32), POS, "bf16"), TypeError,
     "block_table must be an integer array, got dtype float32"),
    (lambda: write_kv_cache(CACHE, NEW_KV, TABLE[:1], POS, "bf16"), ValueError,
     "block_table must have shape [b=2, max_blocks], got (1, 4)"),
    (lambda: write_kv_cache(CACHE, NEW_KV, TABLE, POS.astype(np.float32), "bf16"), TypeError,
     "positions must be an integer array, got dtype float32"),
    (lambda: write_kv_cache(CACHE, NEW_KV, TABLE, POS[:, 0], "bf16"), ValueError,
     "positions must have shape [b, s_new] = (2, 1), got (2,)"),
    (lambda: write_kv_cache(CACHE, NEW_KV, TABLE, POS, "bf16", layer=0), ValueError,
     "cache must have shape [num_layers, num_blocks, 64, h_kv, 576], got (3, 64, 1, 576)"),
    (lambda: write_kv_cache(CACHE[None], NEW_KV, TABLE, POS, "bf16", layer=0.0), TypeError,
     "layer must be an integer scalar, got dtype float32"),
    (lambda: write_kv_cache(CACHE[None], NEW_KV, TABLE, POS, "bf16", layer=[0]), TypeError,
     "layer must be an integer scalar, got dtype int32 and shape (1,)"),
]


@pytest.mark.parametrize("call,error,message", ERROR_CASES, ids=[c[2][:40] for c in ERROR_CASES])
def test_argument_errors(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()


@pytest.mark.parametrize("positions, table", [
    (np.array([[2**32 + 3]], np.int64), np.array([[0]], np.int32)),  # wraps to slot 3 of page 0 as int32
    (np.array([[3]], np.int64), np.array([[2**32 + 1]], np.int64)),  # wraps to block 1
    (np.array([[-2**40]], np.int64), np.array([[0]], np.int32)),  # wraps to 0
    (np.array([[3]], np.int32), np.array([[2**32 + 1]], np.uint64)),
])
def test_write_drops_indices_past_int32_instead_of_wrapping(positions, table):
    """Positions and block ids wider than int32 that would wrap into a valid slot are dropped like any other
    out-of-range index."""
    cache = jnp.zeros((2, 64, 1, 576), jnp.bfloat16)
    new_kv = jnp.ones((1, 1, 1, 576), jnp.bfloat16)
    for write in (write_kv_cache, quant.write_kv_cache):  # the public op and its single-device body
        np.testing.assert_array_equal(np.asarray(write(cache, new_kv, table, positions, "bf16"), np.float32), 0)
