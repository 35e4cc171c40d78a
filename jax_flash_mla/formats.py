"""MLA constants and the three KV-cache formats (byte layouts: docs/DESIGN.md, shared README §2)."""

from __future__ import annotations

import jax.numpy as jnp

HEAD_DIM_QK = 576  # 512 latent ("NoPE") channels + 64 RoPE channels
HEAD_DIM_V = 512  # V is the first 512 channels of the cached latent
HEAD_DIM_ROPE = HEAD_DIM_QK - HEAD_DIM_V
PAGE_SIZE = 64  # tokens per page of the paged cache
QUANT_TILE = 128  # fp8_ds_mla: one scale per 128 NoPE channels
NUM_SCALES = HEAD_DIM_V // QUANT_TILE
DS_MLA_BYTES_PER_TOKEN = HEAD_DIM_V + 4 * NUM_SCALES + 2 * HEAD_DIM_ROPE  # 656

KV_FORMATS = ("bf16", "fp8_per_tensor", "fp8_ds_mla")
FP8_FORMATS = ("fp8_per_tensor", "fp8_ds_mla")

# Last dimension of the cache and the dtypes each format accepts for it.
CACHE_LAST_DIM = {"bf16": HEAD_DIM_QK, "fp8_per_tensor": HEAD_DIM_QK, "fp8_ds_mla": DS_MLA_BYTES_PER_TOKEN}
CACHE_DTYPES = {
    "bf16": (jnp.dtype(jnp.bfloat16),),
    "fp8_per_tensor": (jnp.dtype(jnp.float8_e4m3fn),),
    "fp8_ds_mla": (jnp.dtype(jnp.uint8), jnp.dtype(jnp.float8_e4m3fn)),
}
# dtype of q at the API: fp8_ds_mla keeps q in bf16 (the kernel quantizes it if it wants).
Q_DTYPES = {
    "bf16": jnp.dtype(jnp.bfloat16),
    "fp8_per_tensor": jnp.dtype(jnp.float8_e4m3fn),
    "fp8_ds_mla": jnp.dtype(jnp.bfloat16),
}
BYTES_PER_TOKEN = {"bf16": 2 * HEAD_DIM_QK, "fp8_per_tensor": HEAD_DIM_QK, "fp8_ds_mla": DS_MLA_BYTES_PER_TOKEN}


def check_kv_format(kv_format) -> str:
    """Returns `kv_format` if it names a cache format, else raises ValueError."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
    return kv_format
