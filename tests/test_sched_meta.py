"""Split-KV scheduler: the jnp twin against a plain-Python transcription of docs/DESIGN.md, the walk's invariants,
and (on an sm_90 GPU with the extension built) the CUDA kernel against the twin, bit for bit.

Set JAX_FLASH_MLA_REQUIRE_GPU=1 to turn the GPU test's skips into failures (scripts/gpu_check.sh does).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flash_mla import _ffi
from jax_flash_mla.validation import check_sched_meta_values
from jax_flash_mla.scheduler import (FIXED_OVERHEAD_PAGES, PAGE_SIZE, SCHED_META_INTS, num_sm_parts,
                                     sched_meta_reference)

import stale_schedules

F = FIXED_OVERHEAD_PAGES


# ---------------------------------------------------------------------------------------------------------------
# Independent implementations


def _pages(length: int) -> int:
    return -(-max(length, 0) // PAGE_SIZE)


def fits_whole(costs, parts, budget):
    """Whether taking whole sequences in order while they fit in `budget` places all of them within `parts`."""
    used, remain = 0, 0
    for cost in costs:
        if cost > remain:  # the next partition starts with this sequence
            used, remain = used + 1, budget
        if cost > remain or used > parts:
            return False
        remain -= cost
    return True


def spec_budget(lens, parts):
    """docs/DESIGN.md's choice of budget: (payload, whether sequences may be split)."""
    costs = [_pages(int(x)) + F for x in lens]
    lower = -(-sum(costs) // parts)
    for budget in range(lower, lower + 2 * F + 1):
        if 2 * budget <= 5 * lower and fits_whole(costs, parts, budget):
            return budget, False
    return lower + F, True


def spec_walk(lens, parts):
    """docs/DESIGN.md's pseudocode, line by line, in plain Python ints."""
    lens = [int(x) for x in lens]
    b = len(lens)
    pages = [_pages(x) for x in lens]
    payload, split_ok = spec_budget(lens, parts)
    meta = np.zeros((parts, SCHED_META_INTS), np.int64)
    num_splits = np.zeros(b + 1, np.int64)
    batch = page = split = cum = 0
    for p in range(parts):
        meta[p, 0], meta[p, 1], meta[p, 4] = batch, page * PAGE_SIZE, split
        remain = payload
        while batch < b:
            rest = pages[batch] - page
            if remain >= rest + F:
                cum += split + 1
                num_splits[batch + 1] = cum
                remain -= rest + F
                batch += 1
                page = split = 0
            else:
                if split_ok and remain > F:
                    page += remain - F
                    split += 1
                break
        if page > 0:
            meta[p, 2], meta[p, 3] = batch, page * PAGE_SIZE
        else:
            meta[p, 2], meta[p, 3] = batch - 1, (lens[batch - 1] if batch > 0 else 0)
        meta[p, 5] = sum(pages)
    return meta, num_splits


def window_walk(lens, parts, window=32, chunk=4096):
    """The CUDA kernel's formulation (windows of `window` sequences scanned at once, lengths staged `chunk` at a
    time), emulated in Python, so the kernel's algorithm is exercised on machines without a GPU."""
    lens = [int(x) for x in lens]
    b = len(lens)
    total = sum(_pages(x) + F for x in lens)
    lower = -(-total // parts)

    # Whole-sequence candidates, one per warp: each walks the staged windows, opening a partition for the first
    # sequence that does not fit the current one.
    fit_budgets = []
    for budget in range(lower, lower + 2 * F + 1):
        part, remain, batch, is_open = 0, 0, 0, False
        for chunk_begin in range(0, b, chunk):
            chunk_end = min(b, chunk_begin + chunk)
            while part < parts and batch < chunk_end:
                if not is_open:
                    is_open, remain = True, budget
                seqs = list(range(batch, min(batch + window, chunk_end)))
                prefix = np.cumsum([_pages(lens[q]) + F for q in seqs])
                n = int(np.sum(prefix <= remain))
                if n == 0 and remain == budget:  # a sequence longer than the budget: never fits
                    part = parts
                    break
                if n:
                    remain -= int(prefix[n - 1])
                    batch += n
                if n < len(seqs):
                    is_open, part = False, part + 1
        fit_budgets.append(batch == b and 2 * budget <= 5 * lower)
    whole = any(fit_budgets)
    payload = lower + fit_budgets.index(True) if whole else lower + F

    meta = np.zeros((parts, SCHED_META_INTS), np.int64)
    num_splits = np.zeros(b + 1, np.int64)
    st = dict(part=0, open=False, begin=None, remain=0, batch=0, page=0, split=0, cum=0, last_len=0)

    def open_part():
        st.update(open=True, begin=(st["batch"], st["page"] * PAGE_SIZE, st["split"]), remain=payload)

    def close_part():
        bb, bt, bs = st["begin"]
        if st["page"] > 0:
            end = (st["batch"], st["page"] * PAGE_SIZE)
        else:
            end = (st["batch"] - 1, st["last_len"])
        meta[st["part"], :6] = (bb, bt, end[0], end[1], bs, total - F * b)
        st.update(open=False, part=st["part"] + 1)

    for chunk_begin in range(0, b, chunk):
        chunk_end = min(b, chunk_begin + chunk)
        while st["part"] < parts and st["batch"] < chunk_end:
            if not st["open"]:
                open_part()
            seqs = list(range(st["batch"], min(st["batch"] + window, chunk_end)))
            costs = [_pages(lens[s]) - (st["page"] if j == 0 else 0) + F for j, s in enumerate(seqs)]
            prefix = np.cumsum(costs)
            fits = int(np.sum(prefix <= st["remain"]))
            for j in range(fits):
                num_splits[seqs[j] + 1] = st["cum"] + st["split"] + j + 1
            if fits:
                st["remain"] -= int(prefix[fits - 1])
                st["last_len"] = lens[seqs[fits - 1]]
                st.update(cum=st["cum"] + st["split"] + fits, batch=st["batch"] + fits, page=0, split=0)
            if fits < len(seqs):
                if not whole and st["remain"] > F:
                    st.update(page=st["page"] + st["remain"] - F, split=st["split"] + 1)
                close_part()
            elif st["batch"] == b:
                close_part()
    while st["part"] < parts:
        open_part()
        close_part()
    return meta, num_splits


def check_invariants(lens, parts, meta, num_splits):
    """What the decode and combine kernels rely on, checked from the outputs alone."""
    lens = [int(x) for x in lens]
    b = len(lens)
    meta = np.asarray(meta)
    num_splits = np.asarray(num_splits)
    assert meta.shape == (parts, SCHED_META_INTS) and num_splits.shape == (b + 1,)
    assert (meta[:, 5] == sum(_pages(x) for x in lens)).all(), "every row holds the batch's page count"
    assert (meta[:, 6:] == 0).all(), "padding must be zero"
    assert num_splits[0] == 0 and (np.diff(num_splits) >= 1).all()
    assert num_splits[b] <= b + parts, "partial buffers hold b + P splits"

    payload, split_ok = spec_budget(lens, parts)
    chunks = [[] for _ in range(b)]  # per sequence: (partition, start, stop) in partition order
    seen_empty = False
    for p in range(parts):
        bb, bt, eb, et, bs = (int(v) for v in meta[p, :5])
        if bb > eb:  # empty partition: only after all the work
            seen_empty = True
            continue
        assert not seen_empty, f"partition {p} has work after an empty partition"
        assert 0 <= bb <= eb < b
        assert bt % PAGE_SIZE == 0
        assert bs == len(chunks[bb]), f"partition {p}: begin_split_idx {bs}, but {len(chunks[bb])} earlier chunks"
        cost = 0
        for i in range(bb, eb + 1):
            start = bt if i == bb else 0
            stop = et if i == eb else lens[i]
            assert start < stop or (lens[i] == 0 and start == stop == 0), (p, i, start, stop)
            chunks[i].append((p, start, stop))
            cost += _pages(stop) - start // PAGE_SIZE + F
        assert cost <= payload, f"partition {p} costs {cost} > payload {payload}"
    for i, got in enumerate(chunks):
        assert got, f"sequence {i} is never scheduled"
        assert got[0][1] == 0 and got[-1][2] == lens[i], (i, got)
        for (_, _, stop), (_, start, _) in zip(got, got[1:]):
            assert stop == start, f"sequence {i}: chunks {got} are not contiguous"
        assert len(got) == num_splits[i + 1] - num_splits[i], (i, got, num_splits[i:i + 2])
        assert split_ok or len(got) == 1, f"sequence {i} is split in whole-sequence mode: {got}"


def kernel_reads_every_key_once(meta, num_splits, lens) -> bool:
    """Whether the decode kernel, given this metadata, reads each key of `lens` exactly once and writes each of the
    num_splits partials once: a transcription of make_chunk / for_each_chunk (cpp/kernels/sm90/decode/
    splitkv_mla.cuh) and of the consumers' page loops (pages first_page() .. end_page() - 1, whole but for the
    tokens past the chunk's end, which are masked), token by token."""
    partials = [[] for _ in lens]
    for bb, bt, eb, et, bs in np.asarray(meta)[:, :5].tolist():
        for i in range(bb, eb + 1):
            seqlen = int(lens[i])
            split = bs if i == bb else 0
            last = split == num_splits[i + 1] - num_splits[i] - 1
            end = min(et, seqlen) if i == eb and not last else seqlen
            begin = min(bt if i == bb else 0, -(-end // PAGE_SIZE) * PAGE_SIZE)
            partials[i].append((split, begin, end))
    for i, chunks in enumerate(partials):
        if sorted(split for split, _, _ in chunks) != list(range(num_splits[i + 1] - num_splits[i])):
            return False
        reads = np.zeros(int(lens[i]), np.int64)
        for _, begin, end in chunks:
            first_page, end_page = begin // PAGE_SIZE, -(-end // PAGE_SIZE)
            for page in range(first_page, end_page):
                reads[page * PAGE_SIZE:min(end, (page + 1) * PAGE_SIZE)] += 1
        if (reads != 1).any():
            return False
    return True


# ---------------------------------------------------------------------------------------------------------------
# Inputs


def make_lens(kind: str, b: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed + 7919 * b)
    if kind == "uniform":
        return rng.integers(0, 20000, b).astype(np.int32)
    if kind == "zeros":
        return np.zeros(b, np.int32)
    if kind == "equal":
        return np.full(b, 8192, np.int32)
    if kind == "one_long":
        lens = np.zeros(b, np.int32)
        lens[rng.integers(0, b)] = 131072
        return lens
    if kind == "heavy_tail":
        lens = rng.integers(1, 300, b)
        lens[rng.random(b) < 0.05] = rng.integers(10000, 100000)
        return lens.astype(np.int32)
    if kind == "mixed_zero":  # varlen with zero-length and page-edge sequences
        lens = rng.integers(0, 5000, b)
        lens[rng.random(b) < 0.3] = 0
        lens[rng.random(b) < 0.2] = PAGE_SIZE * rng.integers(1, 40)
        return lens.astype(np.int32)
    raise ValueError(kind)


KINDS = ("uniform", "zeros", "equal", "one_long", "heavy_tail", "mixed_zero")
SHAPES = [(1, 1), (1, 132), (2, 1), (3, 7), (7, 78), (64, 1), (64, 66), (129, 132), (1000, 33), (4096, 1),
          (4096, 132), (4100, 66)]


# ---------------------------------------------------------------------------------------------------------------
# Tests (CPU)


def test_num_sm_parts():
    assert num_sm_parts(132, 1 * 128, 1) == 66  # C1: s_q 1, h_q 128 -> 2 row tiles
    assert num_sm_parts(132, 2 * 128, 1) == 33
    assert num_sm_parts(132, 16, 1) == 132
    assert num_sm_parts(132, 64, 1) == 132
    assert num_sm_parts(132, 65, 1) == 66
    assert num_sm_parts(132, 16, 2) == 66
    assert num_sm_parts(132, 1, 200) == 1
    with pytest.raises(ValueError):
        num_sm_parts(132, 0, 1)


@pytest.mark.parametrize("b,parts", SHAPES)
def test_twin_matches_spec(b, parts):
    for kind in KINDS:
        lens = make_lens(kind, b)
        want_meta, want_splits = spec_walk(lens, parts)
        check_invariants(lens, parts, want_meta, want_splits)
        meta, splits = sched_meta_reference(jnp.asarray(lens), parts)
        assert meta.dtype == jnp.int32 and splits.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(meta), want_meta, err_msg=f"{kind} b={b} P={parts}")
        np.testing.assert_array_equal(np.asarray(splits), want_splits, err_msg=f"{kind} b={b} P={parts}")


def test_spec_random_sweep():
    """Many random (b, P, lengths): invariants of the walk, and the kernel's windowed formulation equals it."""
    rng = np.random.default_rng(1234)
    for trial in range(300):
        b = int(rng.choice([1, 2, 3, 5, 31, 32, 33, 100, 257, 1000]))
        parts = int(rng.integers(1, 133))
        scale = int(rng.choice([1, 64, 300, 5000, 100000]))
        lens = rng.integers(0, scale + 1, b).astype(np.int32)
        lens[rng.random(b) < 0.1] = 0
        meta, splits = spec_walk(lens, parts)
        check_invariants(lens, parts, meta, splits)
        window, chunk = [(32, 4096), (32, 37), (4, 5), (1, 1)][trial % 4]
        wmeta, wsplits = window_walk(lens, parts, window, chunk)
        np.testing.assert_array_equal(wmeta, meta, err_msg=f"trial {trial}")
        np.testing.assert_array_equal(wsplits, splits, err_msg=f"trial {trial}")


def test_window_walk_large_batch():
    for b, parts in ((4096, 132), (9000, 132), (9000, 1)):
        lens = make_lens("mixed_zero", b)
        meta, splits = spec_walk(lens, parts)
        check_invariants(lens, parts, meta, splits)
        wmeta, wsplits = window_walk(lens, parts)
        np.testing.assert_array_equal(wmeta, meta)
        np.testing.assert_array_equal(wsplits, splits)


def test_empty_partitions_and_zero_lengths():
    lens = np.array([0, 0, 0], np.int32)
    meta, splits = sched_meta_reference(jnp.asarray(lens), 8)
    meta, splits = np.asarray(meta), np.asarray(splits)
    np.testing.assert_array_equal(splits, [0, 1, 2, 3])
    # 3 sequences of cost F each, payload ceil(15 / 8) + F = 7: one sequence per partition, then empty ones.
    np.testing.assert_array_equal(meta[:3, :5], [[0, 0, 0, 0, 0], [1, 0, 1, 0, 0], [2, 0, 2, 0, 0]])
    assert (meta[3:, 0] > meta[3:, 2]).all()
    np.testing.assert_array_equal(meta[3:, :5], np.tile([3, 0, 2, 0, 0], (5, 1)))


def test_single_long_sequence_splits_evenly():
    lens = np.array([64 * 1000], np.int32)
    meta, splits = sched_meta_reference(jnp.asarray(lens), 4)
    meta, splits = np.asarray(meta), np.asarray(splits)
    # total 1005 pages, payload 252 + 5 = 257: three partial chunks of 252 pages, the rest 244 in the last.
    np.testing.assert_array_equal(splits, [0, 4])
    np.testing.assert_array_equal(meta[:, :5], [[0, 0, 0, 252 * 64, 0], [0, 252 * 64, 0, 504 * 64, 1],
                                                [0, 504 * 64, 0, 756 * 64, 2], [0, 756 * 64, 0, 64000, 3]])


def test_whole_sequences_when_they_cost_at_most_f_more():
    """C1's batch (128 x 8192 tokens over 66 partitions): two whole sequences a partition (budget 266 against the
    split schedule's 263 + F), so nothing is split and the combine has nothing to merge. C2's (33 partitions) would
    need 532 > 521 + F: split as before, every partition at most 521 (check_invariants)."""
    lens = np.full(128, 8192, np.int32)
    assert spec_budget(lens, 66) == (266, False)
    meta, splits = (np.asarray(x) for x in sched_meta_reference(jnp.asarray(lens), 66))
    np.testing.assert_array_equal(splits, np.arange(129))
    np.testing.assert_array_equal(meta[:64, :5], [[2 * p, 0, 2 * p + 1, 8192, 0] for p in range(64)])
    assert (meta[64:, 0] > meta[64:, 2]).all()
    check_invariants(lens, 66, meta, splits)

    assert spec_budget(lens, 33) == (521, True)
    meta, splits = (np.asarray(x) for x in sched_meta_reference(jnp.asarray(lens), 33))
    assert splits[-1] > 128
    check_invariants(lens, 33, meta, splits)


def test_short_sequences_split_where_whole_ones_would_leave_most_partitions_idle():
    """32 sequences of 512 tokens over 132 partitions (h_q 16): whole, each would cost 13 pages of budget against
    lower = 4, one sequence on each of 32 CTAs; the budget may be at most 2.5 lower, so the split schedule gives 64
    partitions 4 pages each. 64 such sequences (lower 7) stay whole on 64 partitions."""
    lens = np.full(32, 512, np.int32)
    assert spec_budget(lens, 132) == (9, True)
    meta, splits = (np.asarray(x) for x in sched_meta_reference(jnp.asarray(lens), 132))
    np.testing.assert_array_equal(splits, np.arange(0, 65, 2))
    np.testing.assert_array_equal(meta[:64, :5], [[p // 2, (p % 2) * 256, p // 2, 256 * (p % 2 + 1), p % 2]
                                                  for p in range(64)])
    check_invariants(lens, 132, meta, splits)

    lens = np.full(64, 512, np.int32)
    assert spec_budget(lens, 132) == (13, False)
    meta, splits = (np.asarray(x) for x in sched_meta_reference(jnp.asarray(lens), 132))
    np.testing.assert_array_equal(splits, np.arange(65))
    check_invariants(lens, 132, meta, splits)


@pytest.mark.parametrize("b,parts", [(128, 66), (64, 66), (200, 132), (7, 3), (1000, 33), (33, 32)])
def test_whole_sequence_budget_is_the_smallest(b, parts):
    """The whole-sequence budget is the smallest that fits; one page less would need more than P partitions."""
    rng = np.random.default_rng(b * 1000 + parts)
    for trial in range(40):
        base = int(rng.integers(1, 20000))
        lens = (base + rng.integers(-64 * trial, 64 * trial + 1, b)).clip(0).astype(np.int32)
        budget, split_ok = spec_budget(lens, parts)
        costs = [_pages(int(x)) + F for x in lens]
        lower = -(-sum(costs) // parts)
        if split_ok:
            assert budget == lower + F
            continue
        assert lower <= budget <= min(lower + 2 * F, 5 * lower // 2)
        assert fits_whole(costs, parts, budget)
        assert budget == lower or not fits_whole(costs, parts, budget - 1), (budget, lens)


def test_value_check_accepts_exactly_what_the_kernel_reads_right():
    """check_sched_meta_values (the API's check of passed metadata, outside jit) against the kernel's reading: a
    schedule passes for its own lengths and for other lengths (a later step's, an earlier one's, another batch's),
    which the kernel reads right too, and an edited one (a chunk start moved by a page, a partition dropped)
    exactly when the kernel would still read every key once."""
    rng = np.random.default_rng(2024)
    outcomes = {kind: {True: 0, False: 0} for kind in ("later", "earlier", "other", "moved", "dropped")}
    for trial in range(500):
        b = int(rng.choice([1, 2, 3, 5, 33, 100]))
        parts = int(rng.integers(1, 40))
        lens = rng.integers(0, 3000, b).astype(np.int32)
        lens[rng.random(b) < 0.1] = 0
        meta, splits = spec_walk(lens, parts)
        meta = np.array(meta)
        check_sched_meta_values(meta, splits, lens)
        kind = tuple(outcomes)[trial % 5]
        other = lens
        if kind == "later":  # a few decode steps on: some sequences grew
            other = lens + rng.integers(0, 3, b) * (rng.random(b) < 0.3)
        elif kind == "earlier":
            other = np.maximum(lens - rng.integers(0, 200, b), 0)
        elif kind == "other":
            other = rng.permutation(lens)
        elif kind == "moved":
            p = int(rng.integers(parts))
            meta[p, 1] = max(meta[p, 1] + PAGE_SIZE * int(rng.choice([-1, 1])), 0)
        else:
            meta[int(rng.integers(parts)), :5] = [b, 0, b - 1, 0, 0]
        other = other.astype(np.int32)
        fits = kernel_reads_every_key_once(meta, splits, other)
        outcomes[kind][fits] += 1
        if fits:
            check_sched_meta_values(meta, splits, other)
        else:
            with pytest.raises(ValueError, match=r"tile_scheduler_metadata does not fit cache_seqlens\[\d+\]"):
                check_sched_meta_values(meta, splits, other)
    for kind in ("later", "earlier", "other"):
        assert outcomes[kind][False] == 0, outcomes  # any schedule of the batch reads right
    print(outcomes)
    assert outcomes["moved"][False] > 30 and outcomes["dropped"][False] > 30, outcomes


@pytest.mark.parametrize("schedule", stale_schedules.SCHEDULES, ids=lambda schedule: schedule.name)
@pytest.mark.parametrize("rows", [16, 128])  # the GPU test's few-rows and 64-row kernels
def test_stale_schedules_hold_their_hazards(schedule, rows):
    """tests/stale_schedules.py's metadata of other lengths (the GPU test's) holds the hazards each schedule is there
    for, and with it the kernel reads every key of the step's lengths once, as the eager check agrees."""
    meta = schedule.metadata(rows, implementation="reference")
    lens = stale_schedules.LENGTHS
    held = stale_schedules.hazards_held(meta.tile_scheduler_metadata, meta.num_splits, lens)
    assert set(schedule.hazards) <= held, held
    splits = np.asarray(meta.num_splits)
    assert kernel_reads_every_key_once(meta.tile_scheduler_metadata, splits, lens)
    check_sched_meta_values(meta.tile_scheduler_metadata, splits, lens)


def test_value_check_rejects_inconsistent_num_splits():
    lens = np.array([700, 300], np.int32)
    meta, splits = spec_walk(lens, 8)
    assert list(splits) == [0, 3, 5]  # both sequences split
    for bad, match in (([1, 3, 5], "num_splits must start at 0"), ([0, 3, 3], "rise by at least 1"),
                       ([0, 2, 5], r"does not fit cache_seqlens\[0\] = 700"),
                       ([0, 3, 6], r"does not fit cache_seqlens\[1\] = 300")):
        with pytest.raises(ValueError, match=match):
            check_sched_meta_values(meta, np.array(bad, np.int32), lens)
    outside = np.array(meta)
    outside[0, 2] = 2  # end_batch past the batch
    with pytest.raises(ValueError, match=r"names sequences outside \[0, 2\)"):
        check_sched_meta_values(outside, splits, lens)


def test_batch_zero():
    meta, splits = sched_meta_reference(jnp.zeros((0,), jnp.int32), 3)
    np.testing.assert_array_equal(np.asarray(splits), [0])
    np.testing.assert_array_equal(np.asarray(meta), np.tile([0, 0, -1, 0, 0, 0, 0, 0], (3, 1)))
    np.testing.assert_array_equal(np.asarray(meta), spec_walk([], 3)[0])


def test_twin_inside_caller_jit():
    """Works inside a caller's jit with num_sm_parts static."""
    lens = make_lens("uniform", 17)
    f = jax.jit(lambda l: sched_meta_reference(l, 5))
    meta, splits = f(jnp.asarray(lens))
    want_meta, want_splits = spec_walk(lens, 5)
    np.testing.assert_array_equal(np.asarray(meta), want_meta)
    np.testing.assert_array_equal(np.asarray(splits), want_splits)


# ---------------------------------------------------------------------------------------------------------------
# GPU: the CUDA kernel through XLA FFI, bit for bit against the twin


def _gpu_device_or_skip():
    require = os.environ.get("JAX_FLASH_MLA_REQUIRE_GPU") == "1"
    reason = None
    if not _ffi.extension_available():
        reason = "jax_flash_mla extension not built with CUDA"
    else:
        try:
            gpus = jax.devices("gpu")
        except RuntimeError:
            gpus = []
        if not gpus:
            reason = "no CUDA device"
    if reason is not None:
        if require:
            pytest.fail(f"JAX_FLASH_MLA_REQUIRE_GPU=1 but {reason}")
        pytest.skip(reason)
    return gpus[0]


def _kernel_sched_meta(lens, parts, device):
    out_types = (jax.ShapeDtypeStruct((parts, SCHED_META_INTS), jnp.int32),
                 jax.ShapeDtypeStruct((lens.shape[0] + 1,), jnp.int32))
    call = jax.jit(lambda l: jax.ffi.ffi_call(_ffi.TARGET_SCHED_META, out_types)(l))
    meta, splits = call(jax.device_put(jnp.asarray(lens, jnp.int32), device))
    assert meta.devices() == {device}
    return np.asarray(meta), np.asarray(splits)


@pytest.mark.gpu
def test_kernel_matches_twin_gpu():
    device = _gpu_device_or_skip()
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(42)
    cases = [(b, parts, kind) for (b, parts) in SHAPES for kind in ("uniform", "mixed_zero")]
    cases += [(9000, 132, "heavy_tail"), (9000, 7, "mixed_zero"), (8192, 132, "zeros"), (1, 132, "one_long")]
    cases += [(int(rng.integers(1, 5000)), int(rng.integers(1, 133)), "mixed_zero") for _ in range(20)]
    for b, parts, kind in cases:
        lens = make_lens(kind, b, seed=int(rng.integers(1 << 30)))
        meta, splits = _kernel_sched_meta(lens, parts, device)
        with jax.default_device(cpu):
            want_meta, want_splits = sched_meta_reference(jnp.asarray(lens), parts)
        np.testing.assert_array_equal(meta, np.asarray(want_meta), err_msg=f"{kind} b={b} P={parts}")
        np.testing.assert_array_equal(splits, np.asarray(want_splits), err_msg=f"{kind} b={b} P={parts}")
        check_invariants(lens, parts, meta, splits)


@pytest.mark.gpu
def test_kernel_batch_zero_gpu():
    device = _gpu_device_or_skip()
    meta, splits = _kernel_sched_meta(np.zeros((0,), np.int32), 4, device)
    np.testing.assert_array_equal(splits, [0])
    np.testing.assert_array_equal(meta, np.tile([0, 0, -1, 0, 0, 0, 0, 0], (4, 1)))


@pytest.mark.gpu
def test_kernel_rejects_bad_shapes_gpu():
    """Shape errors come back from the handler as a Python exception naming the operand, not a crash."""
    device = _gpu_device_or_skip()
    lens = jax.device_put(jnp.arange(4, dtype=jnp.int32), device)
    out_types = (jax.ShapeDtypeStruct((3, SCHED_META_INTS), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32))
    with pytest.raises(Exception, match="num_splits must have shape"):
        jax.block_until_ready(jax.jit(lambda l: jax.ffi.ffi_call(_ffi.TARGET_SCHED_META, out_types)(l))(lens))
