"""Where a decode kernel disagrees with the reference, for debugging a kernel on the GPU machine.

Runs one shape through implementation="kernel" and "reference" and prints the error by 64-channel block, by
channel parity and by query row (a wrong lane mapping shows up as whole channel blocks, one parity or row classes
off; a wrong merge of partial results as rows off by a constant factor; a stale-slot bug as NaN), plus lse and
the split-KV layout. Example (the few-rows kernel on M1-like rows, split over partitions):

    python3 scripts/diagnose_decode.py --format fp8_per_tensor --b 2 --s-q 1 --h-q 16 --seqlens 700,90 --num-sms 16

Runs anywhere; on a machine without the kernel both paths are the reference (every error is 0).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax_flash_mla as fm  # noqa: E402
from oracle import SOFTMAX_SCALE, make_decode_inputs  # noqa: E402


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="bf16", choices=fm.KV_FORMATS)
    ap.add_argument("--b", type=int, default=2)
    ap.add_argument("--s-q", type=int, default=1)
    ap.add_argument("--h-q", type=int, default=16)
    ap.add_argument("--h-kv", type=int, default=1)
    ap.add_argument("--seqlens", default="700,90", help="comma list, one per sequence")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--num-sms", type=int, default=None, help="scheduler partitions (few: more splits)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    seqlens = np.array([int(x) for x in a.seqlens.split(",")], np.int32)
    if len(seqlens) != a.b:
        ap.error(f"--seqlens has {len(seqlens)} values for --b {a.b}")
    inp = make_decode_inputs(np.random.default_rng(a.seed), b=a.b, s_q=a.s_q, h_q=a.h_q, h_kv=a.h_kv,
                             seqlens=seqlens, kv_format=a.format)
    args, kwargs = inp.kernel_args()
    rows = a.s_q * a.h_q // a.h_kv
    meta = fm.get_mla_metadata(args[3], rows, a.h_kv, num_sms=a.num_sms)
    common = dict(softmax_scale=SOFTMAX_SCALE, causal=a.causal, **kwargs)
    implementation = "kernel" if a.format in fm.kernel_formats() else "reference"
    out, lse = fm.flash_mla_with_kvcache(*args, fm.HEAD_DIM_V, meta, implementation=implementation, **common)
    ref, ref_lse = fm.flash_mla_with_kvcache(*args, implementation="reference", **common)
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)  # [b, s_q, h_q, 512]
    lse, ref_lse = np.asarray(lse, np.float64), np.asarray(ref_lse, np.float64)  # [b, h_q, s_q]

    print(f"{a.format}: path {implementation}; {rows} query rows per KV head; seqlens {seqlens.tolist()}; "
          f"num_splits {np.asarray(meta.num_splits).tolist()}")
    print(f"overall rel-L2 {rel(out, ref):.3e}; NaN in out {int(np.isnan(out).sum())}, "
          f"inf {int(np.isinf(out).sum())}")
    print("by 64-channel block: " + " ".join(f"{rel(out[..., 64 * j:64 * j + 64], ref[..., 64 * j:64 * j + 64]):.1e}"
                                             for j in range(8)))
    print("by channel parity (even / odd): "
          f"{rel(out[..., 0::2], ref[..., 0::2]):.1e} / {rel(out[..., 1::2], ref[..., 1::2]):.1e}")
    for i in range(a.b):
        for s in range(a.s_q):
            errs = []
            for h in range(a.h_q):
                r = rel(out[i, s, h], ref[i, s, h]) if np.any(ref[i, s, h]) else float(np.abs(out[i, s, h]).max())
                errs.append(f"{r:.0e}")
            seen = np.isfinite(ref_lse[i, :, s])
            dl = np.abs(lse[i, :, s][seen] - ref_lse[i, :, s][seen]) if seen.any() else np.zeros(1)
            inf_ok = np.array_equal(np.isposinf(lse[i, :, s]), np.isposinf(ref_lse[i, :, s]))
            print(f"seq {i} s {s}: rel by head [{' '.join(errs)}]; max|dlse| {dl.max():.1e}; +inf rows agree {inf_ok}")
    # A constant factor per row points at a normalization or merge bug (rows without keys: 0 / 0 -> shown as 0).
    nonzero = ref != 0
    ratio = np.divide(out, ref, out=np.zeros_like(out), where=nonzero)
    med = np.array([[[np.median(ratio[i, s, h][nonzero[i, s, h]]) if nonzero[i, s, h].any() else 0.0
                      for h in range(a.h_q)] for s in range(a.s_q)] for i in range(a.b)])
    print("median out / ref per (seq, s, head):")
    print(np.array2string(med, precision=3, max_line_width=120))
    return 0


if __name__ == "__main__":
    sys.exit(main())
