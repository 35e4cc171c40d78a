"""Argument checks shared by the public API and the primitives' abstract evaluation.

Everything here looks at shapes and dtypes only, so it runs on concrete arrays and on tracers alike. Each error
names the argument and says what was expected.
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from . import formats
from .scheduler import SCHED_META_INTS

_INT32 = jnp.dtype(jnp.int32)
_FLOAT32 = jnp.dtype(jnp.float32)


def _dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


def check_rank(name: str, x, rank: int, layout: str) -> None:
    if np.ndim(x) != rank:
        raise ValueError(f"{name} must have rank {rank} ({layout}), got shape {tuple(np.shape(x))}")


def check_dtype(name: str, x, allowed, why: str = "") -> None:
    allowed = tuple(jnp.dtype(d) for d in allowed)
    if jnp.dtype(x.dtype) not in allowed:
        expected = " or ".join(_dtype_name(d) for d in allowed)
        raise TypeError(f"{name} must have dtype {expected}{why}, got {_dtype_name(x.dtype)}")


def check_scalar_descale(name: str, x, kv_format: str) -> None:
    if x is None:
        raise ValueError(f"{name} is required for kv_format={kv_format!r} (a float32 scalar, shape [] or [1])")
    if tuple(np.shape(x)) not in ((), (1,)):
        raise ValueError(f"{name} must be a float32 scalar of shape [] or [1], got shape {tuple(np.shape(x))}")
    check_dtype(name, x, (_FLOAT32,))


def check_cache(name: str, k_cache, kv_format: str) -> None:
    """k_cache: [num_blocks, PAGE_SIZE, h_kv, last_dim] with the format's dtype and last dimension."""
    check_rank(name, k_cache, 4, "[num_blocks, page_size, num_heads_k, head_dim]")
    num_blocks, page, h_kv, last = k_cache.shape
    if page != formats.PAGE_SIZE:
        raise ValueError(f"{name} page size (dim 1) must be {formats.PAGE_SIZE}, got {page}")
    want = formats.CACHE_LAST_DIM[kv_format]
    if last != want:
        raise ValueError(f"{name} last dim must be {want} for kv_format={kv_format!r}, got {last}")
    if h_kv < 1 or num_blocks < 1:
        raise ValueError(f"{name} must have at least one block and one KV head, got shape {tuple(k_cache.shape)}")
    check_dtype(name, k_cache, formats.CACHE_DTYPES[kv_format], f" for kv_format={kv_format!r}")


def check_decode_args(q, k_cache, block_table, cache_seqlens, *, kv_format, descale_q, descale_k,
                      head_dim_v: int = formats.HEAD_DIM_V) -> None:
    """Shape/dtype contract of flash_mla_with_kvcache (shared README §1-§2)."""
    formats.check_kv_format(kv_format)
    if head_dim_v != formats.HEAD_DIM_V:
        raise ValueError(f"head_dim_v must be {formats.HEAD_DIM_V} (V is the 512-channel latent), got {head_dim_v}")
    check_rank("q", q, 4, "[batch, seqlen_q, num_heads_q, 576]")
    b, s_q, h_q, d = q.shape
    if d != formats.HEAD_DIM_QK:
        raise ValueError(f"q last dim must be {formats.HEAD_DIM_QK} (512 NoPE + 64 RoPE), got {d}")
    if b < 1 or s_q < 1 or h_q < 1:
        raise ValueError(f"q must have batch, seqlen_q and num_heads_q >= 1, got shape {tuple(q.shape)}")
    check_dtype("q", q, (formats.Q_DTYPES[kv_format],), f" for kv_format={kv_format!r}")
    check_cache("k_cache", k_cache, kv_format)
    h_kv = k_cache.shape[2]
    if h_q % h_kv:
        raise ValueError(f"num_heads_q ({h_q}, q dim 2) must be a multiple of num_heads_k ({h_kv}, k_cache dim 2)")
    check_rank("block_table", block_table, 2, "[batch, max_blocks_per_seq]")
    check_dtype("block_table", block_table, (_INT32,))
    if block_table.shape[0] != b:
        raise ValueError(f"block_table dim 0 must equal batch {b}, got {block_table.shape[0]}")
    if block_table.shape[1] < 1:
        raise ValueError("block_table must have at least one column (max_blocks_per_seq >= 1)")
    check_rank("cache_seqlens", cache_seqlens, 1, "[batch]")
    check_dtype("cache_seqlens", cache_seqlens, (_INT32,))
    if cache_seqlens.shape[0] != b:
        raise ValueError(f"cache_seqlens must have shape [{b}] (batch), got {tuple(cache_seqlens.shape)}")
    if kv_format == "fp8_per_tensor":
        check_scalar_descale("descale_q", descale_q, kv_format)
        check_scalar_descale("descale_k", descale_k, kv_format)
    else:
        for name, value in (("descale_q", descale_q), ("descale_k", descale_k)):
            if value is not None:
                raise ValueError(f"{name} is only used with kv_format='fp8_per_tensor', got it with {kv_format!r}")


def check_sched_meta(sched_meta, num_splits, batch: int) -> None:
    """Scheduler metadata from get_mla_metadata for a batch of `batch` sequences."""
    check_rank("tile_scheduler_metadata", sched_meta, 2, f"[num_sm_parts, {SCHED_META_INTS}]")
    check_dtype("tile_scheduler_metadata", sched_meta, (_INT32,))
    if sched_meta.shape[1] != SCHED_META_INTS or sched_meta.shape[0] < 1:
        raise ValueError(f"tile_scheduler_metadata must have shape [num_sm_parts, {SCHED_META_INTS}], got {tuple(sched_meta.shape)}")
    check_rank("num_splits", num_splits, 1, "[batch + 1]")
    check_dtype("num_splits", num_splits, (_INT32,))
    if num_splits.shape[0] != batch + 1:
        raise ValueError(
            f"num_splits must have shape [{batch + 1}] (batch + 1); was the metadata computed for these "
            f"cache_seqlens? got {tuple(num_splits.shape)}")


def check_concrete_values(block_table, cache_seqlens, num_blocks: int) -> None:
    """Value checks possible only outside jit: lengths fit the table, used block ids exist.

    Under jit the kernel clamps instead (garbage in, no fault).
    """
    seqlens = np.asarray(cache_seqlens)
    table = np.asarray(block_table)
    capacity = table.shape[1] * formats.PAGE_SIZE
    if (seqlens < 0).any() or (seqlens > capacity).any():
        raise ValueError(f"cache_seqlens must lie in [0, {capacity}] (block_table columns x {formats.PAGE_SIZE}), "
                         f"got min {seqlens.min()} max {seqlens.max()}")
    pages = -(-seqlens // formats.PAGE_SIZE)
    used = np.arange(table.shape[1])[None, :] < pages[:, None]
    bad = used & ((table < 0) | (table >= num_blocks))
    if bad.any():
        i, j = np.argwhere(bad)[0]
        raise ValueError(f"block_table[{i}, {j}] = {table[i, j]} is used by cache_seqlens[{i}] = {seqlens[i]} "
                         f"but is not a block index in [0, {num_blocks})")
