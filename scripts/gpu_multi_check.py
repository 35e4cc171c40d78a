"""Issue 7 in one command on a two-GPU machine (nvidia-h200-x2): sharded decode with the kernels, every cache format.

For each format and each strategy of a 2-device mesh (heads: q heads over "model"; batch: the batch and one page
pool per device over "data"):
  1. attention   flash_mla_with_kvcache on the mesh equals, bit for bit, the single-GPU op on each device's shard,
                 and its compiled program has no collective;
  2. example     examples/decode_step.py under the strategy gives the single-GPU run's tokens and logits (the
                 whole model: heads sharding all-reduces W_o's contraction, so logits match to float rounding);
                 the collectives of its compiled step are listed;
  3. throughput  the attention at a fixed per-device shape (per-device batch --batch, h_q --heads, s_k --seqlen)
                 on 2 GPUs vs 1 GPU: per-GPU time ratio, within 5 % to pass.
Prints a table last; exit status 1 when a check fails.

    python3 scripts/gpu_multi_check.py                                   # the GPU machine, kernels
    XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
      python3 scripts/gpu_multi_check.py --implementation reference --skip-timing   # logic check on CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jax_flash_mla as fm
from jax_flash_mla import hlo

ROOT = Path(__file__).resolve().parent.parent
FP8_MAX = 448.0
# strategy: (mesh shape (data, model), q spec, cache spec, block table / lengths spec)
STRATEGIES = {
    "heads": ((1, 2), P(None, None, "model"), P(), P()),
    "batch": ((2, 1), P("data"), P("data"), P("data")),
}


def load_example():
    spec = importlib.util.spec_from_file_location("decode_step", ROOT / "examples" / "decode_step.py")
    module = sys.modules["decode_step"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_problem(kv_format, batch, heads, seqlen, pools, seed):
    """q, cache and lengths with `pools` page pools (one per batch shard); local and global block ids."""
    rng = np.random.default_rng(seed)
    pages = -(-seqlen // 64)
    rows = batch // pools
    pool = rows * pages
    latent = rng.standard_normal((pools * pool, 64, 1, 576)).astype(np.float32)
    q = rng.standard_normal((batch, 1, heads, 576)).astype(np.float32)
    lengths = rng.integers(seqlen // 2, seqlen + 1, batch).astype(np.int32)
    local = np.stack([rng.permutation(pool)[:pages] for _ in range(batch)]).astype(np.int32)
    glob = local + (np.arange(batch)[:, None] // rows * pool).astype(np.int32)
    kw = {}
    if kv_format == "fp8_per_tensor":
        descale_q = np.float32(np.abs(q).max() / FP8_MAX)
        descale_k = np.float32(np.abs(latent).max() / FP8_MAX)
        q = np.asarray(jnp.asarray(q / descale_q).astype(jnp.float8_e4m3fn))
        cache = fm.quantize_kv_cache(latent, kv_format, scale=descale_k)
        kw = dict(descale_q=descale_q, descale_k=descale_k)
    else:
        q = np.asarray(jnp.asarray(q, jnp.bfloat16))
        cache = fm.quantize_kv_cache(latent, kv_format)
    return dict(q=q, cache=np.asarray(cache), local=local, glob=glob, lengths=lengths, kw=kw)


def decode_fn(kv_format, kw, implementation):
    def fn(q, cache, table, lengths):
        return fm.flash_mla_with_kvcache(q, cache, table, lengths, 512, None, causal=False, kv_format=kv_format,
                                         implementation=implementation, **kw)
    return fn


def check_attention(kv_format, strategy, devices, args):
    """Bitwise equality with per-shard single-device runs, and no collective: (ok, detail)."""
    (data, model), q_spec, cache_spec, table_spec = STRATEGIES[strategy]
    mesh = Mesh(np.array(devices[:2]).reshape(data, model), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    pr = make_problem(kv_format, 4, 16, 300, data, seed=1)
    table = pr["local"] if strategy == "batch" else pr["glob"]
    fn = decode_fn(kv_format, pr["kw"], args.implementation)
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
    inputs = [put(pr["q"], q_spec), put(pr["cache"], cache_spec), put(table, table_spec), put(pr["lengths"], table_spec)]
    compiled = jax.jit(fn).lower(*inputs).compile()
    out, lse = compiled(*inputs)
    collectives = hlo.collectives_in(compiled)

    single = jax.jit(fn)
    on0 = lambda *xs: [jax.device_put(x, devices[0]) for x in xs]  # noqa: E731
    want_out, want_lse = np.zeros(np.shape(out), np.float32), np.zeros(np.shape(lse), np.float32)
    rows, heads = 4 // data, 16 // model
    blocks = pr["cache"].shape[0] // data
    for i in range(data):
        r = slice(i * rows, (i + 1) * rows)
        cache = pr["cache"][i * blocks:(i + 1) * blocks] if strategy == "batch" else pr["cache"]
        for j in range(model):
            h = slice(j * heads, (j + 1) * heads)
            o, l = single(*on0(pr["q"][r][:, :, h], cache, table[r], pr["lengths"][r]))
            want_out[r, :, h] = np.asarray(o, np.float32)
            want_lse[r, h] = np.asarray(l)
    equal = (np.array_equal(np.asarray(out, np.float32), want_out) and np.array_equal(np.asarray(lse), want_lse))
    return equal and not collectives, f"bitwise={equal} collectives={collectives or 'none'}"


def check_example(ex, kv_format, strategy, devices, args):
    """Tokens equal and logits close to the single-device run of the same problem: (ok, detail)."""
    (data, model), *_ = STRATEGIES[strategy]
    cfg2 = ex.Config(kv_format=kv_format, strategy=strategy, data=data, model=model, batch=8, heads=8,
                     implementation=args.implementation)
    # One device, the same pages: as many pools as the sharded run (global block ids, strategy none).
    cfg1 = dataclasses.replace(cfg2, strategy="none", data=1, model=1, page_pools=cfg2.pools)
    got, _ = ex.run(cfg2, args.steps, devices=devices[:2])
    want, _ = ex.run(cfg1, args.steps, devices=devices[:1])
    tokens = all(np.array_equal(g[1], w[1]) for g, w in zip(got, want))
    err = max(float(np.linalg.norm(g[0] - w[0]) / max(np.linalg.norm(w[0]), 1e-30)) for g, w in zip(got, want))
    step, params, state = ex.build(cfg2, devices=devices[:2], donate=False)
    collectives = sorted(set(hlo.collectives_in(step.lower(params, *state).compile())))
    ok = tokens and err <= args.logits_rtol and (strategy == "heads" or not collectives)
    return ok, f"tokens equal={tokens} logits rel-L2={err:.1e} step collectives={collectives or 'none'}"


def time_call(fn, inputs, iters, repeats):
    jax.block_until_ready(fn(*inputs))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            result = fn(*inputs)
        jax.block_until_ready(result)
        times.append((time.perf_counter() - start) / iters)
    return float(np.median(times))


def check_throughput(kv_format, strategy, devices, args):
    """Per-GPU time at one per-device shape, 2 devices vs 1: (ok, detail)."""
    (data, model), q_spec, cache_spec, table_spec = STRATEGIES[strategy]
    pr1 = make_problem(kv_format, args.batch, args.heads, args.seqlen, 1, seed=2)
    pr2 = make_problem(kv_format, args.batch * data, args.heads * model, args.seqlen, data, seed=2)
    fn = jax.jit(decode_fn(kv_format, pr1["kw"], args.implementation))
    one = [jax.device_put(x, devices[0]) for x in (pr1["q"], pr1["cache"], pr1["glob"], pr1["lengths"])]
    mesh = Mesh(np.array(devices[:2]).reshape(data, model), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    table = pr2["local"] if strategy == "batch" else pr2["glob"]
    two = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in
           zip((pr2["q"], pr2["cache"], table, pr2["lengths"]), (q_spec, cache_spec, table_spec, table_spec))]
    fn2 = jax.jit(decode_fn(kv_format, pr2["kw"], args.implementation))
    t1 = time_call(fn, one, args.iters, args.repeats)
    t2 = time_call(fn2, two, args.iters, args.repeats)
    ratio = t1 / t2  # per-GPU throughput of the sharded run relative to one GPU (same per-device work)
    return ratio >= 0.95, f"1 device {t1 * 1e6:.1f} us, 2 devices {t2 * 1e6:.1f} us, per-device ratio {ratio:.3f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default=",".join(fm.KV_FORMATS))
    parser.add_argument("--strategies", default="heads,batch")
    parser.add_argument("--implementation", choices=("kernel", "reference"), default="kernel")
    parser.add_argument("--steps", type=int, default=4, help="decode steps of the example")
    parser.add_argument("--logits-rtol", type=float, default=4e-3,
                        help="example logits, rel-L2 vs one device (bf16 activations: heads sharding reorders sums)")
    parser.add_argument("--batch", type=int, default=64, help="per-device batch of the timing")
    parser.add_argument("--heads", type=int, default=64, help="per-device q heads of the timing")
    parser.add_argument("--seqlen", type=int, default=4096, help="s_k of the timing")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--platform", help="devices of this JAX platform (default: the default backend's)")
    args = parser.parse_args(argv)

    devices = jax.devices(args.platform)
    print(f"jax {jax.__version__}; {len(devices)} x {devices[0].device_kind}; kernels built: {fm.kernel_formats()}")
    if len(devices) < 2:
        print("needs two devices")
        return 1
    ex = load_example()
    rows, failed = [], False
    for kv_format in args.formats.split(","):
        if args.implementation == "kernel" and kv_format not in fm.kernel_formats():
            rows.append((kv_format, "-", "-", "FAIL", "no kernel for this format here"))
            failed = True
            continue
        for strategy in args.strategies.split(","):
            checks = [("attention", check_attention), ("example", lambda *a: check_example(ex, *a))]
            if not args.skip_timing:
                checks.append(("throughput", check_throughput))
            for name, check in checks:
                ok, detail = check(kv_format, strategy, devices, args)
                failed |= not ok
                rows.append((kv_format, strategy, name, "ok" if ok else "FAIL", detail))
                print(f"[{kv_format} {strategy} {name}] {'ok' if ok else 'FAIL'}: {detail}", flush=True)
    print()
    for row in rows:
        print(f"{row[0]:15s} {row[1]:6s} {row[2]:10s} {row[3]:4s} {row[4]}")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
