"""One decode shape, run a few times, for Nsight Compute on the GPU machine (scripts/gpu_profile.sh runs it).

    python3 scripts/profile_decode.py --format fp8_ds_mla --shape M1 [--batch 128] [--seqlen 8192] [--calls 3]

The inputs are random (never zeros): q and the latent cache drawn on the device, quantized with the package's
quantizer, pages in a shuffled order. The metadata is computed once, so the profiled launches are the decode and
combine kernels alone. Prints the kernel's output checksum so a broken run shows.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax_flash_mla as fm  # noqa: E402
from jax_flash_mla.bench import SHAPES  # noqa: E402
from jax_flash_mla.formats import HEAD_DIM_QK, PAGE_SIZE  # noqa: E402
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

    kq, kk, kp = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (b, shape.seqlen_q, shape.heads_q, HEAD_DIM_QK), jnp.float32)
    latent = jax.random.normal(kk, (b * pages, PAGE_SIZE, 1, HEAD_DIM_QK), jnp.bfloat16)
    block_table = jax.random.permutation(kp, b * pages).reshape(b, pages).astype(jnp.int32)
    lengths = jnp.full((b,), args.seqlen, jnp.int32)
    kwargs = {}
    if args.format == "fp8_per_tensor":
        descale_q = jnp.abs(q).max() / 448
        descale_k = jnp.abs(latent.astype(jnp.float32)).max() / 448
        q = (q / descale_q).astype(jnp.float8_e4m3fn)
        cache = fm.quantize_kv_cache(latent, args.format, descale_k)
        kwargs = dict(descale_q=descale_q.reshape(()), descale_k=descale_k.reshape(()))
    else:
        q = q.astype(jnp.bfloat16)
        cache = fm.quantize_kv_cache(latent, args.format)
    del latent
    meta = fm.get_mla_metadata(lengths, shape.seqlen_q * shape.heads_q, 1)
    decode = jax.jit(lambda q, cache, table, lengths, meta, kw: fm.flash_mla_with_kvcache(
        q, cache, table, lengths, 512, meta, causal=shape.causal, kv_format=args.format,
        implementation=args.implementation, **kw))
    for _ in range(args.calls):
        out, lse = jax.block_until_ready(decode(q, cache, block_table, lengths, meta, kwargs))
    # Page tiles of one launch: every page of every sequence, once per row tile of the (single) KV head's rows.
    page_tiles = b * pages * -(-shape.seqlen_q * shape.heads_q // ROWS_PER_TILE)
    print(f"profile_decode {args.format} {args.shape} b={b} s_k={args.seqlen}: "
          f"sum|out|={float(jnp.abs(out.astype(jnp.float32)).sum()):.6e} finite={bool(jnp.isfinite(lse).all())} "
          f"page_tiles={page_tiles}")
    return 0 if np.isfinite(float(jnp.abs(out.astype(jnp.float32)).sum())) else 1


if __name__ == "__main__":
    sys.exit(main())
