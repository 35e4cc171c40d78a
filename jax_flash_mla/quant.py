"""Quantize, dequantize and write the paged MLA KV cache in each format (pure jnp, jit-able).

A cached token is the 576-wide latent: 512 NoPE channels (which double as V) and 64 RoPE channels.

* ``bf16``: the latent in bfloat16.
* ``fp8_per_tensor``: float8_e4m3fn of ``latent / scale``; ``scale`` is the float32 ``descale_k`` the kernel later
  multiplies by. Values beyond ±448·scale saturate to ±448 rather than turning into NaN.
* ``fp8_ds_mla``: 656 bytes per token (shared README §2): bytes 0–511 e4m3 NoPE / scale_g, bytes 512–527 four
  little-endian float32 scales (scale g for channels 128g … 128g+127), bytes 528–655 64 bfloat16 RoPE values.
  scale_g = 2^ceil(log2(max(amax_g / 448, 1e-4))), a power of two rounded up, so the division is exact and nothing
  saturates. With ``ds_scales="token"`` the four scales of a token are all its largest one, and the NoPE bytes are
  e4m3(value / that scale): a valid cache of the same format for every reader, as accurate on the accuracy CLI's data
  sets (docs/NUMERICS.md, "One scale per token"); a group far below its token's largest loses precision from ~2^12
  below it (e4m3's subnormals).

Argument errors raise ValueError (bad value or shape) or TypeError (bad dtype) naming the argument.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash_mla.formats import (
    CACHE_DTYPES,
    CACHE_LAST_DIM,
    HEAD_DIM_QK,
    HEAD_DIM_V,
    NUM_SCALES,
    PAGE_SIZE,
    QUANT_TILE,
    check_kv_format,
)
from jax_flash_mla.validation import check_ds_scales, check_positive_scale_value, layer_scalar

_E4M3_MAX = 448.0
_INT32_MAX = 2**31 - 1
# Floor of the fp8_ds_mla tile scale: an all-zero (or tiny) tile gets 2^-13 instead of a zero or subnormal scale.
_DS_MLA_MIN_SCALE = 1e-4


def quantize_kv_cache(kv, kv_format: str, scale=None, *, ds_scales: str = "group"):
    """Quantizes latent vectors ``kv [..., 576]`` (bf16 or f32) into ``kv_format``'s cache representation.

    Returns bfloat16 ``[..., 576]`` (bf16), float8_e4m3fn ``[..., 576]`` (fp8_per_tensor; ``scale`` required, shape
    ``()`` or ``(1,)``) or uint8 ``[..., 656]`` (fp8_ds_mla; ``ds_scales`` ``"group"``: one scale per 128 channels,
    ``"token"``: each token's largest scale stored four times).
    """
    kv_format = check_kv_format(kv_format)
    kv = jnp.asarray(kv)
    _check_latent("kv", kv)
    scale = _check_scale(scale, kv_format)
    token_scales = check_ds_scales(ds_scales, kv_format)
    if kv_format == "bf16":
        return kv.astype(jnp.bfloat16)
    if kv_format == "fp8_per_tensor":
        return _to_e4m3(kv.astype(jnp.float32) / scale)
    return _quantize_ds_mla(kv, token_scales)


def dequantize_kv_cache(cache, kv_format: str, scale=None, dtype=jnp.bfloat16):
    """Inverse of :func:`quantize_kv_cache`: cache ``[..., 576 | 656]`` → latent ``[..., 576]`` of ``dtype``.

    ``scale`` as in :func:`quantize_kv_cache`. An fp8_ds_mla cache may be given as uint8 or as a float8_e4m3fn view of
    the same bytes.
    """
    kv_format = check_kv_format(kv_format)
    cache = jnp.asarray(cache)
    _check_cache("cache", cache, kv_format)
    scale = _check_scale(scale, kv_format)
    if kv_format == "bf16":
        return cache.astype(dtype)
    if kv_format == "fp8_per_tensor":
        return (cache.astype(jnp.float32) * scale).astype(dtype)
    return _dequantize_ds_mla(cache).astype(dtype)


def write_kv_cache(cache, new_kv, block_table, positions, kv_format: str, scale=None, *, layer=None,
                   ds_scales: str = "group"):
    """Quantizes ``new_kv`` and scatters it into the paged ``cache``; returns the updated cache.

    cache ``[num_blocks, 64, h_kv, 576 | 656]``; new_kv ``[b, s_new, h_kv, 576]``; block_table int ``[b, max_blocks]``;
    positions int ``[b, s_new]``, absolute token indices: token (i, j) goes to page ``block_table[i, positions[i, j] //
    64]``, slot ``positions[i, j] % 64``.

    Tokens are dropped (written nowhere) when their position is negative — use -1 to pad ragged writes — or
    ``>= 64 * max_blocks``, or when their block_table entry is outside ``[0, num_blocks)``. Two tokens written to the
    same slot leave one of them, unspecified which.

    ``scale`` is the fp8_per_tensor scale and ``ds_scales`` the fp8_ds_mla scale granularity, as in
    :func:`quantize_kv_cache`. The update is a single scatter: jit the
    caller with the cache donated (``donate_argnums``) and XLA writes in place instead of copying the whole cache.

    With ``layer`` (an int scalar, may be traced), cache is the stack of every layer's cache ``[num_layers, num_blocks,
    64, h_kv, d]`` and the tokens go to ``cache[layer]`` (nowhere if layer is outside ``[0, num_layers)``). Inside a
    ``lax.scan`` over layers, carry the stack and pass the layer index: writing ``cache[layer]`` and setting it back
    would copy that layer's cache twice per step. Pass the same ``layer`` to ``flash_mla_with_kvcache``, which then
    reads the stack in place too (``cache[layer]`` would hand it a copy: README, "A model's layers in one cache").
    """
    kv_format = check_kv_format(kv_format)
    cache, new_kv = map(jnp.asarray, (cache, new_kv))
    block_table, positions = index_array("block_table", block_table), index_array("positions", positions)
    _check_cache("cache", cache, kv_format)
    page_dims = cache.shape if layer is None else cache.shape[1:]
    if len(page_dims) != 4 or page_dims[1] != PAGE_SIZE:
        layers = "" if layer is None else "num_layers, "
        raise ValueError(
            f"cache must have shape [{layers}num_blocks, {PAGE_SIZE}, h_kv, {CACHE_LAST_DIM[kv_format]}], "
            f"got {cache.shape}"
        )
    num_blocks, _, h_kv, _ = page_dims
    _check_latent("new_kv", new_kv)
    if new_kv.ndim != 4 or new_kv.shape[2] != h_kv:
        raise ValueError(f"new_kv must have shape [b, s_new, h_kv={h_kv}, {HEAD_DIM_QK}], got {new_kv.shape}")
    b, s_new = new_kv.shape[:2]
    if block_table.ndim != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table must have shape [b={b}, max_blocks], got {block_table.shape}")
    if positions.shape != (b, s_new):
        raise ValueError(f"positions must have shape [b, s_new] = {(b, s_new)}, got {positions.shape}")
    if layer is not None:
        layer = layer_scalar(layer)

    values = quantize_kv_cache(new_kv, kv_format, scale, ds_scales=ds_scales)
    if values.dtype != cache.dtype:  # fp8_ds_mla bytes into a float8_e4m3fn view of the cache
        values = jax.lax.bitcast_convert_type(values, cache.dtype)

    logical_page = positions // PAGE_SIZE
    in_table = (positions >= 0) & (logical_page < block_table.shape[1])
    page = jnp.take_along_axis(block_table, jnp.where(in_table, logical_page, 0), axis=1)
    valid = in_table & (page >= 0)
    layer_index = ()
    if layer is not None:
        valid &= (layer >= 0) & (layer < cache.shape[0])
        layer_index = (layer,)
    # mode="drop" discards only indices past the end; negative ones would wrap around, so every rejected token is sent
    # to page num_blocks instead.
    page = jnp.where(valid, page, num_blocks)
    return cache.at[(*layer_index, page, positions % PAGE_SIZE)].set(values, mode="drop")


@functools.partial(jax.jit, static_argnums=1)  # one program, not one per operation, when called eagerly
def _quantize_ds_mla(kv, token_scales: bool):
    lead = kv.shape[:-1]
    nope = kv[..., :HEAD_DIM_V].astype(jnp.float32).reshape(*lead, NUM_SCALES, QUANT_TILE)
    scales = _pow2_ceil(jnp.maximum(jnp.max(jnp.abs(nope), axis=-1) / _E4M3_MAX, _DS_MLA_MIN_SCALE))
    if token_scales:  # the token's largest, a power of two: dividing by it is exact short of e4m3's subnormals
        scales = jnp.broadcast_to(jnp.max(scales, axis=-1, keepdims=True), scales.shape)
    nope_bytes = _bytes(_to_e4m3((nope / scales[..., None]).reshape(*lead, HEAD_DIM_V)))
    rope_bytes = _bytes(kv[..., HEAD_DIM_V:].astype(jnp.bfloat16))
    return jnp.concatenate([nope_bytes, _bytes(scales), rope_bytes], axis=-1)


@jax.jit  # one program, not one per operation, when called eagerly
def _dequantize_ds_mla(cache):
    raw = jax.lax.bitcast_convert_type(cache, jnp.uint8)  # a no-op for uint8, reinterprets an e4m3 view
    lead = raw.shape[:-1]
    nope = jax.lax.bitcast_convert_type(raw[..., :HEAD_DIM_V], jnp.float8_e4m3fn).astype(jnp.float32)
    scale_end = HEAD_DIM_V + 4 * NUM_SCALES
    scales = jax.lax.bitcast_convert_type(raw[..., HEAD_DIM_V:scale_end].reshape(*lead, NUM_SCALES, 4), jnp.float32)
    rope = jax.lax.bitcast_convert_type(raw[..., scale_end:].reshape(*lead, -1, 2), jnp.bfloat16)
    nope = nope.reshape(*lead, NUM_SCALES, QUANT_TILE) * scales[..., None]
    return jnp.concatenate([nope.reshape(*lead, HEAD_DIM_V), rope.astype(jnp.float32)], axis=-1)


def _pow2_ceil(x):
    """Smallest power of two >= x, for positive normal float32 x; exact, where log2 may round at powers of two."""
    mantissa, exponent = jnp.frexp(x)  # x = mantissa * 2^exponent, mantissa in [0.5, 1)
    return jnp.ldexp(jnp.ones_like(x), jnp.where(mantissa == 0.5, exponent - 1, exponent))


def _to_e4m3(x):
    # float8_e4m3fn has no infinity: an unclipped overflow would become NaN.
    return jnp.clip(x, -_E4M3_MAX, _E4M3_MAX).astype(jnp.float8_e4m3fn)


def _bytes(x):
    """Little-endian bytes of x [..., n] as uint8 [..., n * itemsize]."""
    raw = jax.lax.bitcast_convert_type(x, jnp.uint8)
    return raw.reshape(*x.shape[:-1], -1)


def _check_latent(name, kv):
    if not jnp.issubdtype(kv.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array (bfloat16 or float32), got dtype {kv.dtype}")
    if kv.ndim == 0 or kv.shape[-1] != HEAD_DIM_QK:
        raise ValueError(f"{name} last dim must be {HEAD_DIM_QK}, got shape {kv.shape}")


def _check_cache(name, cache, kv_format):
    allowed = CACHE_DTYPES[kv_format]
    if cache.dtype not in allowed:
        names = " or ".join(str(d) for d in allowed)
        raise TypeError(f"{name} dtype must be {names} for kv_format={kv_format!r}, got {cache.dtype}")
    last = CACHE_LAST_DIM[kv_format]
    if cache.ndim == 0 or cache.shape[-1] != last:
        raise ValueError(f"{name} last dim must be {last} for kv_format={kv_format!r}, got shape {cache.shape}")


def index_array(name, x):
    """An integer array (lists, numpy or jax, any integer width) as int32. Values past int32's range become -1 or
    2^31 - 1, which write_kv_cache drops like any out-of-range position or block id, instead of wrapping around
    into a valid slot."""
    if not hasattr(x, "dtype"):
        x = np.asarray(x)
    _check_int(name, x)
    lib = np if isinstance(x, (np.ndarray, np.generic)) else jnp
    if jnp.iinfo(x.dtype).max > _INT32_MAX:
        x = lib.minimum(x, _INT32_MAX)
    if jnp.iinfo(x.dtype).min < -_INT32_MAX - 1:
        x = lib.maximum(x, -1)
    return jnp.asarray(x).astype(jnp.int32)


def _check_int(name, x):
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {x.dtype}")


def _check_scale(scale, kv_format):
    """Returns the fp8_per_tensor scale as a float32 scalar; None for the other formats."""
    if kv_format != "fp8_per_tensor":
        if scale is not None:
            raise ValueError(f"scale is only used by kv_format='fp8_per_tensor', got a scale for {kv_format!r}")
        return None
    if scale is None:
        raise ValueError("scale is required for kv_format='fp8_per_tensor'")
    scale = jnp.asarray(scale)
    if not jnp.issubdtype(scale.dtype, jnp.floating):
        raise TypeError(f"scale must be a floating-point (float32) scalar, got dtype {scale.dtype}")
    if scale.shape not in ((), (1,)):
        raise ValueError(f"scale must have shape () or (1,), got {scale.shape}")
    check_positive_scale_value("scale", scale)
    return scale.astype(jnp.float32).reshape(())
