"""Split-KV scheduler: `num_sm_parts` and the jnp twin of the CUDA kernel `cpp/kernels/smxx/sched_meta.cu`.

docs/DESIGN.md ("Split-KV scheduling") specifies the walk. Each sequence costs ceil(len / 64) pages plus a fixed
F = 5; P partitions get a budget of `payload = ceil(total / P) + F` pages each and take sequences in order, finishing
whole ones while they fit and then a partial chunk of the next one if more than F pages of budget are left.
Whole-sequence mode replaces that when it costs at most F more: the smallest budget W in ceil(total / P) ..
ceil(total / P) + 2F with which whole sequences alone fit in P partitions becomes the payload, and no sequence is
split (so no partials and nothing for the combine to merge; e.g. 128 equal sequences over 66 partitions). W must also
be at most 2.5 ceil(total / P): a few short sequences, whole, would leave most partitions idle.

The twin here does not step one sequence at a time: per partition it finishes the current (possibly partly taken)
sequence, then finds how many whole sequences fit with a binary search over the prefix sums of the costs, then takes
the partial chunk. The CUDA kernel steps through 32-sequence windows instead. Both give the pseudocode's result
exactly while the int32 sum of costs does not overflow (sum(ceil(len / 64) + 5) < 2^31).

Output (`sched_meta` int32[P, 8], one row per partition, the layout of `SchedMeta` in cpp/params.h):
    [begin_batch, begin_token, end_batch, end_token, begin_split_idx, total_pages, 0, 0]
A partition processes batches begin_batch .. end_batch, from begin_token in the first and up to end_token
(exclusive) in the last; begin_batch > end_batch marks an empty partition. `total_pages`, the same in every row, is
the batch's page count: the decode kernel sizes its L2 evict-first hint with it. `num_splits` int32[b + 1] holds the
cumulative number of chunks per sequence (num_splits[0] = 0).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .formats import PAGE_SIZE

FIXED_OVERHEAD_PAGES = 5  # config::kSchedFixedOverheadPages: per-chunk cost of epilogue / combine
WHOLE_SEQUENCE_CANDIDATES = 2 * FIXED_OVERHEAD_PAGES + 1  # budgets ceil(total / P) + 0 .. 2F tried whole
ROWS_PER_TILE = 64  # query rows per CTA (config::kRowsPerTile)
SCHED_META_INTS = 8  # ints per partition (config::kSchedMetaInts)

# Column indices of a sched_meta row.
BEGIN_BATCH, BEGIN_TOKEN, END_BATCH, END_TOKEN, BEGIN_SPLIT, TOTAL_PAGES = range(6)


def num_sm_parts(num_sms: int, num_q_tokens_per_head_k: int, num_heads_k: int) -> int:
    """Partitions per (KV head, row tile): `max(num_sms // h_kv // ceil(rows / 64), 1)`.

    `num_q_tokens_per_head_k` is the number of query rows one KV head serves, s_q * h_q / h_kv.
    """
    for name, value in (("num_sms", num_sms), ("num_q_tokens_per_head_k", num_q_tokens_per_head_k),
                        ("num_heads_k", num_heads_k)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    num_m_blocks = -(-int(num_q_tokens_per_head_k) // ROWS_PER_TILE)
    return max(int(num_sms) // int(num_heads_k) // num_m_blocks, 1)


def _pages(lens):
    """ceil(max(len, 0) / 64) in int32, written as the kernel's pages_of (no overflow near INT32_MAX)."""
    lens = jnp.maximum(lens, 0)
    return (lens >> 6) + ((lens & 63) != 0).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames="num_sm_parts")
def sched_meta_reference(cache_seqlens, num_sm_parts: int):
    """Scheduler metadata for `cache_seqlens` int32[b] over `num_sm_parts` partitions.

    Returns `(sched_meta int32[num_sm_parts, 8], num_splits int32[b + 1])`, bit-exact with the CUDA kernel.
    """
    if int(num_sm_parts) != num_sm_parts or num_sm_parts < 1:
        raise ValueError(f"num_sm_parts must be a positive integer, got {num_sm_parts!r}")
    lens = jnp.asarray(cache_seqlens)
    if lens.ndim != 1:
        raise ValueError(f"cache_seqlens must be int32[batch], got shape {lens.shape}")
    lens = lens.astype(jnp.int32)
    parts = int(num_sm_parts)
    batch = lens.shape[0]
    f = jnp.int32(FIXED_OVERHEAD_PAGES)

    if batch == 0:  # every partition is empty: begin (0, 0, 0), end (-1, 0)
        row = jnp.array([0, 0, -1, 0, 0, 0, 0, 0], jnp.int32)
        return jnp.tile(row, (parts, 1)), jnp.zeros((1,), jnp.int32)

    pages = _pages(lens)
    # cost_prefix[i] = sum of (pages + F) over sequences < i; strictly increasing since every cost >= F.
    cost_prefix = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(pages + f, dtype=jnp.int32)])
    total = cost_prefix[batch]
    total_pages = total - f * batch  # int32, wrapping as the kernel's unsigned sum does
    lower = lax.div(total, jnp.int32(parts)) + (lax.rem(total, jnp.int32(parts)) != 0).astype(jnp.int32)

    def fits_whole(budget):
        """Whether taking whole sequences while they fit in `budget` places them all within the P partitions."""
        def partition(cur, _):
            limit = cost_prefix[cur] + budget
            return jnp.searchsorted(cost_prefix, limit, side="right").astype(jnp.int32) - 1, None

        done, _ = lax.scan(partition, jnp.int32(0), None, length=parts)
        return done == batch

    candidates = lower + jnp.arange(WHOLE_SEQUENCE_CANDIDATES, dtype=jnp.int32)
    # Whole sequences only at a budget of at most 2.5 lower (2 W <= 5 lower, i.e. 2 w <= 3 lower for W = lower + w
    # with w <= 2F), where they keep at least ~40 % of the partitions busy.
    busy_enough = 2 * jnp.arange(WHOLE_SEQUENCE_CANDIDATES, dtype=jnp.int32) <= 3 * jnp.minimum(lower, 2 * f)
    fits = jax.vmap(fits_whole)(candidates) & busy_enough
    whole = fits.any()
    payload = jnp.where(whole, candidates[jnp.argmax(fits)], lower + f)

    def partition(carry, _):
        cur, page0, split0 = carry  # first unfinished sequence, its pages / chunks given out already
        cur_safe = jnp.minimum(cur, batch - 1)
        active = cur < batch
        remain = payload

        # 1. The current sequence, maybe partly taken by earlier partitions.
        rest = pages[cur_safe] - page0
        finish_first = active & (remain >= rest + f)
        remain = jnp.where(finish_first, remain - rest - f, remain)
        nxt = jnp.where(finish_first, cur + 1, cur)

        # 2. Whole sequences while they fit: the last m with cost_prefix[m] - cost_prefix[nxt] <= remain.
        limit = cost_prefix[nxt] + remain
        last = jnp.searchsorted(cost_prefix, limit, side="right").astype(jnp.int32) - 1
        last = jnp.where(finish_first, jnp.clip(last, nxt, batch), nxt)
        remain = remain - (cost_prefix[last] - cost_prefix[nxt])

        # 3. A partial chunk of the first sequence that did not fit, if the overhead leaves budget.
        take = (last < batch) & (remain > f) & ~whole
        page = jnp.where(finish_first, 0, page0) + jnp.where(take, remain - f, 0)
        split = jnp.where(finish_first, 0, split0) + take.astype(jnp.int32)

        prev_len = jnp.where(last > 0, lens[jnp.maximum(last - 1, 0)], 0)
        end_batch = jnp.where(page > 0, last, last - 1)
        end_token = jnp.where(page > 0, page * PAGE_SIZE, prev_len)
        zero = jnp.int32(0)
        row = jnp.stack([cur, page0 * PAGE_SIZE, end_batch, end_token, split0, total_pages, zero, zero])
        partial_batch = jnp.where(take, last, batch)  # sequence that got a partial chunk (batch: none)
        return (last, page, split), (row, partial_batch)

    init = (jnp.int32(0), jnp.int32(0), jnp.int32(0))
    _, (meta, partial_batch) = lax.scan(partition, init, None, length=parts)

    # num_splits[i + 1] = sum over sequences <= i of (chunks) = (i + 1) + partial chunks taken of sequences <= i.
    partial_counts = jnp.zeros((batch + 1,), jnp.int32).at[partial_batch].add(1)
    num_splits = jnp.arange(1, batch + 1, dtype=jnp.int32) + jnp.cumsum(partial_counts[:batch], dtype=jnp.int32)
    return meta.astype(jnp.int32), jnp.concatenate([jnp.zeros((1,), jnp.int32), num_splits])


__all__ = ["num_sm_parts", "sched_meta_reference", "PAGE_SIZE", "FIXED_OVERHEAD_PAGES", "WHOLE_SEQUENCE_CANDIDATES",
           "SCHED_META_INTS"]
