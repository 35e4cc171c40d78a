"""A tiny decode for compute-sanitizer (memcheck, racecheck, synccheck), to be run by scripts/gpu_check.sh as

    compute-sanitizer --tool memcheck python3 tests/gpu_sanitize.py
    compute-sanitizer --tool racecheck --kernel-name kns=splitkv_mla_kernel python3 tests/gpu_sanitize.py
    compute-sanitizer --tool racecheck --kernel-name kns=combine python3 tests/gpu_sanitize.py
    compute-sanitizer --tool synccheck --kernel-name kns=splitkv_mla_kernel python3 tests/gpu_sanitize.py

(racecheck over the whole JAX program instruments every XLA kernel too and did not finish in 100 s on the H200;
the kernel-name filter instruments only ours.) scripts/gpu_compare.sh also runs it without a sanitizer, as each
candidate build's smoke run. Small shapes that still reach every code path of the bf16 kernel and
the combine: a sequence split over several partitions (partials + combine), single-split sequences (direct writes),
a partial last page with NaN slots behind it (V rows zeroed in shared memory), causal masking, a zero-length
sequence, two row tiles per KV head (s_q 2 x 36 heads = 72 rows, the second tile padded) and two KV heads; and
one sequence cut into ~90 splits, which the combine's deep kernel merges (the other cases take its rows kernel).
The same decode runs for every built format of FORMATS (fp8_per_tensor: the consumers' V transpose into the
double-buffered V^T tiles, with the NaN slots of the partial page zeroed there; fp8_ds_mla: the q quantization
prologue, the per-group scale tiles and the same transpose). Exits non-zero on a wrong or
non-finite result.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # sanitizers track every allocation
# No GEMM autotuning: under compute-sanitizer XLA's autotuner compiles and runs many candidate kernels for the
# reference. Both crashed (rc 139) fp8_per_tensor racechecks of session 11 died there ("Compiling module
# gemm_fusion_dot"); with autotuning off, one ran clean in 5 s. The tool still segfaults at times (docs/PERF.md).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax_flash_mla as fm  # noqa: E402
from oracle import SOFTMAX_SCALE, make_decode_inputs  # noqa: E402


# Format -> (max |out - ref| bound or None, rel-L2 bound or None). The FP8 kernels round P (and fp8_ds_mla also q)
# to e4m3 (rel-L2 up to ~2^-4 against the fp32 reference: tests/test_decode_gpu.py's docstring).
FORMATS = {"bf16": (2e-2, None), "fp8_per_tensor": (None, 6e-2), "fp8_ds_mla": (None, 6e-2)}


def main() -> int:
    only = os.environ.get("SANITIZE_FORMATS")  # comma list to narrow the run, e.g. "bf16,fp8_per_tensor"
    formats = [f for f in FORMATS if f in fm.kernel_formats() and (not only or f in only.split(","))]
    if not formats:
        print("gpu_sanitize: no usable decode kernel here; nothing to check")
        return 0
    return max([check(f, s_q, h_q, h_kv) for f in formats for s_q, h_q, h_kv in SHAPES] +
               [check(f, 1, 16, 1, seqlens=[6000], num_sms=132) for f in formats])


# (s_q, h_q, h_kv): 72 rows per KV head (two row tiles, the second padded; 36 heads a group, which fp8_per_tensor's
# Q TMA box cannot tile, so its consumers copy Q); 16 rows (s_q 2 x 8 heads), which the FP8 formats run on their
# few-rows kernel (consumer_narrow.cuh: transposed WGMMAs, per-WG pages merged at the chunk's end) and bf16 on its
# 64-row kernel; and fp8_per_tensor's Q tile by the producer's TMA: 32 heads (a box of 32 heads x 2 query tokens,
# the second past s_q and zero-filled) and 64 heads of two KV heads (one box a tile).
SHAPES = ((2, 72, 2), (2, 8, 1), (1, 32, 1), (1, 128, 2))


def check(kv_format: str, s_q: int, h_q: int, h_kv: int, seqlens=(1500, 0, 90), num_sms: int = 16) -> int:
    rng = np.random.default_rng(0)
    inp = make_decode_inputs(rng, b=len(seqlens), s_q=s_q, h_q=h_q, h_kv=h_kv,
                             seqlens=np.array(seqlens, np.int32), kv_format=kv_format)
    args, kwargs = inp.kernel_args()
    # num_sms=16 -> 4 to 16 partitions, so the 1500-token sequence is split and combined (whole sequences would
    # cost more than the scheduler allows them: docs/DESIGN.md "Split-KV scheduling"). One sequence over 132
    # partitions (num_sm_parts >= 9 x batch) is merged by the combine's deep kernel.
    meta = fm.get_mla_metadata(args[3], s_q * h_q // h_kv, h_kv, num_sms=num_sms)
    out, lse = fm.flash_mla_with_kvcache(*args, 512, meta, softmax_scale=SOFTMAX_SCALE, causal=True,
                                         implementation="kernel", **kwargs)
    ref_out, ref_lse = fm.flash_mla_with_kvcache(*args, softmax_scale=SOFTMAX_SCALE, causal=True,
                                                 implementation="reference", **kwargs)
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    ref_out, ref_lse = np.asarray(ref_out, np.float32), np.asarray(ref_lse)
    ok = np.isfinite(out).all() and np.array_equal(np.isposinf(lse), np.isposinf(ref_lse))
    err = np.abs(out - ref_out).max()
    rel = np.linalg.norm(out - ref_out) / max(np.linalg.norm(ref_out), 1e-30)
    max_abs, max_rel = FORMATS[kv_format]
    ok = ok and (max_abs is None or err < max_abs) and (max_rel is None or rel < max_rel)
    print(f"gpu_sanitize [{kv_format}, s_q {s_q}, h_q {h_q}, h_kv {h_kv}, lengths {list(seqlens)}]: "
          f"splits={np.asarray(meta.num_splits).tolist()} max|out-ref|={err:.3e} "
          f"rel-L2={rel:.3e} ok={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
