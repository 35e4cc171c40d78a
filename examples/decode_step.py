"""A small DeepSeek-style MLA decoder served with jax_flash_mla: weight-absorbed attention over a paged latent cache.

Per layer (DeepSeek-V2/V3 "absorbed" inference form):
    q latent   cq = RMSNorm(h W_dq);  q_nope, q_rope = cq W_uq   (per head: nope_dim + 64)
    q          [q_nope W_uk | RoPE(q_rope)]                      (q_nope absorbed into the 512-channel latent: 576)
    new kv     [RMSNorm((h W_dkv)[:512]) | RoPE((h W_dkv)[512:])] -> write_kv_cache into the paged cache
    attention  flash_mla_with_kvcache(q, cache, ..., causal=True) -> out in latent space (512 per head)
    output     x += (out W_uv) W_o                                 (W_uv absorbed on the output side)
Layers run under `lax.scan` over stacked weights. The per-layer caches are stacked page-major in one array
`[num_blocks * layers, 64, h_kv, last]`: page `p` of layer `l` is row `p * layers + l` (layer `l` passes
`block_table * layers + l`). Every layer then reads and writes the one scan-carried buffer in place, with no
per-layer slice copies, and a num_blocks sharding keeps all layers of a page pool on the same device. (Stacking as
`[layers, num_blocks, ...]` would make each layer's decode read a slice copy; a 5-D `[num_blocks, layers, ...]` array
reshaped inside the step made XLA:CPU copy the whole cache twice per step for a layout change.)

Strategies (`--strategy`), on a ("data", "model") mesh:
  none   one device;
  heads  q heads and W_uq / W_uk / W_uv / W_o sharded over "model" (tensor parallel; W_o's contraction all-reduces),
         cache replicated;
  batch  tokens, block tables, lengths sharded over "data" and the cache over num_blocks: one page pool per data
         shard, block ids local to the pool; weights replicated; no communication at all;
  2d     both.
The step is jitted with the cache donated; sequences that reach --max-len restart empty (a new request reusing the
slot), so a long `--steps` loop keeps a bounded, steady state.

    python examples/decode_step.py --strategy batch --steps 8           # CPU: the jnp reference path
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/decode_step.py --strategy 2d
    python examples/decode_step.py --kv-format fp8_ds_mla --steps 100     # H200: the kernel path
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jax_flash_mla as fm
from jax_flash_mla import sharding as fm_sharding

LATENT, ROPE, PAGE = 512, 64, fm.PAGE_SIZE
# fp8_per_tensor: fixed scales (q and the cache are RMS-normalized, |values| stay well below 448 * scale).
Q_DESCALE = 16.0 / 448.0
KV_DESCALE = 8.0 / 448.0
STRATEGIES = ("none", "heads", "batch", "2d")


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int = 2
    hidden: int = 256
    heads: int = 8
    q_rank: int = 96  # rank of the q down-projection (DeepSeek's q_lora_rank)
    nope_dim: int = 32  # per-head q/k NoPE dim before absorption (DeepSeek-V3: 128)
    v_dim: int = 32  # per-head value dim before absorption (DeepSeek-V3: 128)
    vocab: int = 512
    kv_format: str = "bf16"
    batch: int = 8
    tokens_per_step: int = 1  # seqlen_q of each decode step (> 1: MTP-style, causal within the step)
    max_len: int = 256  # cache capacity per sequence, in tokens
    strategy: str = "none"
    data: int = 1  # mesh shape ("data", "model")
    model: int = 1
    implementation: str = "auto"
    page_pools: int = 0  # cache layout: 0 = one pool per data shard (batch / 2d) or a single one (none / heads)

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_len // PAGE)

    @property
    def pooled(self) -> bool:
        """Block ids local to a data shard's pool (batch / 2d) rather than global."""
        return self.strategy in ("batch", "2d")

    @property
    def pools(self) -> int:
        return self.page_pools or (self.data if self.pooled else 1)

    @property
    def softmax_scale(self) -> float:
        return (self.nope_dim + ROPE) ** -0.5  # the un-absorbed per-head q.k dim sets the scale


def default_mesh_shape(strategy: str, num_devices: int, heads: int, batch: int):
    if strategy == "none":
        return 1, 1
    if strategy == "heads":
        return 1, int(np.gcd(num_devices, heads))
    if strategy == "batch":
        return int(np.gcd(num_devices, batch)), 1
    model = 2 if num_devices % 2 == 0 and heads % 2 == 0 else 1
    return int(np.gcd(num_devices // model, batch)), model


def make_mesh(cfg: Config, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())[:cfg.data * cfg.model]
    return Mesh(np.array(devices).reshape(cfg.data, cfg.model), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


# ----------------------------------------------------------------------------------------------------------------
# Model


def init_params(cfg: Config, key) -> dict:
    ks = iter(jax.random.split(key, 12))

    def w(shape, fan_in):
        return jax.random.normal(next(ks), shape, jnp.float32) * fan_in ** -0.5

    L, D, H = cfg.layers, cfg.hidden, cfg.heads
    return {
        "embed": w((cfg.vocab, D), 1.0),
        "final_norm": jnp.ones((D,), jnp.float32),
        "unembed": w((D, cfg.vocab), D),
        "layers": {
            "attn_norm": jnp.ones((L, D), jnp.float32),
            "w_dq": w((L, D, cfg.q_rank), D),
            "q_norm": jnp.ones((L, cfg.q_rank), jnp.float32),
            "w_uq": w((L, cfg.q_rank, H, cfg.nope_dim + ROPE), cfg.q_rank),
            "w_dkv": w((L, D, LATENT + ROPE), D),
            "kv_norm": jnp.ones((L, LATENT), jnp.float32),
            "w_uk": w((L, H, cfg.nope_dim, LATENT), cfg.nope_dim),  # k_nope[h] = w_uk[h] @ latent
            "w_uv": w((L, H, LATENT, cfg.v_dim), LATENT),  # v[h] = latent @ w_uv[h]
            "w_o": w((L, H, cfg.v_dim, D), H * cfg.v_dim),
        },
    }


def rms_norm(x, weight, eps=1e-6):
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope(x, positions):
    """Rotate-half RoPE on the last (64) channels; positions [b, s] broadcast over the dims between."""
    half = x.shape[-1] // 2
    freqs = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32).reshape(positions.shape + (1,) * (x.ndim - 2)) * freqs
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _format_q(q, kv_format):
    """q at the API: bf16, or e4m3 with a fixed descale for fp8_per_tensor."""
    if kv_format != "fp8_per_tensor":
        return q.astype(jnp.bfloat16), {}
    q8 = jnp.clip(q / Q_DESCALE, -448.0, 448.0).astype(jnp.float8_e4m3fn)
    return q8, {"descale_q": jnp.float32(Q_DESCALE), "descale_k": jnp.float32(KV_DESCALE)}


def decode_step(cfg: Config, params, cache, block_table, seqlens, tokens):
    """One decode step for every sequence: appends `tokens` [b, s] and returns the next ones.

    cache [num_blocks * layers, 64, h_kv, last] (donate it); block_table [b, pages] (ids of the pages each sequence
    owns; local to the data shard's pool under the batch / 2d strategies); seqlens [b] tokens already cached.
    Returns (cache, seqlens, next_tokens [b, s], logits [b, s, vocab]).
    """
    layers = cfg.layers
    s = tokens.shape[1]
    positions = seqlens[:, None] + jnp.arange(s, dtype=jnp.int32)
    lengths = seqlens + s
    write_scale = {"scale": jnp.float32(KV_DESCALE)} if cfg.kv_format == "fp8_per_tensor" else {}

    def layer(carry, xs):
        x, cache = carry
        w, index = xs
        table = block_table * layers + index  # this layer's rows of the page-major cache
        h = rms_norm(x, w["attn_norm"])
        cq = rms_norm(h @ w["w_dq"], w["q_norm"])
        qh = jnp.einsum("bsr,rhd->bshd", cq, w["w_uq"])
        q_latent = jnp.einsum("bshn,hnc->bshc", qh[..., :cfg.nope_dim], w["w_uk"])
        q = jnp.concatenate([q_latent, rope(qh[..., cfg.nope_dim:], positions)], axis=-1)
        kv = h @ w["w_dkv"]
        new_kv = jnp.concatenate([rms_norm(kv[..., :LATENT], w["kv_norm"]), rope(kv[..., LATENT:], positions)], -1)
        cache = fm_sharding.write_kv_cache(cache, new_kv[:, :, None, :], table, positions, cfg.kv_format,
                                           **write_scale)
        q_api, scales = _format_q(q, cfg.kv_format)
        out, _ = fm.flash_mla_with_kvcache(q_api, cache, table, lengths, LATENT, softmax_scale=cfg.softmax_scale,
                                           causal=True, kv_format=cfg.kv_format, implementation=cfg.implementation,
                                           **scales)
        o = jnp.einsum("bshc,hcv->bshv", out.astype(jnp.float32), w["w_uv"])
        return (x + jnp.einsum("bshv,hvd->bsd", o, w["w_o"]), cache), None

    x = params["embed"][tokens]
    (x, cache), _ = lax.scan(layer, (x, cache), (params["layers"], jnp.arange(layers, dtype=jnp.int32)))
    logits = rms_norm(x, params["final_norm"]) @ params["unembed"]
    next_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # A full sequence restarts empty (a new request in that slot); its old pages are never read again.
    seqlens = jnp.where(lengths + s > cfg.pages_per_seq * PAGE, 0, lengths)
    return cache, seqlens, next_tokens, logits


# ----------------------------------------------------------------------------------------------------------------
# Serving state and sharding


def init_state(cfg: Config, key):
    """Cache with random history, block tables and lengths, as host arrays.

    The cache has cfg.pools page pools (consecutive block ranges), each serving batch / pools sequences plus one
    spare page filled with 0xFF bytes (NaN in every format: never read). Returns (cache, local_table, global_table,
    seqlens, tokens): local ids index a sequence's pool, global ids the whole cache (same pages).
    """
    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2 ** 31 - 1)))
    rows = cfg.batch // cfg.pools
    pool = rows * cfg.pages_per_seq + 1
    num_blocks = cfg.pools * pool
    latent = rng.standard_normal((num_blocks * cfg.layers, PAGE, 1, LATENT + ROPE), dtype=np.float32)
    scale = {"scale": KV_DESCALE} if cfg.kv_format == "fp8_per_tensor" else {}
    cache = np.array(fm.quantize_kv_cache(latent, cfg.kv_format, **scale))
    local = np.zeros((cfg.batch, cfg.pages_per_seq), np.int32)
    for p in range(cfg.pools):
        pages = rng.permutation(pool)
        spare = (p * pool + pages[-1]) * cfg.layers
        cache.view(np.uint8)[spare:spare + cfg.layers] = 0xFF  # the spare page, in every layer
        local[p * rows:(p + 1) * rows] = pages[:-1].reshape(rows, cfg.pages_per_seq)
    glob = local + (np.arange(cfg.batch)[:, None] // rows * pool).astype(np.int32)
    seqlens = rng.integers(1, cfg.max_len // 2 + 1, cfg.batch).astype(np.int32)
    tokens = rng.integers(0, cfg.vocab, (cfg.batch, cfg.tokens_per_step)).astype(np.int32)
    return cache, local, glob, seqlens, tokens


def shardings(cfg: Config, mesh: Mesh):
    """NamedShardings of (params, cache, block_table, seqlens, tokens) for cfg.strategy."""
    heads = "model" if cfg.strategy in ("heads", "2d") else None
    batch = "data" if cfg.strategy in ("batch", "2d") else None
    ns = functools.partial(NamedSharding, mesh)
    per_head = {"w_uq": P(None, None, heads), "w_uk": P(None, heads), "w_uv": P(None, heads),
                "w_o": P(None, heads)}
    names = jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))["layers"]
    params = {"embed": ns(P()), "final_norm": ns(P()), "unembed": ns(P()),
              "layers": {k: ns(per_head.get(k, P())) for k in names}}
    return params, ns(P(batch)), ns(P(batch)), ns(P(batch)), ns(P(batch))


def build(cfg: Config, devices=None, donate=True, seed=0):
    """(jitted step, params, state) placed on cfg's mesh; state = (cache, block_table, seqlens, tokens)."""
    mesh = make_mesh(cfg, devices)
    params_sh, cache_sh, table_sh, len_sh, tok_sh = shardings(cfg, mesh)
    params = jax.jit(functools.partial(init_params, cfg), out_shardings=params_sh)(jax.random.key(seed))
    cache, local, glob, seqlens, tokens = init_state(cfg, jax.random.key(seed + 1))
    if cfg.pooled and cfg.pools != cfg.data:
        raise ValueError(f"strategy {cfg.strategy!r} needs one page pool per data shard ({cfg.data}), got {cfg.pools}")
    table = local if cfg.pooled else glob
    state = (jax.device_put(cache, cache_sh), jax.device_put(table, table_sh), jax.device_put(seqlens, len_sh),
             jax.device_put(tokens, tok_sh))
    step = jax.jit(functools.partial(decode_step, cfg), donate_argnums=(1,) if donate else (),
                   in_shardings=(params_sh, cache_sh, table_sh, len_sh, tok_sh),
                   out_shardings=(cache_sh, len_sh, tok_sh, tok_sh))  # logits: batch-sharded like the tokens
    return step, params, state


def run(cfg: Config, steps: int, devices=None, seed=0, on_step=None):
    """Runs `steps` decode steps; returns the host logits and tokens of every step and the final state."""
    step, params, (cache, table, seqlens, tokens) = build(cfg, devices, seed=seed)
    history = []
    for i in range(steps):
        start = time.perf_counter()
        cache, seqlens, tokens, logits = step(params, cache, table, seqlens, tokens)
        jax.block_until_ready(tokens)
        elapsed = time.perf_counter() - start
        history.append((np.asarray(logits), np.asarray(tokens), np.asarray(seqlens)))
        if on_step:
            on_step(i, elapsed, history[-1])
    return history, (cache, table, seqlens, tokens)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=STRATEGIES, default="none")
    parser.add_argument("--kv-format", choices=fm.KV_FORMATS, default="bf16")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=Config.layers)
    parser.add_argument("--batch", type=int, default=Config.batch)
    parser.add_argument("--heads", type=int, default=Config.heads)
    parser.add_argument("--tokens-per-step", type=int, default=Config.tokens_per_step)
    parser.add_argument("--max-len", type=int, default=Config.max_len)
    parser.add_argument("--data", type=int, help="mesh 'data' size (default: from the strategy and devices)")
    parser.add_argument("--model", type=int, help="mesh 'model' size")
    parser.add_argument("--implementation", choices=("auto", "kernel", "reference"), default="auto")
    args = parser.parse_args(argv)

    data, model = default_mesh_shape(args.strategy, jax.device_count(), args.heads, args.batch)
    cfg = Config(layers=args.layers, heads=args.heads, kv_format=args.kv_format, batch=args.batch,
                 tokens_per_step=args.tokens_per_step, max_len=args.max_len, strategy=args.strategy,
                 data=args.data or data, model=args.model or model, implementation=args.implementation)
    path = "kernel" if args.implementation != "reference" and cfg.kv_format in fm.kernel_formats() else "reference"
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; strategy {cfg.strategy} on mesh "
          f"data={cfg.data} x model={cfg.model}; {cfg.kv_format} cache ({path} path); {cfg.layers} layers, "
          f"{cfg.heads} heads, batch {cfg.batch}, {cfg.tokens_per_step} token(s)/step\n")
    print(f"{'step':>5} {'ms':>9} {'lengths (first 4)':>22} {'next tokens (first 4)':>24}")

    def report(i, elapsed, record):
        _, tokens, seqlens = record
        if i < 10 or (i + 1) % max(args.steps // 10, 1) == 0:
            print(f"{i:>5} {elapsed * 1e3:>9.2f} {str(seqlens[:4].tolist()):>22} {str(tokens[:4, -1].tolist()):>24}")

    run(cfg, args.steps, on_step=report)


if __name__ == "__main__":
    main()
