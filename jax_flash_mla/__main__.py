"""Main job: `python -m jax_flash_mla` runs a small decode in every cache format and prints a table.

On a Hopper GPU with the kernels built it runs them; elsewhere it runs the jnp reference. Each row compares the result
against the reference of the same format (for the reference itself that difference is 0 by construction) and
against bf16 attention on the unquantized latent (the quantization error of the format).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import (KV_FORMATS, PAGE_SIZE, flash_mla_with_kvcache, get_mla_metadata, kernel_formats,
               mla_decode_reference, quantize_kv_cache)
from ._cli import positive_int

FP8_MAX = 448.0


def make_problem(key, batch, seqlen_q, heads_q, heads_k, max_len):
    """Random bf16 latent cache in shuffled pages and bf16 queries; lengths spread over [1, max_len]."""
    k_lat, k_q, k_len, k_perm = jax.random.split(key, 4)
    pages_per_seq = -(-max_len // PAGE_SIZE)
    num_blocks = batch * pages_per_seq
    latent = jax.random.normal(k_lat, (num_blocks, PAGE_SIZE, heads_k, 576), jnp.float32).astype(jnp.bfloat16)
    q = jax.random.normal(k_q, (batch, seqlen_q, heads_q, 576), jnp.float32).astype(jnp.bfloat16)
    seqlens = jax.random.randint(k_len, (batch,), 1, max_len + 1, jnp.int32)
    table = jax.random.permutation(k_perm, num_blocks).reshape(batch, pages_per_seq).astype(jnp.int32)
    return q, latent, table, seqlens


def format_inputs(kv_format, q, latent):
    """q, cache and descales for a format; fp8_per_tensor takes its scales from the data's amax."""
    if kv_format != "fp8_per_tensor":
        return q, quantize_kv_cache(latent, kv_format), {}
    descale_q = jnp.max(jnp.abs(q.astype(jnp.float32))) / FP8_MAX
    descale_k = jnp.max(jnp.abs(latent.astype(jnp.float32))) / FP8_MAX
    q8 = (q.astype(jnp.float32) / descale_q).astype(jnp.float8_e4m3fn)
    cache = quantize_kv_cache(latent, kv_format, scale=descale_k)
    return q8, cache, {"descale_q": descale_q, "descale_k": descale_k}


def rel_l2(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=positive_int, default=4)
    parser.add_argument("--seqlen-q", type=positive_int, default=1)
    parser.add_argument("--heads-q", type=positive_int, default=16)
    parser.add_argument("--heads-k", type=positive_int, default=1)
    parser.add_argument("--max-len", type=positive_int, default=300)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args(argv)
    if args.heads_q % args.heads_k:
        parser.error(f"--heads-q ({args.heads_q}) must be a multiple of --heads-k ({args.heads_k})")

    q, latent, table, seqlens = make_problem(jax.random.key(0), args.batch, args.seqlen_q, args.heads_q,
                                             args.heads_k, args.max_len)
    meta = get_mla_metadata(seqlens, args.seqlen_q * args.heads_q // args.heads_k, args.heads_k)
    exact, _ = mla_decode_reference(q, latent, table, seqlens, softmax_scale=576 ** -0.5, causal=args.causal,
                                    kv_format="bf16")
    usable = kernel_formats()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; kernels usable: {sorted(usable) or 'none'}")
    print(f"batch {args.batch}, seqlen_q {args.seqlen_q}, heads {args.heads_q}/{args.heads_k}, "
          f"lengths {np.asarray(seqlens).tolist()}, causal {args.causal}\n")
    print(f"{'format':<16}{'path':<11}{'rel-L2 vs ref':>15}{'rel-L2 vs bf16 latent':>23}{'ms':>9}")
    for kv_format in KV_FORMATS:
        qf, cache, scales = format_inputs(kv_format, q, latent)
        decode = jax.jit(lambda qf, cache, scales: flash_mla_with_kvcache(
            qf, cache, table, seqlens, 512, meta, causal=args.causal, kv_format=kv_format, **scales))
        ref = jax.jit(lambda qf, cache, scales: mla_decode_reference(
            qf, cache, table, seqlens, softmax_scale=576 ** -0.5, causal=args.causal, kv_format=kv_format,
            **scales))
        out, _ = jax.block_until_ready(decode(qf, cache, scales))
        start = time.perf_counter()
        out, _ = jax.block_until_ready(decode(qf, cache, scales))
        elapsed_ms = (time.perf_counter() - start) * 1e3
        ref_out, _ = ref(qf, cache, scales)
        path = "kernel" if kv_format in usable else "reference"
        print(f"{kv_format:<16}{path:<11}{rel_l2(out, ref_out):>15.2e}{rel_l2(out, exact):>23.2e}"
              f"{elapsed_ms:>9.2f}")


if __name__ == "__main__":
    main()
