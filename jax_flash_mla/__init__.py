"""jax_flash_mla: Multi-head Latent Attention (DeepSeek-V2/V3 MLA) paged decode for JAX.

Hopper (sm_90) GPUs run CUDA kernels through XLA FFI; every other platform runs the pure-jnp reference, which is also
the test oracle. Three KV-cache formats: "bf16", "fp8_per_tensor" and "fp8_ds_mla" (656 bytes per token).

    meta = get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv)      # once per decode step
    out, lse = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, meta, causal=True)
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi, formats, sharding, validation
from .formats import DS_MLA_BYTES_PER_TOKEN, HEAD_DIM_QK, HEAD_DIM_V, KV_FORMATS, PAGE_SIZE
from .primitives import (FORCE_REFERENCE_ENV, KernelFallbackWarning, hopper_devices_only, resolve_implementation,
                         schedule)
from .quant import dequantize_kv_cache, quantize_kv_cache
from .reference import mla_decode_reference
from .sharding import write_kv_cache

__all__ = [
    "MlaMetadata", "get_mla_metadata", "flash_mla_with_kvcache", "quantize_kv_cache", "dequantize_kv_cache",
    "write_kv_cache", "mla_decode_reference", "kernel_formats", "KV_FORMATS", "HEAD_DIM_QK", "HEAD_DIM_V",
    "PAGE_SIZE", "DS_MLA_BYTES_PER_TOKEN", "FORCE_REFERENCE_ENV", "export_disabled_checks", "KernelFallbackWarning",
]

# SM count assumed off-GPU (an H200): the metadata then has the shape the kernel would use there.
_DEFAULT_NUM_SMS = 132


class MlaMetadata(NamedTuple):
    """Split-KV scheduler output of get_mla_metadata; a pytree of two int32 device arrays."""

    tile_scheduler_metadata: jax.Array  # [num_sm_parts, 8]
    num_splits: jax.Array  # [batch + 1], cumulative splits per sequence


def kernel_formats() -> frozenset:
    """Cache formats whose Hopper kernel is usable on this machine (empty off sm_90 or without the extension)."""
    return _ffi.kernel_formats() if hopper_devices_only() else frozenset()


def export_disabled_checks() -> list:
    """The `disabled_checks` that `jax.export.export` needs for a function that runs this package's kernels.

    On a Hopper GPU the decode lowers to XLA FFI custom calls (the split-KV scheduler and the format's kernel), which
    jax.export refuses unless each target is exempted: `jax.export.export(jax.jit(step),
    disabled_checks=export_disabled_checks())(*args)`. The exported module then runs only where `jax_flash_mla` is
    imported (that registers the handlers), on a Hopper GPU, with a build of the same version: the targets' operand
    signatures carry no compatibility guarantee across versions, so re-export after upgrading. The kernel path is
    chosen while lowering, on the exporting machine: exported where no kernel is usable (a CPU host, or
    implementation="reference"), the module holds the jnp reference and needs no exemption. A step that jit
    partitions through the sharding rules cannot be exported (JAX does not serialize custom_partitioning): export
    the per-device step under `jax.shard_map` instead (README, "Exporting").
    """
    return [jax.export.DisabledSafetyCheck.custom_call(target) for target in _ffi.all_targets()]


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _default_num_sms() -> int:
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or _DEFAULT_NUM_SMS) if device.platform == "gpu" else _DEFAULT_NUM_SMS


def get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k: int, num_heads_k: int, *,
                     num_sms: Optional[int] = None, implementation: str = "auto") -> MlaMetadata:
    """Schedules split-KV work for one decode step; reuse the result for every layer of that step.

    Args:
      cache_seqlens: int32 [batch], tokens in each sequence's cache (including the new ones).
      num_q_tokens_per_head_k: seqlen_q * num_heads_q // num_heads_k (query rows sharing one KV head).
      num_heads_k: KV heads of the cache (1 for DeepSeek MLA).
      num_sms: streaming multiprocessors to balance over (default: the GPU's, or 132 off-GPU).
      implementation: "auto", "kernel" (CUDA scheduler kernel, error if unusable) or "reference" (jnp).
    """
    for name, value in (("num_q_tokens_per_head_k", num_q_tokens_per_head_k), ("num_heads_k", num_heads_k),
                        ("num_sms", 1 if num_sms is None else num_sms)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive Python int, got {value!r}")
    cache_seqlens = validation.as_array(cache_seqlens)
    validation.check_rank("cache_seqlens", cache_seqlens, 1, "[batch]")
    validation.check_dtype("cache_seqlens", cache_seqlens, (jnp.int32,))
    if not _is_tracer(cache_seqlens) and cache_seqlens.size and int(cache_seqlens.min()) < 0:
        raise ValueError(f"cache_seqlens must be >= 0, got min {int(cache_seqlens.min())}")
    meta, splits = schedule(cache_seqlens, int(num_q_tokens_per_head_k), int(num_heads_k),
                            num_sms=_default_num_sms() if num_sms is None else int(num_sms),
                            implementation=resolve_implementation(implementation))
    return MlaMetadata(meta, splits)


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v: int = HEAD_DIM_V,
                           tile_scheduler_metadata=None, num_splits=None, softmax_scale: Optional[float] = None,
                           causal: bool = False, kv_format: str = "bf16", descale_q=None, descale_k=None, *,
                           layer=None, implementation: str = "auto", ds_scales: str = "group"):
    """MLA decode attention over a paged latent cache.

    Args:
      q: [batch, seqlen_q, num_heads_q, 576]; bfloat16, or float8_e4m3fn for "fp8_per_tensor".
      k_cache: [num_blocks, 64, num_heads_k, 576] (bf16 / float8_e4m3fn), or [..., 656] uint8 (or a float8_e4m3fn
        view of those bytes) for "fp8_ds_mla". V is the first 512 channels of the latent.
      block_table: int32 [batch, max_blocks_per_seq]; entries past a sequence's last page are never read.
      cache_seqlens: int32 [batch].
      head_dim_v: must be 512.
      tile_scheduler_metadata: an MlaMetadata from get_mla_metadata for these cache_seqlens (or FlashMLA-style:
        the metadata array, with `num_splits` passed separately). Computed here when omitted. Metadata of other
        lengths (an earlier decode step's) still reads every key once, less balanced; outside jit, an edited one
        with which the kernel would not raises. Under jit with sharded inputs the metadata is computed per shard and
        a passed one is ignored (jax_flash_mla.sharding).
      softmax_scale: defaults to 576 ** -0.5 (for every format).
      causal: with seqlen_q > 1, query i of a sequence of length L sees keys 0 .. L - seqlen_q + i.
      kv_format: "bf16", "fp8_per_tensor" or "fp8_ds_mla".
      descale_q, descale_k: float32 scalars ([] or [1]), "fp8_per_tensor" only: logits are scaled by
        softmax_scale * descale_q * descale_k, the output by descale_k.
      layer: with it (an int scalar, may be traced), k_cache is the stack of every layer's cache [num_layers,
        num_blocks, 64, num_heads_k, d] and the decode reads k_cache[layer] in place, with the block ids of that
        layer's cache (under lax.scan over layers, `k_cache[layer]` would hand the kernel a copy of the layer).
      implementation: "auto" (kernel on sm_90, reference elsewhere; JAX_FLASH_MLA_FORCE_REFERENCE=1 forces the
        reference), "kernel" or "reference".
      ds_scales: "fp8_ds_mla" only, which decoder the kernel path runs: "group" (any cache) or "token", for caches
        written with one scale per token (quantize_kv_cache / write_kv_cache with ds_scales="token"). "token" reads
        every cache correctly, but pages whose four scales differ are re-expressed first, which is slow. The reference
        reads every cache alike. (H100, session 67: "token" on token-scaled caches 7-11 % faster than "group" at
        128 query heads, the same error; docs/PERF.md.)

    Returns:
      out bfloat16 [batch, seqlen_q, num_heads_q, 512] and lse float32 [batch, num_heads_q, seqlen_q] (natural log;
      +inf, with out = 0, for a query row that sees no key).
    """
    q, k_cache, block_table, cache_seqlens, kv_format, descale_q, descale_k, softmax_scale, causal, layer = \
        validation.decode_call_args(
            q, k_cache, block_table, cache_seqlens, kv_format=kv_format, descale_q=descale_q, descale_k=descale_k,
            softmax_scale=HEAD_DIM_QK ** -0.5 if softmax_scale is None else softmax_scale, causal=causal,
            head_dim_v=head_dim_v, layer=layer)

    validation.check_ds_scales(ds_scales, kv_format)
    b = q.shape[0]
    implementation = resolve_implementation(implementation)
    if (kv_format in formats.FP8_FORMATS and implementation != "reference" and hopper_devices_only()
            and _ffi.build_info().get("fp8_disabled")):
        raise ValueError(f"kv_format={kv_format!r}: this jax_flash_mla was built with JAX_FLASH_MLA_DISABLE_FP8=ON, "
                         "so it has no FP8 kernels; rebuild without it, or pass implementation='reference'")
    meta = None  # None: computed inside the (possibly per-shard) decode for the shapes it sees
    if tile_scheduler_metadata is None:
        if num_splits is not None:
            raise ValueError("num_splits was given without tile_scheduler_metadata")
    else:
        if isinstance(tile_scheduler_metadata, tuple):
            if num_splits is not None:
                raise ValueError("num_splits must not be given when tile_scheduler_metadata is an MlaMetadata")
            if len(tile_scheduler_metadata) != 2:
                raise ValueError("tile_scheduler_metadata must be an MlaMetadata from get_mla_metadata (a pair: the "
                                 f"metadata array and num_splits), got a tuple of {len(tile_scheduler_metadata)}")
            tile_scheduler_metadata, num_splits = tile_scheduler_metadata
        elif num_splits is None:
            raise ValueError("tile_scheduler_metadata must be an MlaMetadata from get_mla_metadata "
                             "(or pass its num_splits too)")
        tile_scheduler_metadata, num_splits = map(validation.as_array, (tile_scheduler_metadata, num_splits))
        validation.check_sched_meta(tile_scheduler_metadata, num_splits, b)
        if not any(map(_is_tracer, (tile_scheduler_metadata, num_splits, cache_seqlens))):
            validation.check_sched_meta_values(tile_scheduler_metadata, num_splits, cache_seqlens)
        meta = (tile_scheduler_metadata, num_splits)

    if kv_format == "fp8_ds_mla" and k_cache.dtype != jnp.uint8:
        k_cache = jax.lax.bitcast_convert_type(k_cache, jnp.uint8)  # same bytes, the layout is byte-defined
    ones = jnp.ones((1,), jnp.float32)
    # sharding.decode partitions over sharded inputs under jit (heads / batch page pools, see its docstring) and is
    # the plain single-device decode otherwise.
    out, lse = sharding.decode(
        q, k_cache, block_table, cache_seqlens,
        ones if descale_q is None else jnp.reshape(descale_q, (1,)),
        ones if descale_k is None else jnp.reshape(descale_k, (1,)), meta, layer,
        softmax_scale=softmax_scale, causal=causal, kv_format=kv_format, implementation=implementation,
        num_sms=_default_num_sms(), ds_scales=ds_scales)
    return out, lse
