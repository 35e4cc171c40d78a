"""scripts/trace_pipeline.py (a GPU debugging aid) lays out the kernel's event stamps; its analysis is checked here on
a synthetic buffer whose schedule is known, laid out exactly as cpp/kernels/event_trace.h writes it."""

import importlib.util
import pathlib

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location(
    "trace_pipeline", pathlib.Path(__file__).resolve().parents[1] / "scripts" / "trace_pipeline.py")
trace = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace)

SHAPE = (3, 3, 64, 15, 4)  # ctas, roles, pages, events, clock words (the module's EVENT_TRACE_SHAPE, smaller)
GHZ = 2.0
PERIOD = 3000  # cycles per pair
# Cycles after WG0's top of the pair, by (role, event); S landing stamps sit at the page of that S.
WG0 = {0: 0, 1: 400, 2: 900, 3: 1700, 4: 1900, 5: 2500}
WG1 = {0: 100, 1: 600, 2: 950, 3: 1600, 4: 2100, 5: 2800}


def synthetic_pairs(skip_cta=None):
    ctas, roles, pages, events, clock_words = SHAPE
    stamps = np.zeros((ctas, roles, pages, events), np.uint64)
    clocks = np.zeros((ctas, clock_words), np.uint64)
    for cta in range(ctas):
        if cta == skip_cta:
            continue
        base = 10_000 + 777 * cta
        for pair, ia in enumerate(range(0, 40, 2)):
            t0 = base + pair * PERIOD
            for e, dt in WG0.items():
                stamps[cta, 0, ia, e] = t0 + dt
            for e, dt in WG1.items():
                stamps[cta, 1, ia, e] = t0 + dt
            stamps[cta, 0, ia, 6] = t0 - 500  # this pair's S_A left part landed, before its top
            stamps[cta, 2, ia, 0] = t0 - 2000
        clocks[cta] = [base, 1_000_000, base + 40 * PERIOD, 1_000_000 + int(40 * PERIOD / GHZ)]
    raw = np.concatenate([stamps.ravel(), clocks.ravel()]).tobytes()
    return raw


def test_unpack_round_trips_the_buffer_layout():
    stamps, clocks = trace.unpack(synthetic_pairs(), SHAPE)
    assert stamps.shape == SHAPE[:4] and clocks.shape == (SHAPE[0], SHAPE[4])
    assert stamps[1, 1, 4, 3] == 10_000 + 777 + 2 * PERIOD + WG1[3]
    with pytest.raises(AssertionError):
        trace.unpack(synthetic_pairs()[:-8], SHAPE)


def test_layout_recovers_the_schedule_in_ns():
    stamps, clocks = trace.unpack(synthetic_pairs(skip_cta=2), SHAPE)  # an untraced CTA is ignored
    assert trace.ghz(clocks) == pytest.approx(GHZ)
    table = {label: (med, lo, hi, n) for label, med, lo, hi, n in trace.layout(stamps, clocks, "fp8_per_tensor")}
    # 20 pairs per CTA, the first and last two skipped, the last one has no successor: 15 per CTA, 2 CTAs.
    assert table["WG0 next top (period)"] == (PERIOD / GHZ, PERIOD / GHZ, PERIOD / GHZ, 30)
    assert table["WG1 B ready"][0] == pytest.approx(WG1[3] / GHZ)
    assert table["WG0 PV_A retired"][0] == pytest.approx(WG0[4] / GHZ)
    assert table["WG0 next S_A left landed"][0] == pytest.approx((PERIOD - 500) / GHZ)
    assert table["producer page +2 left issued"][0] == pytest.approx((PERIOD - 2000) / GHZ)
    assert table["WG1 next S_B right landed"][3] == 0  # never stamped: reported as missing, not as 0 ns
    phases = dict(trace.phases(list((k, *v) for k, v in table.items())))
    assert phases["WG0 A ready -> B ready"] == pytest.approx((WG0[3] - WG0[2]) / GHZ)
    assert phases["WG1 S retired -> A ready"] == pytest.approx((WG1[2] - WG1[1]) / GHZ)


def test_an_unarmed_buffer_is_an_error_not_a_report():
    raw = np.zeros(int(np.prod(SHAPE[:4])) + SHAPE[0] * SHAPE[4], np.uint64).tobytes()
    stamps, clocks = trace.unpack(raw, SHAPE)
    with pytest.raises(SystemExit, match="armed"):
        trace.ghz(clocks)


def test_chunk_boundaries_split_a_hand_over_into_its_steps():
    ctas, roles, pages, events, clock_words = SHAPE
    stamps = np.zeros((ctas, roles, pages, events), np.int64)
    clocks = np.zeros((ctas, clock_words), np.int64)
    clocks[0] = [1000, 500, 1000 + 2 * 10**6, 500 + 10**6]  # 2 cycles per ns
    s = stamps[0, 0]
    s[0, [trace.CHUNK_START, trace.Q_LOADED, 0]] = [1400, 3400, 4000]  # first chunk: pages 0-4
    s[4, [trace.PAGES_DONE, trace.EPILOGUE_DONE]] = [50_000, 52_000]
    s[5, [trace.CHUNK_START, trace.Q_LOADED, 0]] = [52_200, 60_200, 61_000]  # second chunk from page 5
    starts, boundaries = trace.chunk_boundaries(stamps, clocks)
    np.testing.assert_allclose(starts, [[200, 1000, 300]])
    np.testing.assert_allclose(boundaries, [[1000, 100, 4000, 400]])


def test_epilogue_phases_time_both_warpgroups_from_wg0s_last_wgmma():
    ctas, roles, pages, events, clock_words = SHAPE
    stamps = np.zeros((ctas, roles, pages, events), np.int64)
    clocks = np.zeros((ctas, clock_words), np.int64)
    clocks[0] = [1000, 500, 1000 + 2 * 10**6, 500 + 10**6]  # 2 cycles per ns
    ends = [trace.PAGES_DONE, trace.SUMS_SHARED, trace.EPILOGUE_DONE]
    stamps[0, 0, 4, ends] = [50_000, 52_000, 60_000]
    stamps[0, 1, 4, ends] = [51_000, 52_100, 59_000]
    stamps[0, 0, 9, ends] = [90_000, 91_000, 92_000]  # WG1 never stamped this chunk end: left out
    np.testing.assert_allclose(trace.epilogue_phases(stamps, clocks), [[1000, 5000, 500, 1050, 4500]])


def test_a_saved_trace_reports_the_same_without_a_gpu(tmp_path, capsys):
    stamps, clocks = trace.unpack(synthetic_pairs(skip_cta=2), SHAPE)
    path = tmp_path / "t.npz"
    np.savez_compressed(path, stamps=stamps, clocks=clocks, format="fp8_per_tensor")
    assert trace.main(["--load", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"one pair every {PERIOD / GHZ:.0f} ns" in out and "WG1 B ready" in out
    with pytest.raises(SystemExit):  # neither a saved trace nor a format to run
        trace.main([])


def test_page_waits_measure_how_long_each_next_s_waited_for_its_page():
    stamps, clocks = trace.unpack(synthetic_pairs(skip_cta=2), SHAPE)
    for cta in (0, 1):
        for ia in range(0, 40, 2):
            t0 = int(stamps[cta, 0, ia, 0])
            # WG0's S_A of this pair began to wait 300 cycles before the top; its parts landed 200 and 400 later.
            stamps[cta, 0, ia, 8], stamps[cta, 0, ia, 6], stamps[cta, 0, ia, 7] = t0 - 300, t0 - 100, t0 + 100
            # WG1's S_B found both parts landed.
            stamps[cta, 1, ia + 1, 8], stamps[cta, 1, ia + 1, 6], stamps[cta, 1, ia + 1, 7] = t0, t0 - 50, t0 - 20
    waits = {label: (med, p90) for label, med, p90 in trace.page_waits(stamps, clocks, "fp8_per_tensor")}
    assert waits["WG0 next S_A, first part"] == pytest.approx((200 / GHZ, 200 / GHZ))
    assert waits["WG0 next S_A, both parts"] == pytest.approx((400 / GHZ, 400 / GHZ))
    assert waits["WG1 next S_B, both parts"] == (0.0, 0.0)  # landed before the wait: no wait, not a negative one


def test_issue_gaps_time_the_producers_second_part():
    stamps, clocks = trace.unpack(synthetic_pairs(skip_cta=2), SHAPE)
    for cta in (0, 1):
        for ia in range(0, 40, 2):
            t0 = int(stamps[cta, 0, ia, 0])
            stamps[cta, 2, ia, 0], stamps[cta, 2, ia, 1] = t0 + 100, t0 + 560  # page A: left, then right 460 later
            stamps[cta, 2, ia + 1, 1], stamps[cta, 2, ia + 1, 0] = t0 + 900, t0 + 1700  # page B: right first
    gaps = {label: (med, lo, hi) for label, med, lo, hi in trace.issue_gaps(stamps, clocks, "bf16")}
    assert gaps["page A'"] == pytest.approx((460 / GHZ,) * 3)
    assert gaps["page B'"] == pytest.approx((800 / GHZ,) * 3)
    assert trace.issue_gaps(stamps, clocks, "fp8_ds_mla") == []
