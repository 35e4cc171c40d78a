"""Argument checks shared by the public API and the primitives' abstract evaluation.

The shape and dtype checks run on concrete arrays and on tracers alike; the `check_*_values` ones read values, so
the API calls them only outside jit. Each error names the argument and says what was expected.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import formats
from .scheduler import BEGIN_BATCH, BEGIN_SPLIT, BEGIN_TOKEN, END_BATCH, END_TOKEN, SCHED_META_INTS

_INT32 = jnp.dtype(jnp.int32)
_FLOAT32 = jnp.dtype(jnp.float32)


def _dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


def as_array(x):
    """Lists and tuples become jnp arrays (Python ints as int32 unless x64 is on); arrays, numpy arrays and tracers
    pass unchanged."""
    return x if hasattr(x, "dtype") else jnp.asarray(x)


def as_descale(x):
    """A descale given as a Python number becomes a float32 scalar; None and arrays pass unchanged."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return jnp.float32(x)
    return None if x is None else as_array(x)


def check_static_shape(name: str, x) -> None:
    """Shapes must be known when the decode is traced: the scheduler's partition count and the kernels' launch
    depend on them, so jax.export's symbolic dimensions (shape polymorphism) are not supported."""
    shape = tuple(np.shape(x))
    if not all(isinstance(d, (int, np.integer)) for d in shape):
        raise ValueError(f"{name} has a symbolic shape {shape}: jax_flash_mla needs static shapes (no shape "
                         "polymorphism in jax.export); export one step per batch size")


def check_rank(name: str, x, rank: int, layout: str) -> None:
    check_static_shape(name, x)
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


def check_positive_scale_value(name: str, x) -> None:
    """Outside jit: a scale (or descale) is a positive finite number (0, a negative or a NaN spoils every value)."""
    if isinstance(x, jax.core.Tracer):
        return
    value = float(np.asarray(x, np.float32).reshape(()))
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value}")


def check_ds_scales(ds_scales, kv_format: str) -> bool:
    """Whether fp8_ds_mla tokens carry one scale each (``"token"``) rather than one per 128 channels (``"group"``)."""
    if ds_scales not in ("group", "token"):
        raise ValueError(f"ds_scales must be 'group' or 'token', got {ds_scales!r}")
    if ds_scales == "token" and kv_format != "fp8_ds_mla":
        raise ValueError(f"ds_scales='token' is only used by kv_format='fp8_ds_mla', got {kv_format!r}")
    return ds_scales == "token"


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
    if isinstance(head_dim_v, bool) or head_dim_v != formats.HEAD_DIM_V:
        raise ValueError(f"head_dim_v must be {formats.HEAD_DIM_V} (V is the 512-channel latent), got {head_dim_v!r}")
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


def layer_scalar(layer):
    """A stacked cache's layer index (Python int, numpy or jax integer scalar, may be traced) as an int32 scalar."""
    layer = as_array(layer)
    if not jnp.issubdtype(layer.dtype, jnp.integer) or layer.ndim != 0:
        raise TypeError(f"layer must be an integer scalar, got dtype {_dtype_name(layer.dtype)} and shape "
                        f"{tuple(layer.shape)}")
    return layer.astype(jnp.int32)


def _check_layer(layer, k_cache):
    """With `layer`, k_cache stacks every layer's cache [num_layers, num_blocks, 64, h_kv, d]: returns the layer as an
    int32 scalar and the shape/dtype of one layer's cache; without it, (None, k_cache)."""
    if layer is None:
        return None, k_cache
    layer = layer_scalar(layer)
    check_rank("k_cache", k_cache, 5, "[num_layers, num_blocks, page_size, num_heads_k, head_dim] with layer=")
    if not isinstance(layer, jax.core.Tracer) and not 0 <= int(layer) < k_cache.shape[0]:
        raise ValueError(f"layer must lie in [0, {k_cache.shape[0]}) (k_cache dim 0, num_layers), got {int(layer)}")
    return layer, jax.ShapeDtypeStruct(k_cache.shape[1:], k_cache.dtype)


class DecodeCall(NamedTuple):
    """A decode call's arguments after decode_call_args."""

    q: object
    k_cache: object
    block_table: object
    cache_seqlens: object
    kv_format: str
    descale_q: object
    descale_k: object
    softmax_scale: float
    causal: bool
    layer: object


def decode_call_args(q, k_cache, block_table, cache_seqlens, *, kv_format, descale_q, descale_k, softmax_scale,
                     causal, head_dim_v: int = formats.HEAD_DIM_V, layer=None) -> DecodeCall:
    """Every check of a decode call (kernel or reference) that does not involve the metadata: shapes and dtypes
    always, lengths, block ids, descales and the layer when concrete. Returns the arguments normalized: lists and
    Python numbers as arrays, kv_format checked, softmax_scale a float, layer an int32 scalar (or None)."""
    kv_format = formats.check_kv_format(kv_format)
    q, k_cache, block_table, cache_seqlens = map(as_array, (q, k_cache, block_table, cache_seqlens))
    descale_q, descale_k = map(as_descale, (descale_q, descale_k))
    layer, layer_cache = _check_layer(layer, k_cache)
    check_decode_args(q, layer_cache, block_table, cache_seqlens, kv_format=kv_format, descale_q=descale_q,
                      descale_k=descale_k, head_dim_v=head_dim_v)
    try:
        static = not isinstance(softmax_scale, (jax.core.Tracer, str, bytes))
        scale = float(softmax_scale) if static else None
    except (TypeError, ValueError):
        scale = None
    if scale is None or not np.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite Python float (static), got {softmax_scale!r}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a Python bool (static), got {type(causal).__name__}")
    if not any(isinstance(x, jax.core.Tracer) for x in (block_table, cache_seqlens)):
        check_concrete_values(block_table, cache_seqlens, layer_cache.shape[0])
    for name, descale in (("descale_q", descale_q), ("descale_k", descale_k)):
        if descale is not None:
            check_positive_scale_value(name, descale)
    return DecodeCall(q, k_cache, block_table, cache_seqlens, kv_format, descale_q, descale_k, scale, bool(causal),
                      layer)


def check_sched_meta(sched_meta, num_splits, batch: int) -> None:
    """Scheduler metadata from get_mla_metadata for a batch of `batch` sequences."""
    check_rank("tile_scheduler_metadata", sched_meta, 2, f"[num_sm_parts, {SCHED_META_INTS}]")
    check_dtype("tile_scheduler_metadata", sched_meta, (_INT32,))
    if sched_meta.shape[1] != SCHED_META_INTS or sched_meta.shape[0] < 1:
        raise ValueError(f"tile_scheduler_metadata must have shape [num_sm_parts, {SCHED_META_INTS}], "
                         f"got {tuple(sched_meta.shape)}")
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


def check_sched_meta_values(sched_meta, num_splits, cache_seqlens) -> None:
    """Outside jit: with this metadata the kernel reads every key of these lengths once, and the combine finds
    every split.

    The kernel reads a partition's chunks as the metadata gives them, with each sequence's last split ending at
    its current length and every chunk clamped to it (cpp: `make_chunk`): any schedule get_mla_metadata made for
    the batch, even for other lengths (an earlier decode step's), reads every key once, only less balanced. What
    fails this check was not made by get_mla_metadata for a batch of this size (an edited schedule, say).
    """
    meta = np.asarray(sched_meta).astype(np.int64)
    splits = np.asarray(num_splits).astype(np.int64)
    lens = np.asarray(cache_seqlens).astype(np.int64)
    b = lens.shape[0]
    hint = "compute it with get_mla_metadata from the decode step's cache_seqlens (or pass none)"
    if splits[0] != 0 or (np.diff(splits) < 1).any():
        raise ValueError(f"num_splits must start at 0 and rise by at least 1 per sequence (cumulative split "
                         f"counts), got {splits.tolist() if b <= 16 else splits}; {hint}")
    rows = meta[meta[:, BEGIN_BATCH] <= meta[:, END_BATCH]]  # begin_batch > end_batch: an empty partition
    bb, bt, eb, et, bs = (rows[:, k] for k in (BEGIN_BATCH, BEGIN_TOKEN, END_BATCH, END_TOKEN, BEGIN_SPLIT))
    if ((bb < 0) | (eb >= b)).any():
        raise ValueError(f"tile_scheduler_metadata names sequences outside [0, {b}) (batch {b}); {hint}")
    # Every chunk as the kernel reads it: (sequence, start, stop, split index). A partition's first sequence
    # starts at begin_token and its last stops at end_token, the others are whole; a sequence's last split stops at
    # its length and the others at most there, a start at most at the page boundary after its stop, and the
    # kernel reads from the start's page on.
    one = bb == eb
    inner = np.maximum(eb - bb - 1, 0)
    whole = np.repeat(bb + 1, inner) + np.arange(inner.sum()) - np.repeat(np.cumsum(inner) - inner, inner)
    tails = (~one).sum() + whole.size
    seq = np.concatenate([bb, eb[~one], whole])
    given_start = np.concatenate([bt, np.zeros(tails, np.int64)])
    index = np.concatenate([bs, np.zeros(tails, np.int64)])
    last = index == np.diff(splits)[seq] - 1
    stop = np.where(last, lens[seq], np.minimum(np.concatenate([np.where(one, et, lens[bb]), et[~one], lens[whole]]),
                                                lens[seq]))
    page = formats.PAGE_SIZE
    start = np.minimum(given_start, -(-stop // page) * page)
    start -= start % page
    order = np.lexsort((given_start, seq))
    seq, start, stop, index = seq[order], start[order], stop[order], index[order]
    count = np.bincount(seq, minlength=b)
    rank = np.arange(seq.size) - np.searchsorted(seq, seq)  # position among the sequence's chunks
    bad = count != np.diff(splits)
    bad[seq[index != rank]] = True
    # The chunks that read a page must tile [0, length): from 0, then back to back.
    reads = start < stop
    seq, start, stop = seq[reads], start[reads], stop[reads]
    first = np.arange(seq.size) == np.searchsorted(seq, seq)
    follows = start == np.where(first, 0, np.concatenate([[0], stop[:-1]]))
    end = np.zeros(b, np.int64)
    np.maximum.at(end, seq, stop)
    bad |= end != lens
    bad[seq[~follows]] = True
    if bad.any():
        i = int(np.argmax(bad))
        chunks = [(int(a), int(z)) for a, z in zip(start[seq == i], stop[seq == i])]
        raise ValueError(
            f"tile_scheduler_metadata does not fit cache_seqlens[{i}] = {lens[i]}: the kernel would read that "
            f"sequence's keys as {chunks or 'nothing'} ([start, stop) by split) with "
            f"{int(splits[i + 1] - splits[i])} split(s) in num_splits, so it is not get_mla_metadata's for a batch "
            f"of {b}; {hint}")
