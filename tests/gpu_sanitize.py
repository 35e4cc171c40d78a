"""A tiny decode for compute-sanitizer (memcheck, racecheck), to be run by scripts/gpu_check.sh as

    compute-sanitizer --tool memcheck python3 tests/gpu_sanitize.py
    compute-sanitizer --tool racecheck --kernel-name kns=splitkv_mla_kernel python3 tests/gpu_sanitize.py
    compute-sanitizer --tool racecheck --kernel-name kns=combine_kernel python3 tests/gpu_sanitize.py

(racecheck over the whole JAX program instruments every XLA kernel too and did not finish in 100 s on the H200;
the kernel-name filter instruments only ours.) Small shapes that still reach every code path of the bf16 kernel and
the combine: a sequence split over several partitions (partials + combine), single-split sequences (direct writes),
a partial last page with NaN slots behind it (V rows zeroed in shared memory), causal masking, a zero-length
sequence, two row tiles per KV head (s_q 2 x 36 heads = 72 rows, the second tile padded) and two KV heads.
Exits non-zero on a wrong or non-finite result.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # sanitizers track every allocation

import numpy as np  # noqa: E402

import jax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax_flash_mla as fm  # noqa: E402
from oracle import SOFTMAX_SCALE, make_decode_inputs  # noqa: E402


def main() -> int:
    if "bf16" not in fm.kernel_formats():
        print("gpu_sanitize: no usable bf16 kernel here; nothing to check")
        return 0
    rng = np.random.default_rng(0)
    inp = make_decode_inputs(rng, b=3, s_q=2, h_q=72, h_kv=2, seqlens=np.array([700, 0, 90], np.int32),
                             kv_format="bf16")
    args, kwargs = inp.kernel_args()
    # num_sms=16 -> several partitions, so the 700-token sequence is split and combined.
    meta = fm.get_mla_metadata(args[3], 2 * 72 // 2, 2, num_sms=16)
    out, lse = fm.flash_mla_with_kvcache(*args, 512, meta, softmax_scale=SOFTMAX_SCALE, causal=True,
                                         implementation="kernel", **kwargs)
    ref_out, ref_lse = fm.flash_mla_with_kvcache(*args, softmax_scale=SOFTMAX_SCALE, causal=True,
                                                 implementation="reference", **kwargs)
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    ref_out, ref_lse = np.asarray(ref_out, np.float32), np.asarray(ref_lse)
    ok = np.isfinite(out).all() and np.array_equal(np.isposinf(lse), np.isposinf(ref_lse))
    err = np.abs(out - ref_out).max()
    ok = ok and err < 2e-2
    print(f"gpu_sanitize: splits={np.asarray(meta.num_splits).tolist()} max|out-ref|={err:.3e} ok={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
