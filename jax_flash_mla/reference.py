"""Paged MLA decode in plain jnp: the CPU / non-Hopper fallback and the kernels' test reference.

Math runs in float32 on the dequantized cache; only the output is rounded (to bfloat16). Keys are taken in chunks of
whole pages with an online softmax, so a long context never exists in float32 all at once: a fallback that gathered
every sequence's keys would need ~10x the cache's bytes of scratch (28 GB for 128 sequences of 32K tokens).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash_mla import validation
from jax_flash_mla.formats import HEAD_DIM_QK, HEAD_DIM_V, PAGE_SIZE
from jax_flash_mla.quant import dequantize_kv_cache

_HIGHEST = jax.lax.Precision.HIGHEST
# Default float32 scratch of one key chunk (dequantized keys, logits and probabilities).
CHUNK_BYTES = 256 << 20


def chunk_pages(b: int, s_q: int, h_q: int, h_kv: int, max_blocks: int, chunk_tokens: Optional[int] = None) -> int:
    """Pages per chunk of the online softmax: ``chunk_tokens / 64``, or what fits CHUNK_BYTES (at least one page)."""
    if chunk_tokens is not None:
        if isinstance(chunk_tokens, (bool, np.bool_)) or not isinstance(chunk_tokens, (int, np.integer)) \
                or chunk_tokens <= 0 or chunk_tokens % PAGE_SIZE:
            raise ValueError(f"chunk_tokens must be a positive multiple of {PAGE_SIZE}, got {chunk_tokens!r}")
        pages = int(chunk_tokens) // PAGE_SIZE
    else:
        token_bytes = 4 * b * (h_kv * HEAD_DIM_QK + 2 * h_q * s_q)
        pages = max(1, CHUNK_BYTES // (PAGE_SIZE * token_bytes))
    return max(1, min(pages, max_blocks))


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
    chunk_tokens: Optional[int] = None,
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

    ``chunk_tokens`` (a multiple of 64) sets how many keys of every sequence one step of the online softmax takes;
    by default as many as keep that step's float32 scratch near CHUNK_BYTES (all of them when they fit).

    Arguments are checked as by ``flash_mla_with_kvcache``: shapes and dtypes always, lengths, block ids and
    descales when concrete (outside jit).
    """
    call = validation.decode_call_args(q, k_cache, block_table, cache_seqlens, kv_format=kv_format,
                                       descale_q=descale_q, descale_k=descale_k, softmax_scale=softmax_scale,
                                       causal=causal)._asdict()
    del call["layer"]  # (the reference takes one layer's cache)
    return _decode_program(**call, chunk_tokens=chunk_tokens)


def decode(q, k_cache, block_table, cache_seqlens, *, softmax_scale, causal, kv_format, descale_q=None,
           descale_k=None, chunk_tokens=None):
    """mla_decode_reference without its argument checks (the primitive's abstract evaluation made them)."""
    b, s_q, h_q, _ = q.shape
    num_blocks, _, h_kv, _ = k_cache.shape
    group = h_q // h_kv
    max_blocks = block_table.shape[1]
    num_keys = max_blocks * PAGE_SIZE
    pages = chunk_pages(b, s_q, h_q, h_kv, max_blocks, chunk_tokens)
    num_chunks = -(-max_blocks // pages)
    chunk_keys = pages * PAGE_SIZE

    # Clamp so garbage block_table entries still gather some page (masking below discards its contents); pad the
    # table to whole chunks with such entries.
    table = jnp.clip(block_table, 0, num_blocks - 1)
    table = jnp.pad(table, ((0, 0), (0, num_chunks * pages - max_blocks)))
    is_fp8_per_tensor = kv_format == "fp8_per_tensor"
    seqlens = cache_seqlens.astype(jnp.int32)[:, None]
    last_key = seqlens - s_q + jnp.arange(s_q)[None, :]  # [b, s]: the last key query i sees under causal

    qf = q.astype(jnp.float32)
    if is_fp8_per_tensor:
        qf = qf * jnp.asarray(descale_q, jnp.float32).reshape(())
    qf = qf.reshape(b, s_q, h_kv, group, qf.shape[-1])

    def attend_chunk(carry, chunk):
        """Folds keys [chunk · chunk_keys, (chunk + 1) · chunk_keys) into the running (max, sum, P·V)."""
        row_max, denom, acc = carry  # [b, k, g, s], [b, k, g, s], [b, k, g, s, 512]
        ids = jax.lax.dynamic_slice_in_dim(table, chunk * pages, pages, axis=1)
        raw = k_cache[ids].reshape(b, chunk_keys, h_kv, k_cache.shape[-1])
        kv = dequantize_kv_cache(raw, kv_format, scale=descale_k if is_fp8_per_tensor else None, dtype=jnp.float32)
        key = chunk * chunk_keys + jnp.arange(chunk_keys)
        in_seq = (key[None, :] < seqlens) & (key[None, :] < num_keys)  # [b, t]
        # Zero the slots past the sequence: they may hold NaN, and 0 * NaN would leak into the products.
        kv = jnp.where(in_seq[:, :, None, None], kv, 0.0)
        visible = in_seq[:, None, :]  # [b, s, t]
        if causal:
            visible = visible & (key[None, None, :] <= last_key[:, :, None])
        logits = softmax_scale * jnp.einsum(
            "bskgd,btkd->bkgst", qf, kv, precision=_HIGHEST, preferred_element_type=jnp.float32
        )
        logits = jnp.where(visible[:, None, None, :, :], logits, -jnp.inf)
        new_max = jnp.maximum(row_max, jnp.max(logits, axis=-1))
        # A row that has seen nothing yet has max -inf; shift it by 0 so exp gives zeros rather than NaN.
        shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        p = jnp.exp(logits - shift[..., None])
        rescale = jnp.exp(row_max - shift)  # 0 while nothing was seen (row_max = -inf)
        denom = denom * rescale + jnp.sum(p, axis=-1)
        acc = acc * rescale[..., None] + jnp.einsum(
            "bkgst,btkv->bkgsv", p, kv[..., :HEAD_DIM_V], precision=_HIGHEST, preferred_element_type=jnp.float32
        )
        return (new_max, denom, acc), None

    stats_shape = (b, h_kv, group, s_q)
    carry = (jnp.full(stats_shape, -jnp.inf, jnp.float32), jnp.zeros(stats_shape, jnp.float32),
             jnp.zeros(stats_shape + (HEAD_DIM_V,), jnp.float32))
    if num_chunks == 1:
        carry, _ = attend_chunk(carry, 0)
    else:
        carry, _ = jax.lax.scan(attend_chunk, carry, jnp.arange(num_chunks))
    row_max, denom, acc = carry
    seen = denom > 0
    out = acc / jnp.where(seen, denom, 1.0)[..., None]  # [b, k, g, s, v]
    lse = jnp.where(seen, jnp.log(jnp.where(seen, denom, 1.0)) + row_max, jnp.inf)  # [b, k, g, s]
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, s_q, h_q, HEAD_DIM_V)
    return out.astype(jnp.bfloat16), lse.reshape(b, h_q, s_q)


# One XLA program per shape: called eagerly, the reference would otherwise dispatch and compile its operations one by
# one (78 programs for an fp8_ds_mla call, 3 s of compilation on a CPU, for every new shape).
_decode_program = jax.jit(decode, static_argnames=("softmax_scale", "causal", "kv_format", "chunk_tokens"))
