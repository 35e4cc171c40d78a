"""Host emulation of transpose_v's lane mapping (cpp/kernels/sm90/decode/splitkv_mla.cuh).

Replays, for one warpgroup and a 64-token page of e4m3 bytes, what ldmatrix.x4.trans, the four
byte permutes and stmatrix.x4 do per lane (PTX ISA "ldmatrix" / "stmatrix" fragment layouts), on
the 64-byte-swizzled K slot and V^T tiles, and checks:
  - V^T[c][p_column(t)] == K[t][c] for valid tokens, 0 past `valid`;
  - every 8-lane phase of each ldmatrix / stmatrix touches 8 distinct 16-byte bank groups.
Run: python3 scripts/emulate_vt_transpose.py   (prints "ok" or raises)
"""
import numpy as np

TOKENS, CHANNELS_PER_WG = 64, 256


def sw64(row, col):
    """Byte offset in a K-major SW64 tile with 64-byte rows (atoms stacked down the rows)."""
    return row * 64 + ((((col // 16) ^ ((row >> 1) & 3)) * 16) + col % 16)


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


def run(wg, valid, rng):
    k_slot = np.zeros(TOKENS * 512 + 64, np.uint8)  # the 512 V channels of the slot (slabs of 4 KB)
    vt = np.full(512 * 64, 0xAA, np.uint8)
    zeros = np.zeros(16, np.uint8)
    data = rng.integers(0, 256, size=(TOKENS, 512), dtype=np.uint8)
    layout_k = lambda t, c: (c // 64) * 4096 + sw64(t, c % 64)
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


def main():
    rng = np.random.default_rng(0)
    assert sorted(p_column(t) for t in range(64)) == list(range(64))
    assert all(p_column(t + 1) == p_column(t) + 1 for t in range(0, 64, 2)), "token pairs stay adjacent"
    for wg in (0, 1):
        for valid in (64, 100, 37, 1, 0, 16):
            run(wg, valid, rng)
    print("ok")


if __name__ == "__main__":
    main()
