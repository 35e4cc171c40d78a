"""Host emulation of the FP8 kernels' shared-memory lane mappings (cpp/kernels/sm90/decode/splitkv_mla.cuh).

transpose_v: replays, for one warpgroup and a 64-token page of e4m3 bytes, what ldmatrix.x4.trans, the four
byte permutes and stmatrix.x4 do per lane (PTX ISA "ldmatrix" / "stmatrix" fragment layouts), on the K slot
(64-byte swizzle for fp8_per_tensor, 128-byte for fp8_ds_mla: `slot_swizzle`) and the SW64 V^T tile, and checks
  - V^T[c][p_column(t)] == K[t][c] for valid tokens, 0 past `valid`;
  - every 8-lane phase of each ldmatrix / stmatrix touches 8 distinct 16-byte bank groups.
store_p_e4m3: replays the stmatrix store of P from the WGMMA accumulator fragment (m64n64 for fp8_per_tensor,
each WG's m64n32 half for fp8_ds_mla) and checks P_tile[row][p_column(t)] == P[row][t], conflict-free.
run_narrow: the few-query-rows consumer's V^T register A fragments and P^T store (consumer_narrow.cuh).
Run: python3 scripts/emulate_vt_transpose.py   (prints "ok" or raises)
"""
import numpy as np

TOKENS, CHANNELS_PER_WG = 64, 256


def sw64(row, col):
    """Byte offset in a K-major SW64 tile with 64-byte rows (atoms stacked down the rows)."""
    return row * 64 + ((((col // 16) ^ ((row >> 1) & 3)) * 16) + col % 16)


def sw128(row, col):
    """Byte offset in a K-major SW128 tile with 128-byte rows (atoms stacked down the rows)."""
    return row * 128 + ((((col // 16) ^ (row & 7)) * 16) + col % 16)


def slot_layout(slot_swizzle):
    """Byte offset of (token, V channel) in a K slot: 4 KB SW64 slabs of 64 channels, or 8 KB SW128 slabs of 128."""
    if slot_swizzle == 64:
        return lambda t, c: (c // 64) * 4096 + sw64(t, c % 64)
    assert slot_swizzle == 128, slot_swizzle
    return lambda t, c: (c // 128) * 8192 + sw128(t, c % 128)


def p_column(t):
    u = t % 16
    return t - u + 4 * ((u % 8) // 2) + 2 * (u // 8) + u % 2


def byte_perm(x, y, sel):
    src = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * k)) & 7] << (8 * k) for k in range(4))


def check_conflicts(addrs, what):
    for phase in range(4):
        groups = {(a % 128) // 16 for a in addrs[8 * phase: 8 * phase + 8]}
        assert len(groups) == 8, f"{what}: phase {phase} bank groups {sorted(groups)}"


def run(wg, valid, rng, slot_swizzle=64):
    k_slot = np.zeros(TOKENS * 512 + 64, np.uint8)  # the 512 V channels of the slot
    vt = np.full(512 * 64, 0xAA, np.uint8)
    zeros = np.zeros(16, np.uint8)
    data = rng.integers(0, 256, size=(TOKENS, 512), dtype=np.uint8)
    layout_k = slot_layout(slot_swizzle)
    layout_vt = lambda c, t: sw64(c, t)
    for t in range(TOKENS):
        for c in range(512):
            k_slot[layout_k(t, c)] = data[t, c]

    for warp in range(4):
        regs = {}
        lanes = range(32)
        warp_channels = wg * CHANNELS_PER_WG + warp * 64
        for block in range(8):
            ch0 = warp_channels + (block // 4) * 32
            t0 = (block % 4) * 16
            # ldmatrix.x4.trans: lane L gives row L % 8 of matrix L / 8.
            rows = []
            for lane in lanes:
                m, r = lane // 8, lane % 8
                token = t0 + 8 * (m % 2) + r
                rows.append(("k", layout_k(token, ch0 + 16 * (m // 2))) if token < valid else ("z", 0))
            if valid >= t0 + 16:  # (rows past `valid` all read the one zero row: a broadcast)
                check_conflicts([a for _, a in rows], "ldmatrix")

            def row_bytes(m, r):
                kind, a = rows[8 * m + r]
                return (k_slot if kind == "k" else zeros)[a: a + 16]

            for lane in lanes:
                q, col = lane % 4, lane // 4  # trans: b16 column col of the stored matrix, stored rows 2q, 2q+1
                d = []
                for m in range(4):
                    lo = row_bytes(m, 2 * q)[2 * col: 2 * col + 2]
                    hi = row_bytes(m, 2 * q + 1)[2 * col: 2 * col + 2]
                    b = list(lo) + list(hi)
                    d.append(sum(int(v) << (8 * i) for i, v in enumerate(b)))
                odd_first = lane // 4 >= 4
                s1, s2 = (0x7531, 0x6420) if odd_first else (0x6420, 0x7531)
                regs[lane] = [byte_perm(d[0], d[1], s1), byte_perm(d[0], d[1], s2),
                              byte_perm(d[2], d[3], s1), byte_perm(d[2], d[3], s2)]
            # stmatrix.x4: lane L gives the address of row L % 8 of matrix L / 8; lane i's register j
            # holds row i / 4, bytes 4 (i % 4) .. + 3 of matrix j.
            addrs = []
            for lane in lanes:
                m, r = lane // 8, lane % 8
                st_channel = 16 * (m // 2) + 2 * r + ((m % 2) ^ int(r >= 4))
                addrs.append(layout_vt(ch0 + st_channel, t0))
            check_conflicts(addrs, "stmatrix")
            for m in range(4):
                for lane in lanes:
                    row, q = lane // 4, lane % 4
                    word = regs[lane][m]
                    for i in range(4):
                        vt[addrs[8 * m + row] + 4 * q + i] = (word >> (8 * i)) & 0xFF

    for c in range(wg * CHANNELS_PER_WG, (wg + 1) * CHANNELS_PER_WG):
        for t in range(TOKENS):
            want = data[t, c] if t < valid else 0
            got = vt[layout_vt(c, p_column(t))]
            assert got == want, (wg, valid, c, t, got, want)


def stmatrix(tile, addrs, regs):
    """stmatrix.x4 (b16, no .trans): lane L addresses row L % 8 of matrix L / 8; lane i's register m holds row
    i / 4, bytes 4 (i % 4) .. + 3 of matrix m."""
    check_conflicts(addrs, "stmatrix")
    for m in range(4):
        for lane in range(32):
            word = regs[lane][m]
            for i in range(4):
                tile[addrs[8 * m + lane // 4] + 4 * (lane % 4) + i] = (word >> (8 * i)) & 0xFF


def run_store_p(n_per_wg, rng):
    """P (64 rows x 64 tokens of e4m3 bytes) stored by both WGs from fragments of n_per_wg tokens each."""
    p = rng.integers(0, 256, size=(64, 64), dtype=np.uint8)
    tile = np.full(64 * 64, 0xAA, np.uint8)
    groups = n_per_wg // 16
    for wg in range(64 // n_per_wg):
        first_group = wg * groups
        for warp in range(4):
            # Accumulator value v of lane i: row 16 warp + i / 4 + 8 ((v / 2) % 2), token 8 (v / 4) + 2 (i % 4) + v % 2
            # of the WG's n_per_wg tokens.
            def value(lane, v):
                row = 16 * warp + lane // 4 + 8 * ((v // 2) % 2)
                return int(p[row, wg * n_per_wg + 8 * (v // 4) + 2 * (lane % 4) + v % 2])

            words = {lane: [[0] * groups for _ in range(2)] for lane in range(32)}
            for lane in range(32):
                for k in range(groups):
                    for h in range(2):
                        v = 8 * k + 2 * h
                        b = [value(lane, v), value(lane, v + 1), value(lane, v + 4), value(lane, v + 5)]
                        words[lane][h][k] = sum(x << (8 * i) for i, x in enumerate(b))
            for pair in range(groups // 2):
                addrs = []
                for lane in range(32):
                    m = lane // 8
                    row = 16 * warp + 8 * (m % 2) + lane % 8
                    addrs.append(sw64(row, 16 * (first_group + 2 * pair + m // 2)))
                regs = {lane: [words[lane][0][2 * pair], words[lane][1][2 * pair], words[lane][0][2 * pair + 1],
                               words[lane][1][2 * pair + 1]] for lane in range(32)}
                stmatrix(tile, addrs, regs)
    for row in range(64):
        for t in range(64):
            assert tile[sw64(row, p_column(t))] == p[row, t], (n_per_wg, row, t)


def a_fragment_coord(warp, lane, v):
    """CuTe ALayout_64x32 (register A of m64nNk32, 8-bit): value v = v0 + 4 v1 + 8 v2 of a thread -> (row, k)."""
    idx = 256 * (lane % 4) + lane // 4 + 16 * warp + 64 * (v % 4) + 8 * ((v // 4) % 2) + 1024 * (v // 8)
    return idx % 64, idx // 64


def c_fragment_coord(warp, lane, v):
    """CuTe CLayout_64x16 (m64n16 accumulator): value v = v0 + 2 v1 + 4 v2 of a thread -> (row, column)."""
    return 16 * warp + lane // 4 + 8 * ((v // 2) % 2), 2 * (lane % 4) + v % 2 + 8 * (v // 4)


def run_narrow(valid, rng, slot_swizzle=64):
    """consumer_narrow (fp8_per_tensor, <= 16 query rows): one WG builds V^T A fragments from the K slot by
    ldmatrix.x4.trans + two byte permutes per matrix pair and stores P^T bytes from the S^T accumulator; checks
      - A fragment (block mb, k-step ks) value (row, k) == K[token][channel] with token 32 ks + p_column^-1(k) and
        channel 64 mb + 16 warp + 2 (row % 8) + (row % 16) // 8, 0 past `valid`, so O^T row r of block mb is that
        channel: the epilogue's 64 mb + 16 warp + 2 (lane / 4) + row half;
      - the P^T tile (16 rows x 64 tokens, SW64) holds P[row][token] at column p_column(token), the order of k;
      - every 8-lane phase of the ldmatrix touches 8 distinct 16-byte bank groups."""
    k_slot = np.zeros(TOKENS * 512 + 64, np.uint8)
    zeros = np.zeros(16, np.uint8)
    data = rng.integers(0, 256, size=(TOKENS, 512), dtype=np.uint8)
    layout_k = slot_layout(slot_swizzle)
    for t in range(TOKENS):
        for c in range(512):
            k_slot[layout_k(t, c)] = data[t, c]
    inverse_p_column = {p_column(t): t for t in range(TOKENS)}
    for warp in range(4):
        for ks in range(2):
            for mb in range(8):
                rows = []
                for lane in range(32):
                    token = 32 * ks + lane  # ld_token: matrix lane / 8 = tokens 8 (lane / 8) .. of the k-step
                    rows.append(("k", layout_k(token, 64 * mb + 16 * warp)) if token < valid else ("z", 0))
                if valid >= 32 * ks + 32:
                    check_conflicts([a for _, a in rows], "ldmatrix (narrow)")

                def row_bytes(m, r):
                    kind, a = rows[8 * m + r]
                    return (k_slot if kind == "k" else zeros)[a: a + 16]

                for lane in range(32):
                    q, col = lane % 4, lane // 4
                    d = []
                    for m in range(4):
                        b = list(row_bytes(m, 2 * q)[2 * col: 2 * col + 2]) + \
                            list(row_bytes(m, 2 * q + 1)[2 * col: 2 * col + 2])
                        d.append(sum(int(x) << (8 * i) for i, x in enumerate(b)))
                    words = [byte_perm(d[0], d[1], 0x6420), byte_perm(d[0], d[1], 0x7531),
                             byte_perm(d[2], d[3], 0x6420), byte_perm(d[2], d[3], 0x7531)]
                    for v in range(16):
                        got = (words[v // 4] >> (8 * (v % 4))) & 0xFF
                        row, k = a_fragment_coord(warp, lane, v)
                        assert row // 16 == warp
                        channel = 64 * mb + 16 * warp + 2 * (row % 8) + (row % 16) // 8
                        token = 32 * ks + 16 * (k // 16) + inverse_p_column[k % 16]
                        want = data[token, channel] if token < valid else 0
                        assert got == want, (valid, warp, ks, mb, lane, v, got, want)
                # The accumulator row of this lane and half is the same channel (epilogue_narrow's mapping).
                for lane in range(32):
                    for half in range(2):
                        row, _ = c_fragment_coord(warp, lane, 2 * half)
                        assert 64 * mb + 16 * warp + 2 * (row % 8) + (row % 16) // 8 == \
                            64 * mb + 16 * warp + 2 * (lane // 4) + half
    # consumer_narrow's formulas (NarrowFragment, token_of) for the m64n16 accumulators agree with CuTe's
    # CLayout_64x16: value v of (warp, lane) is token / channel row token_of(v) and query row
    # col_of(col_index(v)); value_of inverts col_index per row half; the O^T rescale's col_index(v + 8 block)
    # and group v // 16 see block-local values.
    col_index = lambda v: (v & 1) + 2 * ((v >> 2) & 1)
    value_of = lambda k4, half: (k4 & 1) + 4 * (k4 >> 1) + 2 * half
    for warp in range(4):
        for lane in range(32):
            col_of = lambda k4: 2 * (lane % 4) + (k4 & 1) + 8 * (k4 >> 1)
            for v in range(8):
                token_of = 16 * warp + lane // 4 + 8 * ((v >> 1) & 1)
                assert c_fragment_coord(warp, lane, v) == (token_of, col_of(col_index(v))), (warp, lane, v)
                for block in range(8):
                    assert col_index(v + 8 * block) == col_index(v) and (v + 8 * block) // 16 == block // 2
    for k4 in range(4):
        for half in range(2):
            assert col_index(value_of(k4, half)) == k4 and (value_of(k4, half) >> 1) & 1 == half
    # P^T: bytes of the S^T fragment (tokens x query rows) to a 16 x 64 SW64 tile at pt_column(token).
    p = rng.integers(0, 256, size=(16, 64), dtype=np.uint8)
    tile = np.full(16 * 64, 0xAA, np.uint8)
    for warp in range(4):
        for lane in range(32):
            for v in range(8):
                token, row = c_fragment_coord(warp, lane, v)
                tile[sw64(row, p_column(token))] = p[row, token]
    for row in range(16):
        for k in range(64):
            token = 16 * (k // 16) + inverse_p_column[k % 16]
            assert tile[sw64(row, k)] == p[row, token], (row, k)


def main():
    rng = np.random.default_rng(0)
    assert sorted(p_column(t) for t in range(64)) == list(range(64))
    assert all(p_column(t + 1) == p_column(t) + 1 for t in range(0, 64, 2)), "token pairs stay adjacent"
    for slot_swizzle in (64, 128):  # fp8_per_tensor, fp8_ds_mla
        for wg in (0, 1):
            for valid in (64, 100, 37, 1, 0, 16):
                run(wg, valid, rng, slot_swizzle)
    run_store_p(64, rng)  # fp8_per_tensor: the page's owner stores all 64 tokens
    run_store_p(32, rng)  # fp8_ds_mla: each WG its 32
    for slot_swizzle in (64, 128):
        for valid in (64, 100, 37, 1, 0, 16, 33):
            run_narrow(valid, rng, slot_swizzle)  # <= 16 query rows
    print("ok")


if __name__ == "__main__":
    main()
