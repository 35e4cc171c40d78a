"""Partitioning rules: MLA decode and paged cache writes under `jax.jit` with sharded inputs, with no communication.

`flash_mla_with_kvcache` (and `write_kv_cache` below) run through `jax.experimental.custom_partitioning`: XLA's
SPMD partitioner asks `partition` for per-operand shardings and a per-device function, and each device then runs the
single-device op (the Hopper kernel, or the jnp reference) on its own shard. Shardy (the default partitioner) gets a
sharding rule; GSPMD gets `infer_sharding_from_operands`.

Supported strategies (mesh axes of size 1 count as unsharded):

* **Heads** (tensor parallel): q, out sharded over num_heads_q (q dim 2), lse over dim 1. With h_kv == 1 (DeepSeek
  MLA) the latent cache is replicated; with h_kv > 1 the cache is sharded over h_kv (dim 2) on the same mesh axes as
  the q heads (each device keeps the KV heads its q heads read).
* **Batch** (data-parallel attention): q, block_table, cache_seqlens sharded over batch (dim 0) and the cache over
  num_blocks (dim 0) **on the same mesh axes**. Each batch shard owns one page pool: device i holds cache blocks
  [i * num_blocks / n, (i + 1) * num_blocks / n) and the block ids in its rows of block_table are **local** to that
  pool (0 .. num_blocks / n - 1), not global. A cache that is *replicated* while the batch is sharded is also
  supported: every device holds the whole cache and block ids are global.
* **Both** on a 2-D mesh, e.g. batch over "data" and heads over "model".

Scheduler metadata (`get_mla_metadata`) is computed per shard inside the partitioned function, since the local
batch and head counts change `num_sm_parts` and `num_splits`. A metadata passed by the caller is used only when the
decode is not split at all (batch and heads unsharded); otherwise it is ignored (and XLA removes its computation).

Everything else is resharded with a `ReshardWarning` naming the operand, dimension and mesh axes (this costs
communication): sharding over the 576 / 512 / page-slot dims, over seqlen_q, over a stacked cache's layers (with
`layer=` the cache is [num_layers, num_blocks, ...] and the rules above apply to its dims 1-4), a cache sharded over
num_blocks while the batch is not (pages of one sequence on several devices: the cache is all-gathered, block ids
are global), a cache h_kv sharding that does not follow the q heads, a batch or head count the mesh axes do not
divide. These are errors (a ValueError raised while XLA compiles, so it reaches the caller wrapped in XLA's runtime
error): the cache sharded over num_blocks on mesh axes other than the batch's (whether block ids are local or global
would be a guess), and page pools that do not divide num_blocks or the batch.

`write_kv_cache` here follows the same page-pool convention (the plain jnp scatter in `jax_flash_mla.quant` treats
block ids as global: under a num_blocks-sharded cache it would gather and write the wrong pages). With a
num_blocks-sharded cache, its batch operands are sharded like the pools and each device scatters into its own pool;
with a replicated cache, every device applies every write.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Sequence

import jax
import jax.numpy as jnp
from jax._src import dispatch
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

from . import quant, validation
from .formats import HEAD_DIM_V
from .primitives import decode_p, schedule
from .primitives.base import new_primitive, sharding_free

__all__ = ["ReshardWarning", "decode", "write_kv_cache"]


class ReshardWarning(UserWarning):
    """An operand of a jax_flash_mla op was resharded (communication) because its sharding is not supported."""


# ----------------------------------------------------------------------------------------------------------------
# Sharding helpers: a dimension's sharding is the tuple of mesh axes (of size > 1) it is split over.

def _dims(sharding, ndim: int) -> list:
    if sharding is None:
        return [()] * ndim
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
        sizes = dict(sharding.mesh.shape)
        dims = []
        for entry in spec[:ndim]:
            names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            dims.append(tuple(n for n in names if sizes.get(n, 1) > 1))
        return dims
    if sharding.is_fully_replicated:
        return [()] * ndim
    raise ValueError(f"jax_flash_mla: cannot read the operand sharding {sharding}; pass NamedSharding inputs (or "
                     "jit under a mesh) so shardings map to mesh axes")


def _size(mesh, axes) -> int:
    return math.prod(dict(mesh.shape)[a] for a in axes)


def _named(mesh, dims) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(*[(a[0] if len(a) == 1 else a) if a else None for a in dims]))


def _fmt(axes) -> str:
    return "(" + ", ".join(repr(a) for a in axes) + ")"


def _spec(aval, ndim: int) -> tuple:
    """The PartitionSpec entries of an aval's type (explicit-sharding mode; all None otherwise)."""
    sharding = getattr(aval, "sharding", None)
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return spec + (None,) * (ndim - len(spec))


def _typed(like, shape, dtype, spec):
    """A result aval; under explicit sharding (a mesh on `like`'s type) it carries `spec` on that mesh."""
    sharding = getattr(like, "sharding", None)
    if isinstance(sharding, NamedSharding) and not sharding.mesh.empty:
        return jax.core.ShapedArray(shape, dtype, sharding=NamedSharding(sharding.mesh, PartitionSpec(*spec)))
    return jax.core.ShapedArray(shape, dtype)


class _Plan:
    """Target per-dimension shardings of one op's operands, with the reasons for each communicating reshard."""

    def __init__(self, op: str):
        self.op = op
        self.notes = []

    def want(self, name: str, dim_names: Sequence[str], have: list, target: list):
        """Records `target` for an operand; notes every dimension whose change moves data between devices."""
        for i, (h, t) in enumerate(zip(have, target)):
            if h == t or not h:  # unchanged, or replicated -> sharded (a local slice)
                continue
            self.notes.append(f"{name} dim {i} ({dim_names[i]}) sharded over {_fmt(h)} -> "
                              f"{_fmt(t) if t else 'replicated'}")
        return target

    def warn(self) -> None:
        if self.notes:
            warnings.warn(f"jax_flash_mla.{self.op}: unsupported sharding resharded (this communicates): "
                          + "; ".join(self.notes), ReshardWarning, stacklevel=2)


def _raise(op: str, message: str):
    raise ValueError(f"jax_flash_mla.{op}: {message}")


def _check_exportable(ctx, op: str):
    """jax.export cannot serialize custom_partitioning (its partitioner is a Python callback): say so, and what to
    do, instead of JAX's NotImplementedError about host callbacks. Under a fully manual jax.shard_map, or on one
    device, custom_partitioning lowers to the single-device op and the step exports."""
    if not getattr(ctx.module_context.lowering_parameters, "for_export", False):
        return
    axis_context = ctx.module_context.axis_context
    mesh = getattr(axis_context, "mesh", None)
    if mesh is not None:
        if set(getattr(axis_context, "manual_axes", ())) == set(mesh.axis_names):
            return
        devices = mesh.size
    else:
        devices = getattr(axis_context, "num_devices", 1)
    if devices > 1:
        _raise(op, f"jax.export cannot serialize a step that jit partitions over {devices} devices through this "
               "op's sharding rules (custom_partitioning); export the per-device step under jax.shard_map instead "
               "(README, 'Exporting')")


# ----------------------------------------------------------------------------------------------------------------
# Decode

_Q_DIMS = ("batch", "seqlen_q", "num_heads_q", "head_dim 576")
_CACHE_DIMS = ("num_blocks", "page slot", "num_heads_k", "last dim")


def _decode_plan(mesh, arg_shapes, use_given_meta: bool):
    """Returns (arg shardings, result shardings, plan, meta usable) for the decode operands."""
    q, k_cache, block_table, cache_seqlens, descale_q, descale_k, layer, meta = arg_shapes
    b, _, h_q, _ = q.shape
    lead = k_cache.ndim - 4  # 1 with layer=: k_cache [num_layers, num_blocks, 64, h_kv, d]
    num_blocks, _, h_kv, _ = k_cache.shape[lead:]
    plan = _Plan("flash_mla_with_kvcache")
    q_have = _dims(q.sharding, 4)
    k_have = _dims(k_cache.sharding, k_cache.ndim)
    batch, heads = q_have[0], q_have[2]
    pool = k_have[lead]
    if batch and b % _size(mesh, batch):
        if pool:
            _raise(plan.op, f"batch {b} (q dim 0) is not divisible by the {_size(mesh, batch)} shards of mesh "
                            f"axes {_fmt(batch)}, and the cache is split into page pools over {_fmt(pool)}")
        batch = ()  # replicated below (noted as a reshard)
    if heads and (h_q % _size(mesh, heads) or (h_kv > 1 and h_kv % _size(mesh, heads))):
        heads = ()  # the KV heads cannot follow: replicate the q heads
    kv_heads = k_have[lead + 2]
    if not heads and h_kv > 1 and kv_heads and h_kv % _size(mesh, kv_heads) == 0 \
            and not set(kv_heads) & set(batch):
        heads = kv_heads  # q follows a cache sharded over its KV heads: slicing q is free

    if pool and pool != batch:
        if batch:
            _raise(plan.op, f"k_cache dim {lead} (num_blocks) is sharded over mesh axes {_fmt(pool)} but the batch "
                            f"(q, block_table, cache_seqlens dim 0) over {_fmt(batch)}. Shard both over the same "
                            "axes (one page pool per batch shard, block ids local to the pool), or replicate the "
                            "cache's num_blocks (block ids global).")
        pool_target = ()  # pages of a sequence would be spread over devices: all-gather the cache
    else:
        pool_target = pool
    if pool_target and num_blocks % _size(mesh, pool_target):
        _raise(plan.op, f"num_blocks {num_blocks} (k_cache dim {lead}) is not divisible into "
                        f"{_size(mesh, pool_target)} page pools over mesh axes {_fmt(pool_target)}")

    kv_heads_target = heads if h_kv > 1 else ()
    if kv_heads_target and not kv_heads:
        plan.notes.append(f"k_cache dim {lead + 2} (num_heads_k) replicated -> sliced over {_fmt(kv_heads_target)} "
                          "(a copy of the cache slice on every call; shard the cache over num_heads_k like q)")
    shardings = [
        plan.want("q", _Q_DIMS, q_have, [batch, (), heads, ()]),
        plan.want("k_cache", ("num_layers",) * lead + _CACHE_DIMS, k_have,
                  [()] * lead + [pool_target, (), kv_heads_target, ()]),
        plan.want("block_table", ("batch", "max_blocks"), _dims(block_table.sharding, 2), [batch, ()]),
        plan.want("cache_seqlens", ("batch",), _dims(cache_seqlens.sharding, 1), [batch]),
        [()], [()],  # descales
    ]
    named = [_named(mesh, d) for d in shardings]
    named.append(None if layer is None else _named(mesh, [()]))
    if meta is not None:
        named.append(tuple(_named(mesh, [()] * len(m.shape)) for m in meta))
    else:
        named.append(None)
    results = (_named(mesh, [batch, (), heads, ()]), _named(mesh, [batch, heads, ()]))
    return tuple(named), results, plan, use_given_meta and not batch and not heads


def _decode_body(config, q, k_cache, block_table, cache_seqlens, descale_q, descale_k, layer, meta):
    """Single-device decode; computes the scheduler metadata for these (possibly per-shard) shapes if not given.

    With `layer` ([1]), k_cache [num_layers, num_blocks, ...] is read as one pool of num_layers * num_blocks pages
    (merging the leading dimensions of a row-major array is a bitcast, not a copy) and the layer's block ids are
    offset into it.
    """
    softmax_scale, causal, kv_format, ds_scales, implementation, num_sms = config
    if layer is not None:
        block_table = block_table + layer[0] * k_cache.shape[1]
        k_cache = k_cache.reshape((-1,) + k_cache.shape[2:])
    if meta is None:
        _, s_q, h_q, _ = q.shape
        h_kv = k_cache.shape[2]
        meta = schedule(cache_seqlens, s_q * h_q // h_kv, h_kv, num_sms=num_sms, implementation=implementation)
    sched, splits = meta
    out, lse = decode_p.bind(q, k_cache, block_table, cache_seqlens, sched, splits, descale_q, descale_k,
                             softmax_scale=softmax_scale, causal=causal, kv_format=kv_format,
                             ds_scales=ds_scales, implementation=implementation)
    return out, lse


_decode_cp = custom_partitioning(_decode_body, static_argnums=(0,))


def _decode_partition(config, mesh, arg_shapes, result_shape):
    arg_shardings, result_shardings, plan, use_meta = _decode_plan(mesh, arg_shapes, arg_shapes[-1] is not None)
    plan.warn()

    def per_shard(q, k_cache, block_table, cache_seqlens, descale_q, descale_k, layer, meta):
        return _decode_body(config, q, k_cache, block_table, cache_seqlens, descale_q, descale_k, layer,
                            meta if use_meta else None)

    return mesh, per_shard, result_shardings, arg_shardings


def _decode_infer(config, mesh, arg_shapes, result_shape):
    return _decode_plan(mesh, arg_shapes, False)[1]


def _decode_rule(config, mesh, operand_types, result_types):
    # Only q shares factors (with the results): every other operand's sharding reaches `partition` as it is, so the
    # plan, not the propagation, decides what is resharded and warns about it.
    has_layer = len(operand_types[1].shape) == 5
    operands = f"b s h d, {'l ' if has_layer else ''}n p k e, tb tm, lb, dq, dk{', ly' if has_layer else ''}"
    if len(operand_types) == 8 + has_layer:
        operands += ", mp mi, ns"
    return operands + " -> b s h v, b h s"


_decode_cp.def_partition(partition=_decode_partition, infer_sharding_from_operands=_decode_infer,
                         sharding_rule=_decode_rule)


def _decode_abstract(q, k_cache, block_table, cache_seqlens, descale_q, descale_k, *extra, softmax_scale, causal,
                     kv_format, ds_scales, implementation, num_sms):
    b, s_q, h_q, _ = q.shape
    batch, _, heads, _ = _spec(q, 4)
    return (_typed(q, (b, s_q, h_q, HEAD_DIM_V), jnp.bfloat16, (batch, None, heads, None)),
            _typed(q, (b, h_q, s_q), jnp.float32, (batch, heads, None)))


def _decode_lowering(ctx, *args, softmax_scale, causal, kv_format, ds_scales, implementation, num_sms):
    _check_exportable(ctx, "flash_mla_with_kvcache")
    config = (softmax_scale, causal, kv_format, ds_scales, implementation, num_sms)

    def fn(q, k_cache, block_table, cache_seqlens, descale_q, descale_k, *extra):
        layer, meta = (extra[0], extra[1:]) if k_cache.ndim == 5 else (None, extra)  # a stack of layers
        return _decode_cp(config, q, k_cache, block_table, cache_seqlens, descale_q, descale_k, layer,
                          tuple(meta) if meta else None)

    return mlir.lower_fun(fn, multiple_results=True)(sharding_free(ctx), *args)


decode_spmd_p = new_primitive("jax_flash_mla_partitioned_decode", _decode_abstract, "jax_flash_mla decode")
dispatch.prim_requires_devices_during_lowering.add(decode_spmd_p)  # lowers to custom_partitioning
mlir.register_lowering(decode_spmd_p, _decode_lowering)


def decode(q, k_cache, block_table, cache_seqlens, descale_q, descale_k, meta=None, layer=None, *,
           softmax_scale: float, causal: bool, kv_format: str, implementation: str, num_sms: int,
           ds_scales: str = "group"):
    """Partition-aware decode for `flash_mla_with_kvcache` (arguments already validated and normalized).

    meta: None (computed per shard) or (tile_scheduler_metadata, num_splits), used only when nothing is split.
    layer: None, or an int32 scalar: k_cache stacks the layers' caches and the decode reads that layer's.
    """
    extra = (() if layer is None else (jnp.reshape(layer, (1,)),)) + (() if meta is None else tuple(meta))
    return tuple(decode_spmd_p.bind(q, k_cache, block_table, cache_seqlens, descale_q, descale_k, *extra,
                                    softmax_scale=float(softmax_scale), causal=bool(causal), kv_format=kv_format,
                                    ds_scales=ds_scales, implementation=implementation, num_sms=int(num_sms)))


# ----------------------------------------------------------------------------------------------------------------
# Cache write

_NEW_KV_DIMS = ("batch", "s_new", "num_heads_k", "head_dim 576")


def _write_plan(mesh, arg_shapes):
    cache, new_kv, block_table, positions, scale, layer = arg_shapes
    lead = cache.ndim - 4  # 1 with layer=: cache [num_layers, num_blocks, 64, h_kv, d]
    num_blocks, _, h_kv, _ = cache.shape[lead:]
    b = new_kv.shape[0]
    plan = _Plan("write_kv_cache")
    c_have = _dims(cache.sharding, cache.ndim)
    pool, kv_heads = c_have[lead], c_have[lead + 2]
    if pool and (num_blocks % _size(mesh, pool) or b % _size(mesh, pool)):
        _raise(plan.op, f"the cache is split into {_size(mesh, pool)} page pools over mesh axes {_fmt(pool)} "
                        f"(num_blocks), which must divide num_blocks {num_blocks} and the batch {b} (new_kv dim 0)")
    if kv_heads and h_kv % _size(mesh, kv_heads):
        kv_heads = ()
    batch_sharded = any(_dims(x.sharding, x.ndim)[0] for x in (new_kv, block_table, positions))
    cache_target = [()] * lead + [pool, (), kv_heads, ()]
    shardings = [
        plan.want("cache", ("num_layers",) * lead + _CACHE_DIMS, c_have, cache_target),
        plan.want("new_kv", _NEW_KV_DIMS, _dims(new_kv.sharding, 4), [pool, (), kv_heads, ()]),
        plan.want("block_table", ("batch", "max_blocks"), _dims(block_table.sharding, 2), [pool, ()]),
        plan.want("positions", ("batch", "s_new"), _dims(positions.sharding, 2), [pool, ()]),
    ]
    if batch_sharded and not pool:
        plan.notes.append("(the cache's num_blocks is replicated, so every device applies every write; shard it over "
                          "the batch axes for one page pool per batch shard)")
    named = [_named(mesh, d) for d in shardings]
    named += [None if x is None else _named(mesh, [()] * len(x.shape)) for x in (scale, layer)]
    return tuple(named), _named(mesh, shardings[0]), plan


def _write_body(write_format, cache, new_kv, block_table, positions, scale, layer):
    kv_format, ds_scales = write_format
    return quant.write_kv_cache(cache, new_kv, block_table, positions, kv_format, scale, ds_scales=ds_scales,
                                **({} if layer is None else {"layer": layer[0]}))


_write_cp = custom_partitioning(_write_body, static_argnums=(0,))


def _write_partition(write_format, mesh, arg_shapes, result_shape):
    arg_shardings, result_sharding, plan = _write_plan(mesh, arg_shapes)
    plan.warn()
    return mesh, functools.partial(_write_body, write_format), result_sharding, arg_shardings


def _write_infer(write_format, mesh, arg_shapes, result_shape):
    return _write_plan(mesh, arg_shapes)[1]


def _write_rule(write_format, mesh, operand_types, result_types):
    # Operands: cache, new_kv, block_table, positions, then scale [1] and / or layer [1] when given.
    cache = "l n p k e" if len(operand_types[0].shape) == 5 else "n p k e"
    extra = "".join(f", x{i}" for i in range(len(operand_types) - 4))
    return f"{cache}, nb ns nk nd, tb tm, pb ps{extra} -> {cache}"


_write_cp.def_partition(partition=_write_partition, infer_sharding_from_operands=_write_infer,
                        sharding_rule=_write_rule)


def _write_abstract(cache, new_kv, block_table, positions, *extra, kv_format, ds_scales, has_scale, has_layer):
    return (cache,)


def _write_lowering(ctx, *args, kv_format, ds_scales, has_scale, has_layer):
    _check_exportable(ctx, "write_kv_cache")

    def fn(cache, new_kv, block_table, positions, *extra):
        extra = list(extra)
        scale = extra.pop(0) if has_scale else None
        layer = extra.pop(0) if has_layer else None
        return (_write_cp((kv_format, ds_scales), cache, new_kv, block_table, positions, scale, layer),)

    return mlir.lower_fun(fn, multiple_results=True)(sharding_free(ctx), *args)


write_spmd_p = new_primitive("jax_flash_mla_partitioned_write_kv_cache", _write_abstract,
                             "jax_flash_mla write_kv_cache")
dispatch.prim_requires_devices_during_lowering.add(write_spmd_p)  # lowers to custom_partitioning
mlir.register_lowering(write_spmd_p, _write_lowering)


def write_kv_cache(cache, new_kv, block_table, positions, kv_format: str, scale=None, *, layer=None,
                   ds_scales: str = "group"):
    """`jax_flash_mla.write_kv_cache` that partitions: same arguments (`layer=`, `ds_scales=` included), result,
    dropping rules.

    Block ids follow the decode's page-pool convention: with the cache's num_blocks sharded over some mesh axes, the
    batch rows (new_kv, block_table, positions dim 0) are split over the same axes and each row's block ids index its
    own pool (local ids); with num_blocks replicated they are global. Under `jax.jit(..., donate_argnums=...)` each
    device updates its cache shard in place, with no communication. Unsupported shardings are resharded with a
    ReshardWarning, as for the decode.
    """
    cache, new_kv = map(jnp.asarray, (cache, new_kv))
    block_table, positions = quant.index_array("block_table", block_table), quant.index_array("positions", positions)
    scale, layer = (None if x is None else jnp.asarray(x) for x in (scale, layer))
    # Argument checks of the single-device op, on sharding-free shapes.
    spec = lambda x: None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype)
    jax.eval_shape(functools.partial(quant.write_kv_cache, kv_format=kv_format, ds_scales=ds_scales),
                   *[spec(x) for x in (cache, new_kv, block_table, positions)], scale=spec(scale), layer=spec(layer))
    if scale is not None:
        validation.check_positive_scale_value("scale", scale)  # eval_shape saw only its shape
    extra = []
    if scale is not None:
        extra.append(scale.astype(jnp.float32).reshape((1,)))
    if layer is not None:
        extra.append(layer.astype(jnp.int32).reshape((1,)))
    (out,) = write_spmd_p.bind(cache, new_kv, block_table, positions.astype(jnp.int32), *extra, kv_format=kv_format,
                               ds_scales=ds_scales, has_scale=scale is not None, has_layer=layer is not None)
    return out
