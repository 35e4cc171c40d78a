"""Ties scripts/emulate_ds_mla_numerics.py (docs/NUMERICS.md) to the package: its data, floor and rounding helpers."""

import importlib.util
import pathlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from oracle import round_q_like_ds_mla_kernel

from jax_flash_mla.quant import dequantize_kv_cache, quantize_kv_cache
from jax_flash_mla.reference import mla_decode_reference

_PATH = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "emulate_ds_mla_numerics.py"
_spec = importlib.util.spec_from_file_location("emulate_ds_mla_numerics", _PATH)
emu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(emu)

B, T, H = 2, 256, 16


def _data(dataset):
    return emu.make_data(dataset, B, T, H, seed=0)


def _dequantized(ke, ks, rope):
    nope = (ke.reshape(*ke.shape[:-1], emu.NG, emu.GROUP) * ks[..., None]).reshape(*ke.shape)
    return np.concatenate([nope, rope], axis=-1)


def test_hand_decoded_cache_equals_package_dequantize():
    _, tokens, ke, ks, rope = _data("rope_outliers")
    want = np.asarray(dequantize_kv_cache(quantize_kv_cache(jnp.asarray(tokens, jnp.bfloat16), "fp8_ds_mla"),
                                          "fp8_ds_mla", dtype=jnp.float32))
    np.testing.assert_array_equal(_dequantized(ke, ks, rope), want)


def test_floor_f0_equals_jnp_reference():
    """F0 (float64, bf16 q, dequantized cache) is what mla_decode_reference computes, up to f32 / bf16 rounding."""
    for dataset in emu.DATASETS:
        q, tokens, _, _, _ = _data(dataset)
        cache = quantize_kv_cache(jnp.asarray(tokens, jnp.bfloat16), "fp8_ds_mla")  # [B, T, 656]
        pages = np.asarray(cache).reshape(B * T // 64, 64, 1, 656)
        table = jnp.arange(B * T // 64, dtype=jnp.int32).reshape(B, T // 64)
        out, lse = mla_decode_reference(jnp.asarray(q, jnp.bfloat16)[:, None], jnp.asarray(pages), table,
                                        jnp.full((B,), T, jnp.int32), softmax_scale=emu.SOFTMAX_SCALE,
                                        causal=False, kv_format="fp8_ds_mla")
        out = np.asarray(out, np.float64)[:, 0]
        lse = np.asarray(lse, np.float64)[:, :, 0]
        for i in range(B):
            _, _, ke, ks, rope = (x[i] for x in _data(dataset))
            f0_out, f0_lse = emu.floor("F0", q[i], _dequantized(ke, ks, rope))
            np.testing.assert_allclose(out[i], f0_out, rtol=2**-8, atol=2**-8 * np.abs(f0_out).max())
            np.testing.assert_allclose(lse[i], f0_lse, rtol=0, atol=2e-5 * max(1.0, np.abs(f0_lse).max()))


def _encode(ke, ks, rope):
    """656-byte tokens from e4m3 values, float32 scales and RoPE values (the layout of README §2)."""
    nope = ke.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    scales = ks.astype("<f4").view(np.uint8)
    r = rope.astype(ml_dtypes.bfloat16).view(np.uint8)
    return np.concatenate([nope, scales, r], axis=-1)


def test_token_scaled_cache_is_a_valid_cache():
    """--token-scales: the bytes quantized at one scale per token (the largest of the four) are a cache of the format:
    its four scales are equal, the package decodes it to values * scale, and those stay within e4m3's rounding of the
    latent (half an ulp: 2^-4 relative for normal values)."""
    _, tokens, ke, ks, rope = emu.make_data("small_latent", B, T, H, seed=0, token_scales=True)
    assert np.all(ks == ks[..., :1])
    cache = jnp.asarray(_encode(ke, ks, rope))
    got = np.asarray(dequantize_kv_cache(cache, "fp8_ds_mla", dtype=jnp.float32), np.float64)
    np.testing.assert_array_equal(got, _dequantized(ke, ks, rope))
    nope, scale = tokens[..., : emu.D_V], np.repeat(ks, emu.GROUP, axis=-1)
    err = np.abs(got[..., : emu.D_V] - nope)
    assert np.all(err <= np.maximum(2.0**-4 * np.abs(nope), 2.0**-10 * scale))


def test_design_s_on_a_token_scaled_cache_tracks_design_a():
    """Design S needs no byte shift on a token-scaled cache, and there it is as accurate as design A on the package's
    cache (per-group scales) within 2 %: with e4m3's exponent range, one scale per token costs a group precision
    only when it lies ~2^12 below the token's largest."""
    q, tokens, ke, ks, rope = _data("gaussian")
    _, _, ket, kst, _ = emu.make_data("gaussian", B, T, H, seed=0, token_scales=True)
    num = {"A": 0.0, "S": 0.0}
    den = 0.0
    for i in range(B):
        truth, _ = emu.attention_f64(q[i], tokens[i])
        num["A"] += np.sum((emu.variant("A", q[i], ke[i], ks[i], rope[i], _dequantized(ke[i], ks[i], rope[i]))[0]
                            - truth) ** 2)
        num["S"] += np.sum((emu.variant_shift(q[i], ket[i], kst[i], rope[i], "bits")[0] - truth) ** 2)
        den += np.sum(truth**2)
    assert np.sqrt(num["S"] / den) <= 1.02 * np.sqrt(num["A"] / den)


def test_accumulator_and_format_roundings():
    # acc14: 14 significant bits, toward zero; rn14 to nearest.
    x = np.array([1 + 2**-13, 1 + 2**-14, -(1 + 3 * 2**-15), 3.0])
    np.testing.assert_array_equal(emu.cut(x, "acc14"), [1 + 2**-13, 1.0, -1.0, 3.0])
    np.testing.assert_array_equal(emu.cut(x, "rn14"), [1 + 2**-13, 1.0, -(1 + 2**-13), 3.0])
    np.testing.assert_array_equal(emu.cut(x, "exact"), x)
    # e4m3 saturates (SATFINITE) instead of producing NaN; P_g = p * k_scale * 256 / max k_scale stays <= 256.
    np.testing.assert_array_equal(emu.e4m3(np.array([500.0, -1e6, 2**-9, 2**-11])), [448.0, -448.0, 2**-9, 0.0])
    np.testing.assert_array_equal(emu.pow2_ceil(np.array([0.25, 0.3, 1e-4])), [0.25, 0.5, 2.0**-13])


@pytest.mark.parametrize("p_norm", [256.0, 16.0])
def test_design_a_tracks_its_floor_on_a_small_problem(p_norm, monkeypatch):
    """A (FP8 QK with promotion, P e4m3 folded per group) stays within 1.1x of F1, its precision's floor.

    p_norm 16 is the worst case of the kernel's lazy rescale: the reference max may run up to 2^4 above a row's
    true max, so P_g = e4m3(p * k_scale * 16 / N_g) with p <= 16 holds a probability as coarsely as a
    normalizer of 16 would for p <= 1 (more of the small ones in e4m3's subnormals)."""
    monkeypatch.setattr(emu, "P_NORM", p_norm)
    q, tokens, ke, ks, rope = _data("gaussian")
    num = {"A": 0.0, "F1": 0.0}
    den = 0.0
    for i in range(B):
        truth, _ = emu.attention_f64(q[i], tokens[i])
        kdeq = _dequantized(ke[i], ks[i], rope[i])
        num["A"] += np.sum((emu.variant("A", q[i], ke[i], ks[i], rope[i], kdeq)[0] - truth) ** 2)
        num["F1"] += np.sum((emu.floor("F1", q[i], kdeq)[0] - truth) ** 2)
        den += np.sum(truth**2)
    assert np.sqrt(num["A"] / den) <= 1.1 * np.sqrt(num["F1"] / den)


def test_per_row_q_scale_costs_nothing_even_with_groups_apart():
    """A-qrow (one power-of-two q scale per row instead of per 128-channel group) matches A within 1 %, also when the
    four NoPE groups of q differ in magnitude by up to 2^9: e4m3's exponent range absorbs the spread."""
    q, tokens, ke, ks, rope = _data("gaussian")
    q = q.copy()
    q[..., : emu.D_V] *= np.repeat(2.0 ** (-3.0 * np.arange(emu.NG)), emu.GROUP)
    num = {"A": 0.0, "A-qrow": 0.0}
    den = 0.0
    for i in range(B):
        truth, _ = emu.attention_f64(q[i], tokens[i])
        kdeq = _dequantized(ke[i], ks[i], rope[i])
        for name in num:
            num[name] += np.sum((emu.variant(name, q[i], ke[i], ks[i], rope[i], kdeq)[0] - truth) ** 2)
        den += np.sum(truth**2)
    assert np.sqrt(num["A-qrow"] / den) <= 1.01 * np.sqrt(num["A"] / den)


def test_oracle_rounds_q_like_the_emulated_per_row_scale():
    """The GPU tests' model of the kernel's q (oracle.round_q_like_ds_mla_kernel: bit arithmetic on the float32
    amax / 448) equals the emulation's A-qrow quantizer (float64 log2), written independently."""
    q, *_ = _data("gaussian")
    q = q[0].astype(np.float32)
    q[3, : emu.D_V] *= 1e-3  # another binade
    qe, qs = emu.quantize_q(q[:, : emu.D_V].astype(np.float64), "row-pow2")
    expected = np.concatenate([(qe * qs[..., None]).reshape(q.shape[0], emu.D_V), q[:, emu.D_V :]], axis=1)
    np.testing.assert_array_equal(round_q_like_ds_mla_kernel(q), expected.astype(np.float32))


def test_oracle_rounded_q_is_exact_in_bfloat16():
    """The GPU tests hand the rounded q to the fp8_ds_mla reference, whose q must be bf16: e4m3 codes times a power of
    two, and the RoPE channels of a bf16 q, survive the cast."""
    q, *_ = _data("gaussian")
    q = q[0].astype(ml_dtypes.bfloat16).astype(np.float32)
    q[3, : emu.D_V] *= np.float32(2.0**-40)  # a row whose scale is far below 1
    rounded = round_q_like_ds_mla_kernel(q)
    assert np.any(rounded[:, : emu.D_V] != q[:, : emu.D_V])  # the NoPE channels did change
    np.testing.assert_array_equal(rounded.astype(ml_dtypes.bfloat16).astype(np.float32), rounded)


def _shift_e4m3_byte(b, k):
    """Design S's exponent shift as an SM would run it on four bytes at once (docs/DESIGN.md, "Design S"): OR 0x80
    into the byte, subtract k << 3 (no borrow can cross bytes), keep the low 7 bits where the top bit survived,
    restore the sign."""
    d = ((b | 0x80) - (k << 3)) & 0xFF
    return (d & (0xFF if d & 0x80 else 0) & 0x7F) | (b & 0x80)


def test_shift_model_is_the_byte_trick():
    """S-bits' shift_cache gives, for every e4m3 value and every shift k, the byte the integer trick produces."""
    values = np.arange(256, dtype=np.uint8)
    values = values[(values & 0x7F) != 0x7F]  # e4m3fn NaNs
    x = values.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    for k in range(16):
        # One token whose group 0 has the largest scale (1) and group 1 a scale 2^-k below it.
        ke = np.zeros((len(x), emu.D_V))
        ke[:, emu.GROUP] = x
        ks = np.tile([1.0, 2.0**-k, 1.0, 1.0], (len(x), 1))
        got, kmax = emu.shift_cache(ke, ks, "bits")
        want = np.array([_shift_e4m3_byte(int(b), k) for b in values], np.uint8).view(ml_dtypes.float8_e4m3fn)
        np.testing.assert_array_equal(kmax, 1.0)
        np.testing.assert_array_equal(got[:, emu.GROUP], want.astype(np.float64), err_msg=f"k = {k}")
