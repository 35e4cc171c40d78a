"""One decode shape, run a few times, for Nsight Compute on the GPU machine (scripts/gpu_profile.sh runs it).

    python3 scripts/profile_decode.py --format fp8_ds_mla --shape M1 [--batch 128] [--seqlen 8192] [--calls 3]

The inputs are random (never zeros; scripts/decode_case.py), and the metadata is computed once, so the profiled
launches are the decode and combine kernels alone. Prints the kernel's output checksum so a broken run shows.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax_flash_mla as fm  # noqa: E402
from decode_case import random_decode_case  # noqa: E402
from jax_flash_mla.bench import SHAPES  # noqa: E402
from jax_flash_mla.formats import PAGE_SIZE  # noqa: E402
from jax_flash_mla.scheduler import ROWS_PER_TILE  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", required=True, choices=fm.KV_FORMATS)
    parser.add_argument("--shape", default="M1", choices=[s for s in SHAPES if not SHAPES[s].varlen])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--implementation", default="kernel", choices=["kernel", "reference"])
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    b, pages = args.batch, -(-args.seqlen // PAGE_SIZE)
    decode, decode_args = random_decode_case(args.format, shape, b, args.seqlen, implementation=args.implementation)
    for _ in range(args.calls):
        out, lse = jax.block_until_ready(decode(*decode_args))
    # Page tiles of one launch: every page of every sequence, once per row tile of the (single) KV head's rows.
    page_tiles = b * pages * -(-shape.seqlen_q * shape.heads_q // ROWS_PER_TILE)
    print(f"profile_decode {args.format} {args.shape} b={b} s_k={args.seqlen}: "
          f"sum|out|={float(jnp.abs(out.astype(jnp.float32)).sum()):.6e} finite={bool(jnp.isfinite(lse).all())} "
          f"page_tiles={page_tiles}")
    return 0 if np.isfinite(float(jnp.abs(out.astype(jnp.float32)).sum())) else 1


if __name__ == "__main__":
    sys.exit(main())
