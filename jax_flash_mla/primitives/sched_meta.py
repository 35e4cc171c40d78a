"""Primitive `jax_flash_mla_sched_meta`: split-KV scheduler metadata from cache_seqlens (docs/DESIGN.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import _ffi, scheduler, validation
from ..scheduler import SCHED_META_INTS
from .base import make_primitive


def _abstract(cache_seqlens, *, num_sm_parts, implementation):
    validation.check_rank("cache_seqlens", cache_seqlens, 1, "[batch]")
    validation.check_dtype("cache_seqlens", cache_seqlens, (jnp.int32,))
    b = cache_seqlens.shape[0]
    return (jax.core.ShapedArray((num_sm_parts, SCHED_META_INTS), jnp.int32),
            jax.core.ShapedArray((b + 1,), jnp.int32))


def _reference(cache_seqlens, *, num_sm_parts, implementation):
    return tuple(scheduler.sched_meta_reference(cache_seqlens, num_sm_parts))


def _kernel(cache_seqlens, *, num_sm_parts, implementation):
    b = cache_seqlens.shape[0]
    out_types = (jax.ShapeDtypeStruct((num_sm_parts, SCHED_META_INTS), jnp.int32),
                 jax.ShapeDtypeStruct((b + 1,), jnp.int32))
    return tuple(jax.ffi.ffi_call(_ffi.TARGET_SCHED_META, out_types)(cache_seqlens))


sched_meta_p = make_primitive(
    "jax_flash_mla_sched_meta", _abstract, _reference, _kernel,
    kernel_available=lambda **_: _ffi.extension_available())



def schedule(cache_seqlens, num_q_tokens_per_head_k: int, num_heads_k: int, *, num_sms: int, implementation: str):
    """(sched_meta, num_splits) balanced over `num_sms` SMs: the one place the partition count is derived, for
    get_mla_metadata and for the per-shard decode alike."""
    parts = scheduler.num_sm_parts(num_sms, num_q_tokens_per_head_k, num_heads_k)
    return tuple(sched_meta_p.bind(cache_seqlens, num_sm_parts=parts, implementation=implementation))


__all__ = ["sched_meta_p", "schedule", "SCHED_META_INTS"]
