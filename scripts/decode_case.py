"""One named decode shape on random inputs (never zeros), for the GPU scripts that run a single case:
profile_decode.py (Nsight Compute) and trace_pipeline.py (the event trace).

q and the latent cache are drawn on the device and quantized with the package's quantizer (fp8_per_tensor: scales
that map the largest |value| to e4m3's 448), the pages are in a shuffled order, and the metadata is computed once, so
that a call launches the decode and combine kernels alone.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax_flash_mla as fm  # noqa: E402
from jax_flash_mla.formats import HEAD_DIM_QK, HEAD_DIM_V, PAGE_SIZE  # noqa: E402


def random_decode_case(kv_format: str, shape, batch: int, seqlen: int, *, seed: int = 0,
                       implementation: str = "kernel"):
    """(decode, args) for `shape` (a bench.Shape) with `batch` sequences of `seqlen` tokens: `decode(*args)` is one
    jitted call, returning (out, lse)."""
    pages = -(-seqlen // PAGE_SIZE)
    kq, kk, kp = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (batch, shape.seqlen_q, shape.heads_q, HEAD_DIM_QK), jnp.float32)
    latent = jax.random.normal(kk, (batch * pages, PAGE_SIZE, 1, HEAD_DIM_QK), jnp.bfloat16)
    block_table = jax.random.permutation(kp, batch * pages).reshape(batch, pages).astype(jnp.int32)
    lengths = jnp.full((batch,), seqlen, jnp.int32)
    scales = {}
    if kv_format == "fp8_per_tensor":
        descale_q = jnp.abs(q).max() / 448
        descale_k = jnp.abs(latent.astype(jnp.float32)).max() / 448
        q = (q / descale_q).astype(jnp.float8_e4m3fn)
        cache = fm.quantize_kv_cache(latent, kv_format, descale_k)
        scales = dict(descale_q=descale_q.reshape(()), descale_k=descale_k.reshape(()))
    else:
        q = q.astype(jnp.bfloat16)
        cache = fm.quantize_kv_cache(latent, kv_format)
    meta = fm.get_mla_metadata(lengths, shape.seqlen_q * shape.heads_q, 1)
    decode = jax.jit(lambda q, cache, table, lengths, meta, scales: fm.flash_mla_with_kvcache(
        q, cache, table, lengths, HEAD_DIM_V, meta, causal=shape.causal, kv_format=kv_format,
        implementation=implementation, **scales))
    return decode, (q, cache, block_table, lengths, meta, scales)
