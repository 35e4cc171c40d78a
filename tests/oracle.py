"""An independent float64 NumPy oracle for MLA decode, and the test data it is compared on.

The oracle shares no code with the package: it decodes cache bytes by hand (``decode_cache``) and walks each
sequence's pages with plain loops, reading only the tokens a query may see.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import ml_dtypes
import numpy as np

from jax_flash_mla.quant import quantize_kv_cache

D_QK, D_V, D_ROPE, PAGE = 576, 512, 64, 64
DS_MLA_BYTES = 656
# FlashMLA's tests fill block_table past the used pages with this; it must never be dereferenced.
GARBAGE_BLOCK = 2147480000
DISTS = ("gaussian", "rope_outliers", "small_latent")
SOFTMAX_SCALE = 1 / math.sqrt(D_QK)  # the API default, also for the FP8 formats


def oracle_decode(q64, latent64_pages, block_table, cache_seqlens, softmax_scale, causal, h_kv):
    """Decode attention in float64.

    q64 ``[b, s_q, h_q, 576]`` and latent64_pages ``[num_blocks, 64, h_kv, 576]`` are already dequantized (descales
    applied). Returns out ``[b, s_q, h_q, 512]`` and lse ``[b, h_q, s_q]`` (+inf, with out 0, where no key is seen).
    """
    b, s_q, h_q, _ = q64.shape
    group = h_q // h_kv
    out = np.zeros((b, s_q, h_q, D_V))
    lse = np.full((b, h_q, s_q), np.inf)
    for i in range(b):
        length = int(cache_seqlens[i])
        pages = latent64_pages[np.asarray(block_table[i, : -(-length // PAGE)], np.int64)]
        tokens = pages.reshape(-1, h_kv, D_QK)[:length]
        for kv_head in range(h_kv):
            heads = slice(kv_head * group, (kv_head + 1) * group)
            for s in range(s_q):
                n_seen = length - s_q + 1 + s if causal else length
                if n_seen <= 0:
                    continue
                keys = tokens[:n_seen, kv_head]
                logits = softmax_scale * (q64[i, s, heads] @ keys.T)  # [group, n_seen]
                peak = logits.max(axis=-1, keepdims=True)
                weights = np.exp(logits - peak)
                total = weights.sum(axis=-1, keepdims=True)
                out[i, s, heads] = (weights / total) @ keys[:, :D_V]
                lse[i, heads, s] = (np.log(total) + peak)[:, 0]
    return out, lse


def round_q_like_ds_mla_kernel(q):
    """The q the fp8_ds_mla kernel computes with (docs/NUMERICS.md, design A), as float32 ``[..., 576]``: the 512
    NoPE channels of each row become e4m3(q / s) * s with one power-of-two scale per row, s = 2^ceil(log2(amax / 448))
    (amax / 448 rounded to float32 first, as the kernel's __fdiv_rn; at least 2^-64; 1 for an all-zero row); the 64
    RoPE channels stay bf16 (the kernel stores them divided by s and scales the scores by s: exact). Division by a
    power of two is exact, and the e4m3 cast rounds to nearest even, as the kernel's cvt does."""
    q = np.asarray(q).astype(np.float32)
    nope = q[..., :D_V]
    amax = np.abs(nope).max(axis=-1, keepdims=True)
    ratio = (amax / np.float32(448)).astype(np.float32)
    pow2 = ((ratio.view(np.uint32).astype(np.uint64) + 0x007FFFFF) & 0xFF800000).astype(np.uint32).view(np.float32)
    scale = np.where(amax > 0, np.maximum(pow2, np.float32(2.0**-64)), np.float32(1)).astype(np.float32)
    codes = np.clip(nope / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    nope = codes.astype(np.float32) * scale
    return np.concatenate([nope, q[..., D_V:]], axis=-1)


def decode_cache(cache, kv_format, descale_k=None):
    """Cache (any leading shape) → float64 latent ``[..., 576]``, reading the bytes of README §2 by hand."""
    cache = np.asarray(cache)
    if kv_format == "bf16":
        return cache.astype(np.float64)
    if kv_format == "fp8_per_tensor":
        return cache.astype(np.float64) * np.float64(np.asarray(descale_k).reshape(()))
    raw = np.ascontiguousarray(cache).view(np.uint8)
    nope = raw[..., :512].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    scales = raw[..., 512:528].copy().view("<f4").astype(np.float64)  # [..., 4]
    # bfloat16 is the top half of a float32.
    rope = (raw[..., 528:656].copy().view("<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    nope = (nope.reshape(*nope.shape[:-1], 4, 128) * scales[..., None]).reshape(*nope.shape)
    return np.concatenate([nope, rope], axis=-1)


def poison(cache, kv_format, unused):
    """Copy of cache with NaN in every token where ``unused [num_blocks, 64]`` is True."""
    cache = np.array(cache)
    if kv_format != "fp8_ds_mla":
        cache[unused] = np.nan
        return cache
    raw = cache.view(np.uint8)
    token = np.concatenate(
        [
            np.full(512, 0x7F, np.uint8),  # e4m3fn NaN
            np.full(4, np.nan, "<f4").view(np.uint8),
            np.full(64, np.nan, ml_dtypes.bfloat16).view(np.uint8),
        ]
    )
    raw[unused] = token
    return cache


@dataclasses.dataclass(frozen=True)
class DecodeInputs:
    q: np.ndarray  # [b, s_q, h_q, 576]: float8_e4m3fn for fp8_per_tensor, else bfloat16
    k_cache: np.ndarray  # [num_blocks, 64, h_kv, 576 | 656] in kv_format; tokens not in use hold NaN
    block_table: np.ndarray  # int32 [b, max_blocks], shuffled pages, GARBAGE_BLOCK past the used ones
    cache_seqlens: np.ndarray  # int32 [b]
    descale_q: np.ndarray | None  # float32 (fp8_per_tensor only)
    descale_k: np.ndarray | None
    q64: np.ndarray  # float64 dequantized q (descale_q applied)
    kv_format: str
    h_kv: int

    @functools.cached_property
    def kv64(self) -> np.ndarray:
        """float64 dequantized cache (descale_k applied; NaN where not in use). Decoded on first use: for the large
        GPU cases it takes longer than drawing the data, and only the oracle tests read it."""
        return decode_cache(self.k_cache, self.kv_format, self.descale_k)

    @functools.cached_property
    def _device_arrays(self):
        # device_put, not jnp.asarray: since jax 0.11 jnp.asarray of a numpy array compiles a program per shape.
        return tuple(jax.device_put(x) for x in (self.q, self.k_cache, self.block_table, self.cache_seqlens))

    def kernel_args(self):
        """(args, kwargs) for mla_decode_reference or flash_mla_with_kvcache, minus softmax_scale and causal. The
        arrays are put on the device once per input set (the GPU tests pass the same cache to several paths)."""
        args = self._device_arrays
        kwargs = dict(kv_format=self.kv_format, descale_q=self.descale_q, descale_k=self.descale_k)
        return args, kwargs


def make_decode_inputs(
    rng, *, b, s_q, h_q, h_kv, seqlens, kv_format, num_blocks=None, dist="gaussian", descale_shape=(), page_gain=None,
    ds_scales="group",
):
    """Random decode inputs; the cache is quantized with the package's quantizer, the float64 copies decoded by hand.

    Pages are assigned to sequences in a random order from a pool of ``num_blocks`` (default: the used pages plus
    two spare ones), and block_table always has at least one GARBAGE_BLOCK column. ``dist`` (README §4):
    ``gaussian``; ``rope_outliers`` (8 RoPE channels ×20 in K, ×5 in q); ``small_latent`` (NoPE ×0.05, RoPE ~1).
    fp8_per_tensor descales (shape ``descale_shape``, ``()`` or ``(1,)``) map the largest |value| to e4m3's 448.
    ``page_gain(j, n)``, if given, multiplies the latent of page j of an n-page sequence before quantization (a
    magnitude ramp along the sequence: per-token scales that grow or shrink from page to page). ``ds_scales`` is the
    fp8_ds_mla quantizer's scale granularity (``quantize_kv_cache``'s argument).
    """
    seqlens = np.asarray(seqlens, np.int32)
    assert seqlens.shape == (b,) and dist in DISTS
    n_pages = -(-seqlens // PAGE)
    num_blocks = int(n_pages.sum()) + 2 if num_blocks is None else num_blocks
    assert num_blocks >= n_pages.sum()

    latent = rng.standard_normal((num_blocks, PAGE, h_kv, D_QK), dtype=np.float32)
    q = rng.standard_normal((b, s_q, h_q, D_QK), dtype=np.float32)
    if dist == "rope_outliers":
        latent[..., D_V : D_V + 8] *= 20
        q[..., D_V : D_V + 8] *= 5
    elif dist == "small_latent":
        latent[..., :D_V] *= 0.05

    block_table = np.full((b, int(n_pages.max(initial=0)) + 1), GARBAGE_BLOCK, np.int32)
    unused = np.ones((num_blocks, PAGE), bool)
    pool = iter(rng.permutation(num_blocks))
    for i, length in enumerate(seqlens):
        for j in range(n_pages[i]):
            block_table[i, j] = page = next(pool)
            unused[page, : min(PAGE, length - j * PAGE)] = False
            if page_gain is not None:
                latent[page] *= page_gain(j, n_pages[i])

    descale_q = descale_k = None
    if kv_format == "fp8_per_tensor":
        descale_k = np.full(descale_shape, np.abs(latent).max() / 448, np.float32)
        descale_q = np.full(descale_shape, np.abs(q).max() / 448, np.float32)
        q = np.clip(q / descale_q, -448, 448).astype(ml_dtypes.float8_e4m3fn)
        q64 = q.astype(np.float64) * np.float64(descale_q.reshape(()))
    else:
        q = q.astype(ml_dtypes.bfloat16)
        q64 = q.astype(np.float64)
    ds_kwargs = {"ds_scales": ds_scales} if kv_format == "fp8_ds_mla" else {}
    k_cache = poison(np.asarray(quantize_kv_cache(latent, kv_format, descale_k, **ds_kwargs)), kv_format, unused)
    return DecodeInputs(
        q, k_cache, block_table, seqlens, descale_q, descale_k, q64, kv_format=kv_format, h_kv=h_kv
    )


def with_token_scales(inputs: DecodeInputs, pages) -> DecodeInputs:
    """fp8_ds_mla inputs whose cache pages `pages` (a boolean mask over num_blocks) carry one scale per token: the
    largest of its four, stored four times, and its NoPE values e4m3(value / kmax) (rounded to nearest, saturating),
    as a writer of token scales leaves them (quantize_kv_cache(..., ds_scales="token") from the latent). Other pages
    keep their per-group scales; unused slots keep their NaN."""
    assert inputs.kv_format == "fp8_ds_mla"
    raw = inputs.k_cache.copy()
    sel = raw[np.asarray(pages)]
    scales = np.ascontiguousarray(sel[..., 512:528]).view("<f4")  # [..., 4]
    nope = sel[..., :512].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    values = (nope.reshape(*nope.shape[:-1], 4, 128) * scales[..., None]).reshape(nope.shape)
    kmax = scales.max(axis=-1, keepdims=True)
    requant = np.clip(values / np.repeat(kmax, 512, axis=-1), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    sel[..., :512] = requant.view(np.uint8)
    sel[..., 512:528] = np.repeat(kmax, 4, axis=-1).astype("<f4").view(np.uint8)
    raw[np.asarray(pages)] = sel
    return dataclasses.replace(inputs, k_cache=raw)


def with_scales_not_powers_of_two(inputs: DecodeInputs, rng) -> DecodeInputs:
    """fp8_ds_mla inputs whose token scales are multiplied by factors in [1, 2): a cache as another writer leaves it,
    with fp32 scales (e.g. amax / 448) that are not powers of two. The e4m3 bytes stay, so every value moves by its
    scale's factor; unused slots keep their NaN."""
    assert inputs.kv_format == "fp8_ds_mla"
    raw = inputs.k_cache.copy()
    scales = raw[..., 512:528].copy().view("<f4")
    scales *= rng.uniform(1.0, 2.0, scales.shape).astype(np.float32)
    raw[..., 512:528] = scales.view(np.uint8)
    return dataclasses.replace(inputs, k_cache=raw)
