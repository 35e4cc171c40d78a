"""Where a 64-row kernel's page pair (or page) goes: its warpgroups' own clock stamps, laid out against each other.

Needs a build with JAX_FLASH_MLA_EVENT_TRACE (`EVENT_TRACE=ON bash scripts/build_carry.sh`; the stamps and their
meaning are in cpp/kernels/event_trace.h). Runs one decode of a named shape on random inputs (never zeros) twice
and reads the stamps of the second run: the first 16 CTAs of KV head 0's first row tile, up to 256 pages each.

    python3 scripts/trace_pipeline.py --format fp8_per_tensor --shape C1 [--batch 128] [--seqlen 8192] [--save F.npz]
    python3 scripts/trace_pipeline.py --load F.npz    # the same report from a saved run, on any machine

Prints, for every event of both consumer warpgroups and the producer, its time after WG0's start of the same pair
(bf16 / fp8_per_tensor) or page (fp8_ds_mla): median and 10th / 90th percentiles over the traced pairs, in ns at
the SM clock the run measured. Then each warpgroup's phases (time between its consecutive events), which say who
waits for whom, and how long each warpgroup's next S waits for its page to land. The stamps cost a few instructions
each: read the order and the shares, not the absolute times (bench.py times builds). Only the 64-row kernels stamp;
the few-rows kernels (M1 with an FP8 format) do not.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

# Layout of the buffer (kernels/event_trace.h): stamps [cta][role][page][event] (roles WG0, WG1, producer), then
# (clock64, globaltimer) of each CTA's producer at its start and end.
PAIR_EVENTS = ("top", "S retired", "A ready", "B ready", "PV_A retired", "end", "S left landed",
               "S right landed", "S waits", "stored")
DS_EVENTS = ("top", "V^T done", "S head retired", "S retired", "max ready", "P ready", "end", "slot landed",
             "slot wait", "P stored")
PRODUCER_EVENTS = ("left issued", "right issued")
PERIOD_LABEL = "WG0 next top (period)"  # layout()'s row of the period itself
# Per chunk, at the ring position of its first page (start, Q loaded) or last page (pages done, epilogue done).
CHUNK_START, Q_LOADED, PAGES_DONE, EPILOGUE_DONE, SUMS_SHARED = 10, 11, 12, 13, 14


def unpack(raw: bytes, shape) -> tuple[np.ndarray, np.ndarray]:
    """(stamps [cta, role, page, event] int64, clocks [cta, 4]) from the module's event_trace_read()."""
    ctas, roles, pages, events, clock_words = shape
    words = np.frombuffer(raw, np.uint64).astype(np.int64)
    n = ctas * roles * pages * events
    assert words.size == n + ctas * clock_words, (words.size, shape)
    return words[:n].reshape(ctas, roles, pages, events), words[n:].reshape(ctas, clock_words)


def ghz(clocks: np.ndarray) -> float:
    """SM cycles per ns over the traced CTAs' producer walks (clock64 against globaltimer)."""
    ok = (clocks[:, 1] > 0) & (clocks[:, 3] > clocks[:, 1])
    if not ok.any():
        raise SystemExit("trace_pipeline: no CTA recorded its clocks (was the buffer armed before the decode?)")
    return float(np.median((clocks[ok, 2] - clocks[ok, 0]) / (clocks[ok, 3] - clocks[ok, 1])))


def rows_for(kv_format: str):
    """(label, role, page offset from the period's first page, event) of every stamp in one period, and the
    number of pages a period covers (a pair, or fp8_ds_mla's page)."""
    if kv_format == "fp8_ds_mla":
        rows = [(f"WG{w} {name}", w, 0, e) for w in (0, 1) for e, name in enumerate(DS_EVENTS[:7])]
        rows += [(f"WG{w} P stored", w, 0, 9) for w in (0, 1)]
        rows += [(f"WG{w} {DS_EVENTS[e]} (page +1)", w, 1, e) for w in (0, 1) for e in (8, 7)]
        rows += [(f"producer issued page +{d}", 2, d, 0) for d in (0, 1, 2)]
        return rows, 1
    rows = [(f"WG{w} {name}", w, 0, e) for w in (0, 1) for e, name in enumerate(PAIR_EVENTS[:6])]
    # Writes for the other WG done (before their fence and barrier), at the page written.
    rows += [("WG0 P_A stored", 0, 0, 9), ("WG0 V^T_B,L stored", 0, 1, 9), ("WG1 V^T halves stored", 1, 0, 9),
             ("WG1 P_B stored", 1, 1, 9)]
    # issue_s stamps at the page of the S: WG0's next S_A is page +2, WG1's next S_B page +3.
    rows += [(f"WG{w} next S_{ab} {name}", w, offset, e) for w, ab, offset in ((0, "A", 2), (1, "B", 3))
             for name, e in (("waits", 8), ("left landed", 6), ("right landed", 7))]
    rows += [(f"producer page +{d} {PRODUCER_EVENTS[e]}", 2, d, e) for d in (2, 3) for e in (0, 1)]
    return rows, 2


def periods(stamps: np.ndarray, kv_format: str, skip: int = 2):
    """[(cta, first page, next period's first page)] of every traced period (pair or page) with a successor,
    without the first and last `skip` of each CTA (chunk starts and the drain)."""
    step = 1 if kv_format == "fp8_ds_mla" else 2
    out = []
    for cta in range(stamps.shape[0]):
        tops = [p for p in range(stamps.shape[2]) if stamps[cta, 0, p, 0] > 0]
        # Pairs restart at a chunk's first page: a pair's successor is the next top, whatever its distance.
        starts = [p for p in tops if p + step <= stamps.shape[2]]
        for a, b in list(zip(starts, starts[1:]))[skip:-skip or None]:
            out.append((cta, a, b))
    return out


def layout(stamps: np.ndarray, clocks: np.ndarray, kv_format: str):
    """Per row of rows_for(): (label, median, p10, p90, count) in ns after WG0's top, plus the period's own."""
    rows, _ = rows_for(kv_format)
    per_ns = 1.0 / ghz(clocks)
    spans = periods(stamps, kv_format)
    if not spans:
        raise SystemExit("trace_pipeline: no complete period traced (too few pages per CTA?)")
    table = []
    for label, role, offset, event in rows + [(PERIOD_LABEL, 0, None, 0)]:
        values = []
        for cta, a, b in spans:
            page = b if offset is None else a + offset
            if page >= stamps.shape[2]:
                continue
            t = stamps[cta, role, page, event]
            if t > 0:
                values.append((t - stamps[cta, 0, a, 0]) * per_ns)
        if values:
            v = np.asarray(values)
            table.append((label, float(np.median(v)), float(np.percentile(v, 10)), float(np.percentile(v, 90)),
                          len(v)))
        else:
            table.append((label, float("nan"), float("nan"), float("nan"), 0))
    return table


def period_ns(table) -> float:
    """The median period (pair or page) of a layout() table."""
    return next(med for label, med, *_ in table if label == PERIOD_LABEL)


def phases(table):
    """Each consumer warpgroup's own consecutive steps (median times only): (label, ns)."""
    medians = {label: med for label, med, *_ in table}
    out = []
    for w in ("WG0", "WG1"):
        own = sorted((med, label) for label, med in medians.items() if label.startswith(w + " ") and
                     "landed" not in label and np.isfinite(med))
        for (t0, l0), (t1, l1) in zip(own, own[1:]):
            out.append((f"{l0} -> {l1[len(w) + 1:]}", t1 - t0))
    return out


def page_waits(stamps: np.ndarray, clocks: np.ndarray, kv_format: str):
    """How long each consumer WG's next S waited for its page, per traced period: [(label, median ns, p90 ns)].
    Pairs: from "waits" to the first of the slot's two parts landed (the S issues its k-steps on that part next) and
    to both; fp8_ds_mla: from "slot wait" to "slot landed". A page that had landed before the wait counts 0."""
    per_ns = 1.0 / ghz(clocks)
    if kv_format == "fp8_ds_mla":
        wait_event, landed = DS_EVENTS.index("slot wait"), (DS_EVENTS.index("slot landed"),)
        cases = [(f"WG{w} next page", w, 1, landed, max) for w in (0, 1)]
    else:
        wait_event = PAIR_EVENTS.index("S waits")
        landed = (PAIR_EVENTS.index("S left landed"), PAIR_EVENTS.index("S right landed"))
        cases = [(f"WG{w} next S_{ab}, {which}", w, offset, landed, pick)
                 for w, ab, offset in ((0, "A", 2), (1, "B", 3))
                 for which, pick in (("first part", min), ("both parts", max))]
    out = []
    for label, role, offset, landed_events, pick in cases:
        values = []
        for cta, a, _ in periods(stamps, kv_format):
            if a + offset >= stamps.shape[2]:
                continue
            wait = stamps[cta, role, a + offset, wait_event]
            landed = [stamps[cta, role, a + offset, e] for e in landed_events]
            if wait > 0 and all(t > 0 for t in landed):
                values.append(max(pick(landed) - wait, 0) * per_ns)
        if values:
            out.append((label, float(np.median(values)), float(np.percentile(values, 90))))
    return out


def issue_gaps(stamps: np.ndarray, clocks: np.ndarray, kv_format: str):
    """Pairs only: ns between the producer's issues of a page's two parts, per traced period: [(label, median, p10,
    p90)] for the next page A' (left part first) and B' (parts in the producer's order for a page B). When both parts
    had gone back before the first issue, the gap is the first part's own issue time (the TMA unit works through one
    box before it takes the next instruction)."""
    if kv_format == "fp8_ds_mla":
        return []
    per_ns = 1.0 / ghz(clocks)
    left, right = PRODUCER_EVENTS.index("left issued"), PRODUCER_EVENTS.index("right issued")
    out = []
    for label, offset in (("page A'", 2), ("page B'", 3)):
        values = []
        for cta, a, _ in periods(stamps, kv_format):
            if a + offset < stamps.shape[2]:
                t_left, t_right = stamps[cta, 2, a + offset, left], stamps[cta, 2, a + offset, right]
                if t_left > 0 and t_right > 0:
                    values.append(abs(int(t_right) - int(t_left)) * per_ns)
        if values:
            out.append((label, float(np.median(values)), float(np.percentile(values, 10)),
                        float(np.percentile(values, 90))))
    return out


def print_issue_gaps(gaps):
    if gaps:
        print("producer: ns between a page's two part issues (median / p10 / p90):")
        for label, med, lo, hi in gaps:
            print(f"  {label:28s} {med:6.0f} / {lo:6.0f} / {hi:6.0f}")


def print_page_waits(waits, period_ns):
    if waits:
        print("page waits (ns a period, median / p90; share of the period's median):")
        for label, med, p90 in waits:
            print(f"  {label:28s} {med:6.0f} / {p90:6.0f}   {100 * med / period_ns:4.1f} %")


def chunk_boundaries(stamps: np.ndarray, clocks: np.ndarray):
    """WG0's chunk hand-overs, in ns: the kernel's start [(producer start -> first chunk start, its Q load, Q loaded
    -> first top)] and every boundary between chunks [(epilogue, epilogue done -> next start, next Q load, Q loaded
    -> first top)]."""
    per_ns = 1.0 / ghz(clocks)
    starts, boundaries = [], []
    for cta in range(stamps.shape[0]):
        s = stamps[cta, 0]
        for k, page in enumerate(np.nonzero(s[:, CHUNK_START])[0]):
            start, q_loaded, top = s[page, CHUNK_START], s[page, Q_LOADED], s[page, 0]
            if not (q_loaded and top):
                continue
            if k == 0:
                if clocks[cta, 0]:
                    starts.append(((start - clocks[cta, 0]) * per_ns, (q_loaded - start) * per_ns,
                                   (top - q_loaded) * per_ns))
            elif page > 0 and s[page - 1, PAGES_DONE] and s[page - 1, EPILOGUE_DONE]:
                done, written = s[page - 1, PAGES_DONE], s[page - 1, EPILOGUE_DONE]
                boundaries.append(((written - done) * per_ns, (start - written) * per_ns,
                                   (q_loaded - start) * per_ns, (top - q_loaded) * per_ns))
    return np.asarray(starts).reshape(-1, 3), np.asarray(boundaries).reshape(-1, 4)


def epilogue_phases(stamps: np.ndarray, clocks: np.ndarray):
    """Every chunk end of the traced CTAs, per WG, in ns after WG0's pages done: [WG0 sums shared,
    WG0 written, WG1 pages done, WG1 sums shared, WG1 written]."""
    per_ns = 1.0 / ghz(clocks)
    out = []
    for cta in range(stamps.shape[0]):
        s0, s1 = stamps[cta, 0], stamps[cta, 1]
        for page in np.nonzero(s0[:, EPILOGUE_DONE])[0]:
            words = (s0[page, PAGES_DONE], s0[page, SUMS_SHARED], s0[page, EPILOGUE_DONE], s1[page, PAGES_DONE],
                     s1[page, SUMS_SHARED], s1[page, EPILOGUE_DONE])
            if all(words):
                out.append([(w - words[0]) * per_ns for w in words[1:]])
    return np.asarray(out).reshape(-1, 5)


def print_epilogue(rows):
    if len(rows):
        a, b, c, d, e = np.median(rows, axis=0)
        print(f"chunk ends (median of {len(rows)}, ns after WG0's pages done): WG0 sums shared {a:.0f}, written {b:.0f}; "
              f"WG1 pages done {c:.0f}, sums shared {d:.0f}, written {e:.0f}")


def print_chunks(starts, boundaries):
    if len(starts):
        a, b, c = np.median(starts, axis=0)
        print(f"kernel start (median of {len(starts)} CTAs, WG0): producer start -> first chunk {a:.0f} ns, its Q load "
              f"{b:.0f} ns, Q loaded -> first top {c:.0f} ns")
    if len(boundaries):
        a, b, c, d = np.median(boundaries, axis=0)
        print(f"chunk boundaries (median of {len(boundaries)}, WG0): epilogue {a:.0f} ns, -> next chunk {b:.0f} ns, "
              f"its Q load {c:.0f} ns, Q loaded -> first top {d:.0f} ns; total {a + b + c + d:.0f} ns")


def print_report(table, kv_format, pages_per_period):
    period = period_ns(table)
    unit = "pair" if pages_per_period == 2 else "page"
    print(f"{kv_format}: one {unit} every {period:.0f} ns (median), {period / pages_per_period:.0f} ns per 64-row "
          f"page tile")
    print(f"{'event (ns after WG0 top)':44s} {'median':>8s} {'p10':>8s} {'p90':>8s} {'n':>6s}")
    for label, med, lo, hi, n in sorted(table, key=lambda r: (np.nan_to_num(r[1], nan=1e18), r[0])):
        print(f"{label:44s} {med:8.0f} {lo:8.0f} {hi:8.0f} {n:6d}")
    print("phases (median ns between a warpgroup's consecutive events):")
    for label, ns in phases(table):
        print(f"  {label:60s} {ns:8.0f}")


def run_decode(args):
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import jax_flash_mla as fm
    from decode_case import random_decode_case
    from jax_flash_mla import _ffi
    from jax_flash_mla.bench import SHAPES

    ext = _ffi._ext
    if ext is None or not hasattr(ext, "event_trace_arm"):
        raise SystemExit("trace_pipeline: this extension was not built with JAX_FLASH_MLA_EVENT_TRACE "
                         "(EVENT_TRACE=ON bash scripts/build_carry.sh)")
    if args.format not in fm.kernel_formats():
        raise SystemExit(f"trace_pipeline: no {args.format} kernel in this build")
    shape = SHAPES[args.shape]
    if shape.seqlen_q * shape.heads_q <= 16 and args.format != "bf16":
        raise SystemExit(f"trace_pipeline: {args.shape} runs the few-rows kernel for {args.format}, "
                         "which has no stamps")
    decode, decode_args = random_decode_case(args.format, shape, args.batch, args.seqlen, seed=args.seed)
    # Armed before the first call: a launch captured into a CUDA graph keeps the buffer pointer it saw.
    ext.event_trace_arm()
    jax.block_until_ready(decode(*decode_args))
    ext.event_trace_arm()  # zeroed: the second, warm call is the one read
    out, lse = jax.block_until_ready(decode(*decode_args))
    checksum = float(jnp.abs(out.astype(jnp.float32)).sum())
    print(f"trace_pipeline {args.format} {args.shape} b={args.batch} s_k={args.seqlen}: sum|out|={checksum:.6e} "
          f"finite={bool(jnp.isfinite(lse).all())}")
    return ext.event_trace_read(), tuple(ext.EVENT_TRACE_SHAPE)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", choices=("bf16", "fp8_per_tensor", "fp8_ds_mla"))
    ap.add_argument("--shape", default="C1", choices=("M1", "C1", "C2"))
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", help="also write the raw stamps and clocks to this .npz")
    ap.add_argument("--load", help="report on the stamps that --save wrote instead of running a decode")
    args = ap.parse_args(argv)
    if args.load:
        with np.load(args.load) as saved:
            stamps, clocks, args.format = saved["stamps"], saved["clocks"], str(saved["format"])
    else:
        if not args.format:
            ap.error("--format is required unless --load is given")
        raw, shape = run_decode(args)
        stamps, clocks = unpack(raw, shape)
    if args.save:
        np.savez_compressed(args.save, stamps=stamps, clocks=clocks, format=args.format)
    print(f"SM clock {ghz(clocks):.3f} GHz (clock64 against globaltimer over the traced CTAs)")
    _, pages_per_period = rows_for(args.format)
    table = layout(stamps, clocks, args.format)
    print_report(table, args.format, pages_per_period)
    period = period_ns(table)
    print_page_waits(page_waits(stamps, clocks, args.format), period)
    print_issue_gaps(issue_gaps(stamps, clocks, args.format))
    print_chunks(*chunk_boundaries(stamps, clocks))
    print_epilogue(epilogue_phases(stamps, clocks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
