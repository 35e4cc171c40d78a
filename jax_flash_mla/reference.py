"""Paged MLA decode in plain jnp: the CPU / non-Hopper fallback and the kernels' test reference.

Math runs in float32 on the dequantized cache; only the output is rounded (to bfloat16).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash_mla.formats import HEAD_DIM_V, PAGE_SIZE
from jax_flash_mla.quant import dequantize_kv_cache

_HIGHEST = jax.lax.Precision.HIGHEST


def mla_decode_reference(
    q,
    k_cache,
    block_table,
    cache_seqlens,
    *,
    softmax_scale: float,
    causal: bool,
    kv_format: str,
    descale_q=None,
    descale_k=None,
):
    """Attention of ``q`` over the paged latent cache; returns ``(out, lse)``.

    q ``[b, s_q, h_q, 576]`` (float8_e4m3fn scaled by ``descale_q`` for fp8_per_tensor, else bf16); k_cache
    ``[num_blocks, 64, h_kv, 576 | 656]`` in ``kv_format`` (``descale_k`` for fp8_per_tensor); block_table int32
    ``[b, max_blocks]``; cache_seqlens int32 ``[b]``.

    out bf16 ``[b, s_q, h_q, 512]`` (V is the first 512 latent channels); lse float32 ``[b, h_q, s_q]``, the natural
    log of the sum of ``exp(softmax_scale * q·k)`` over visible keys. q head h reads KV head ``h // (h_q // h_kv)``.
    With ``causal``, query i of a sequence of length L sees keys ``0 … L - s_q + i``; a row that sees no key gets
    out = 0 and lse = +inf. Slots past ``cache_seqlens`` and block_table entries past the last used page are never
    used (they may hold NaN or any integer).
    """
    b, s_q, h_q, _ = q.shape
    num_blocks, _, h_kv, _ = k_cache.shape
    group = h_q // h_kv
    num_keys = block_table.shape[1] * PAGE_SIZE

    # Clamp so garbage block_table entries still gather some page; masking below discards its contents.
    pages = k_cache[jnp.clip(block_table, 0, num_blocks - 1)]  # [b, max_blocks, 64, h_kv, d]
    pages = pages.reshape(b, num_keys, h_kv, pages.shape[-1])
    is_fp8_per_tensor = kv_format == "fp8_per_tensor"
    kv = dequantize_kv_cache(pages, kv_format, scale=descale_k if is_fp8_per_tensor else None, dtype=jnp.float32)

    key = jnp.arange(num_keys)
    seqlens = cache_seqlens.astype(jnp.int32)[:, None]
    in_seq = key[None, :] < seqlens  # [b, t]
    # Zero the slots past the sequence: they may hold NaN, and 0 * NaN would leak into the products.
    kv = jnp.where(in_seq[:, :, None, None], kv, 0.0)
    visible = in_seq[:, None, :]  # [b, s, t]
    if causal:
        last_key = seqlens - s_q + jnp.arange(s_q)[None, :]  # [b, s]
        visible = visible & (key[None, None, :] <= last_key[:, :, None])

    qf = q.astype(jnp.float32)
    if is_fp8_per_tensor:
        qf = qf * jnp.asarray(descale_q, jnp.float32).reshape(())
    qf = qf.reshape(b, s_q, h_kv, group, qf.shape[-1])

    logits = softmax_scale * jnp.einsum(
        "bskgd,btkd->bkgst", qf, kv, precision=_HIGHEST, preferred_element_type=jnp.float32
    )
    visible = visible[:, None, None, :, :]  # [b, k, g, s, t]
    logits = jnp.where(visible, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    # A row that sees nothing has max -inf; shift it by 0 so exp gives zeros rather than NaN.
    p = jnp.exp(logits - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    seen = denom > 0
    p = p / jnp.where(seen, denom, 1.0)

    out = jnp.einsum(
        "bkgst,btkv->bskgv", p, kv[..., :HEAD_DIM_V], precision=_HIGHEST, preferred_element_type=jnp.float32
    )
    lse = jnp.where(seen, jnp.log(jnp.where(seen, denom, 1.0)) + row_max, jnp.inf)[..., 0]  # [b, k, g, s]
    return out.reshape(b, s_q, h_q, HEAD_DIM_V).astype(jnp.bfloat16), lse.reshape(b, h_q, s_q)
