"""Primitive `jax_flash_mla_decode`: paged MLA decode with split-KV (shared README §1).

Operands: q, k_cache, block_table, cache_seqlens, sched_meta, num_splits, descale_q[1], descale_k[1] (the descales
are ones for formats without them). The fp8_ds_mla cache arrives as uint8. Results: out bf16 [b, s_q, h_q, 512] and
lse f32 [b, h_q, s_q]. `ds_scales` ("group" / "token", fp8_ds_mla) picks the decoder: design A, or design S on the page
pairs (fast on caches whose tokens carry one scale each; correct on any); the reference reads every cache alike. The
kernel also returns the split-KV partials (o_accum, lse_accum); the lowering drops them, so
XLA owns that workspace and the call stays CUDA-graph friendly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import _ffi, reference, validation
from ..formats import HEAD_DIM_V
from .base import make_primitive


def _abstract(q, k_cache, block_table, cache_seqlens, sched_meta, num_splits, descale_q, descale_k, *,
              softmax_scale, causal, kv_format, ds_scales, implementation):
    validation.check_decode_args(q, k_cache, block_table, cache_seqlens, kv_format=kv_format,
                                 descale_q=descale_q if kv_format == "fp8_per_tensor" else None,
                                 descale_k=descale_k if kv_format == "fp8_per_tensor" else None)
    validation.check_sched_meta(sched_meta, num_splits, q.shape[0])
    b, s_q, h_q, _ = q.shape
    return (jax.core.ShapedArray((b, s_q, h_q, HEAD_DIM_V), jnp.bfloat16),
            jax.core.ShapedArray((b, h_q, s_q), jnp.float32))


def _reference(q, k_cache, block_table, cache_seqlens, sched_meta, num_splits, descale_q, descale_k, *,
               softmax_scale, causal, kv_format, ds_scales, implementation):
    per_tensor = kv_format == "fp8_per_tensor"
    return tuple(reference.decode(
        q, k_cache, block_table, cache_seqlens, softmax_scale=softmax_scale, causal=causal, kv_format=kv_format,
        descale_q=descale_q if per_tensor else None, descale_k=descale_k if per_tensor else None))


def _kernel(q, k_cache, block_table, cache_seqlens, sched_meta, num_splits, descale_q, descale_k, *,
            softmax_scale, causal, kv_format, ds_scales, implementation):
    b, s_q, h_q, _ = q.shape
    h_kv = k_cache.shape[2]
    rows = s_q * (h_q // h_kv)
    max_splits = b + sched_meta.shape[0]
    out_types = (
        jax.ShapeDtypeStruct((b, s_q, h_q, HEAD_DIM_V), jnp.bfloat16),      # out
        jax.ShapeDtypeStruct((b, h_q, s_q), jnp.float32),                   # lse
        jax.ShapeDtypeStruct((max_splits, h_kv, rows, HEAD_DIM_V), jnp.float32),  # o_accum (workspace)
        jax.ShapeDtypeStruct((max_splits, h_kv, rows), jnp.float32),        # lse_accum (workspace)
    )
    call = jax.ffi.ffi_call(_ffi.decode_target(kv_format, ds_scales), out_types)
    out, lse, _, _ = call(q, k_cache, block_table, cache_seqlens, sched_meta, num_splits, descale_q, descale_k,
                          softmax_scale=np.float32(softmax_scale), causal=bool(causal))
    return out, lse


decode_p = make_primitive(
    "jax_flash_mla_decode", _abstract, _reference, _kernel,
    kernel_available=lambda kv_format, **_: kv_format in _ffi.kernel_formats())
