"""Sharded decode and cache writes on 8 CPU devices (tests/conftest.py asks XLA for them): heads, batch (one page pool
per batch shard, local block ids) and 2-D meshes, in every cache format.

Each supported strategy must compile to per-device work with no collective, and give bit for bit what the
single-device op gives on each shard's data. Against one unsharded call on the whole batch the match is to the last
float32 ulp only: XLA's CPU dot blocks a batch of 8 differently from a batch of 2. Unsupported shardings warn
(ReshardWarning, naming the operand) or raise; each checker is shown to fail on a program that breaks it.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jax_flash_mla as fm
from jax_flash_mla import hlo, quant, sharding

CPUS = jax.devices("cpu")
pytestmark = pytest.mark.skipif(len(CPUS) < 8, reason="needs 8 CPU devices: XLA_FLAGS="
                                "--xla_force_host_platform_device_count=8 before JAX starts (tests/conftest.py)")

DATA, MODEL = 4, 2  # mesh ("data", "model")
B, S_Q, H_Q, POOL, MAX_PAGES = 8, 2, 4, 4, 3  # POOL: cache blocks per data shard
ROWS = B // DATA
GARBAGE_BLOCK = 2147480000  # block_table entries past the used pages (never read)
FP8_MAX = 448.0


def make_mesh(axis_type=AxisType.Explicit):
    return Mesh(np.array(CPUS[:8]).reshape(DATA, MODEL), ("data", "model"), axis_types=(axis_type,) * 2)


def make_problem(kv_format, h_kv=1, seed=0):
    """Host arrays: q, cache, local block ids (per data-shard pool) and the same pages as global ids."""
    rng = np.random.default_rng(seed)
    latent = rng.standard_normal((DATA * POOL, 64, h_kv, 576)).astype(np.float32)
    q = rng.standard_normal((B, S_Q, H_Q, 576)).astype(np.float32)
    seqlens = rng.integers(1, MAX_PAGES * 64 + 1, B).astype(np.int32)
    seqlens[0], seqlens[3] = 0, MAX_PAGES * 64  # an empty sequence and a full one
    local = np.full((B, MAX_PAGES), GARBAGE_BLOCK, np.int32)
    glob = local.copy()
    for i, length in enumerate(seqlens):
        pages = -(-int(length) // 64)
        local[i, :pages] = rng.permutation(POOL)[:pages]
        glob[i, :pages] = local[i, :pages] + (i // ROWS) * POOL
    kw = {}
    if kv_format == "fp8_per_tensor":
        descale_q = np.float32(np.abs(q).max() / FP8_MAX)
        descale_k = np.float32(np.abs(latent).max() / FP8_MAX)
        q = jnp.asarray(q / descale_q).astype(jnp.float8_e4m3fn)
        cache = fm.quantize_kv_cache(latent, kv_format, scale=descale_k)
        kw = dict(descale_q=descale_q, descale_k=descale_k)
    else:
        q = jnp.asarray(q, jnp.bfloat16)
        cache = fm.quantize_kv_cache(latent, kv_format)
    return dict(q=np.asarray(q), k_cache=np.asarray(cache), local=local, glob=glob, seqlens=seqlens, kw=kw)


def decode_fn(kv_format, kw, meta=False):
    def fn(q, k_cache, block_table, cache_seqlens):
        m = fm.get_mla_metadata(cache_seqlens, S_Q * q.shape[2] // k_cache.shape[2], k_cache.shape[2]) if meta \
            else None
        return fm.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, m, causal=True,
                                         kv_format=kv_format, **kw)
    return fn


def put(mesh, x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def run_sharded(fn, mesh, args, specs, donate=()):
    """jit(fn) on NamedSharding inputs: (outputs, compiled). ReshardWarnings are recorded, not raised."""
    args = [put(mesh, a, s) for a, s in zip(args, specs)]
    jitted = jax.jit(fn, donate_argnums=donate)
    compiled = jitted.lower(*args).compile()
    return compiled(*args), compiled


def run_single(fn, *args):
    return jax.jit(fn)(*[jax.device_put(a, CPUS[0]) for a in args])


def per_shard(fn, p, table, batch_shards, head_shards, pooled, kv_heads_sharded):
    """The single-device op on each shard's data (local shapes), assembled: what a partitioned decode must equal."""
    q, cache = p["q"], p["k_cache"]
    out = np.zeros((B, S_Q, H_Q, 512), np.float32)
    lse = np.zeros((B, H_Q, S_Q), np.float32)
    rows, heads = B // batch_shards, H_Q // head_shards
    blocks, h_kv = cache.shape[0] // batch_shards, cache.shape[2]
    for i in range(batch_shards):
        r = slice(i * rows, (i + 1) * rows)
        c = cache[i * blocks:(i + 1) * blocks] if pooled else cache
        for j in range(head_shards):
            h = slice(j * heads, (j + 1) * heads)
            cj = c[:, :, j * h_kv // head_shards:(j + 1) * h_kv // head_shards] if kv_heads_sharded else c
            o, l = run_single(fn, q[r][:, :, h], cj, table[r], p["seqlens"][r])
            out[r, :, h] = np.asarray(o, np.float32)
            lse[r, h] = np.asarray(l)
    return out, lse


def assert_bitwise(got, want):
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), want[0])
    np.testing.assert_array_equal(np.asarray(got[1]), want[1])


def assert_close_to_unsharded(got, fn, p):
    """Same as one single-device call on the whole batch with global block ids, to float32 / bf16 rounding."""
    out, lse = run_single(fn, p["q"], p["k_cache"], p["glob"], p["seqlens"])
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(out, np.float32), rtol=2 ** -7, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(lse), rtol=1e-6)


# name: (q spec, cache spec, block_table / cache_seqlens spec, block ids, batch shards, head shards, h_kv)
STRATEGIES = {
    "heads": (P(None, None, "model"), P(), P(), "glob", 1, MODEL, 1),
    "batch": (P("data"), P("data"), P("data"), "local", DATA, 1, 1),
    "2d": (P("data", None, "model"), P("data"), P("data"), "local", DATA, MODEL, 1),
    "batch_cache_replicated": (P("data"), P(), P("data"), "glob", DATA, 1, 1),
    "heads_kv2": (P(None, None, "model"), P(None, None, "model"), P(), "glob", 1, MODEL, 2),
    "2d_kv2": (P("data", None, "model"), P("data", None, "model"), P("data"), "local", DATA, MODEL, 2),
}
CASES = ([(s, f, AxisType.Explicit) for s in ("heads", "batch", "2d") for f in fm.KV_FORMATS]
         + [(s, "bf16", AxisType.Auto) for s in ("heads", "batch", "2d")]
         + [(s, "bf16", AxisType.Explicit) for s in ("batch_cache_replicated", "heads_kv2", "2d_kv2")])


@pytest.mark.parametrize("strategy, kv_format, axis_type", CASES)
def test_supported_strategy_is_local_and_exact(strategy, kv_format, axis_type):
    q_spec, cache_spec, row_spec, ids, batch_shards, head_shards, h_kv = STRATEGIES[strategy]
    p = make_problem(kv_format, h_kv)
    fn = decode_fn(kv_format, p["kw"])
    mesh = make_mesh(axis_type)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sharding.ReshardWarning)
        got, compiled = run_sharded(fn, mesh, [p["q"], p["k_cache"], p[ids], p["seqlens"]],
                                    [q_spec, cache_spec, row_spec, row_spec])
    assert hlo.collectives_in(compiled) == []
    batch_axis = "data" if batch_shards > 1 else None
    head_axis = "model" if head_shards > 1 else None
    assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, P(batch_axis, None, head_axis)), 4)
    assert got[1].sharding.is_equivalent_to(NamedSharding(mesh, P(batch_axis, head_axis)), 3)
    pooled = cache_spec != P() and cache_spec[0] == "data"
    assert_bitwise(got, per_shard(fn, p, p[ids], batch_shards, head_shards, pooled, kv_heads_sharded=h_kv > 1))
    assert_close_to_unsharded(got, fn, p)


def test_gspmd_partitioner_too():
    p = make_problem("bf16")
    fn = decode_fn("bf16", p["kw"])
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        got, compiled = run_sharded(fn, make_mesh(AxisType.Auto), [p["q"], p["k_cache"], p["local"], p["seqlens"]],
                                    [P("data", None, "model"), P("data"), P("data"), P("data")])
    finally:
        jax.config.update("jax_use_shardy_partitioner", True)
    assert hlo.collectives_in(compiled) == []
    assert_bitwise(got, per_shard(fn, p, p["local"], DATA, MODEL, pooled=True, kv_heads_sharded=False))


def test_checks_can_fail():
    """The collective checker flags communicating programs; the bitwise / pool checks tell local from global ids."""
    mesh = make_mesh(AxisType.Auto)
    x = put(mesh, np.ones((8, 4), np.float32), P("data"))
    assert "all-reduce" in hlo.collectives_in(jax.jit(lambda x: x.sum()).lower(x).compile())
    gather = jax.jit(lambda x: x * 2, out_shardings=NamedSharding(mesh, P()))
    assert "all-gather" in hlo.collectives_in(gather.lower(x).compile())
    # Global block ids on a pool-sharded cache are (by design) read as local ids: a different result, which the
    # comparisons above would reject.
    p = make_problem("bf16")
    fn = decode_fn("bf16", p["kw"])
    got, _ = run_sharded(fn, mesh, [p["q"], p["k_cache"], p["glob"], p["seqlens"]],
                         [P("data"), P("data"), P("data"), P("data")])
    with pytest.raises(AssertionError):
        assert_close_to_unsharded(got, fn, p)
    with pytest.raises(AssertionError):
        assert_bitwise(got, per_shard(fn, p, p["local"], DATA, 1, pooled=True, kv_heads_sharded=False))


# ------------------------------------------------------------------------------------------------------------------
# Scheduler metadata


class _Recorder:
    """Stands in for `schedule` inside jax_flash_mla.sharding: records the cache_seqlens shapes it schedules and the
    query rows per KV head it balances."""

    def __init__(self):
        self.shapes, self.rows = [], []

    def __call__(self, cache_seqlens, rows, h_kv, **params):
        self.shapes.append(tuple(cache_seqlens.shape))
        self.rows.append(rows)
        return fm.primitives.schedule(cache_seqlens, rows, h_kv, **params)


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(sharding, "schedule", rec)
    return rec


def test_metadata_is_computed_per_shard(recorder):
    p = make_problem("bf16")
    fn = decode_fn("bf16", p["kw"])
    run_sharded(fn, make_mesh(), [p["q"], p["k_cache"], p["local"], p["seqlens"]],
                [P("data", None, "model"), P("data"), P("data"), P("data")])
    # The partitioned function schedules its own batch of B / DATA rows with H_Q / MODEL heads.
    assert (ROWS,) in recorder.shapes and S_Q * H_Q // MODEL in recorder.rows


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_passed_metadata_is_ignored_when_sharded_and_adds_no_communication(recorder, axis_type):
    p = make_problem("bf16")
    fn = decode_fn("bf16", p["kw"], meta=True)  # get_mla_metadata on the sharded batch, inside the jit
    got, compiled = run_sharded(fn, make_mesh(axis_type), [p["q"], p["k_cache"], p["local"], p["seqlens"]],
                                [P("data"), P("data"), P("data"), P("data")])
    assert hlo.collectives_in(compiled) == []
    assert (ROWS,) in recorder.shapes
    assert_bitwise(got, per_shard(decode_fn("bf16", p["kw"]), p, p["local"], DATA, 1, pooled=True,
                                  kv_heads_sharded=False))


def test_passed_metadata_is_used_when_nothing_is_split(recorder):
    p = make_problem("bf16")
    got, compiled = run_sharded(decode_fn("bf16", p["kw"], meta=True), make_mesh(),
                                [p["q"], p["k_cache"], p["glob"], p["seqlens"]], [P(), P(), P(), P()])
    assert recorder.shapes == []  # nothing scheduled inside the decode
    assert hlo.collectives_in(compiled) == []


# ------------------------------------------------------------------------------------------------------------------
# Unsupported shardings

# name: (q spec, cache spec, block_table spec, cache_seqlens spec, block ids, h_kv, warning pattern)
RESHARDED = {
    "seqlen_q": (P(None, "model"), P(), P(), P(), "glob", 1, r"q dim 1 \(seqlen_q\) sharded over \('model'\)"),
    "q_576": (P(None, None, None, "model"), P(), P(), P(), "glob", 1, r"q dim 3 \(head_dim 576\)"),
    "cache_576": (P(), P(None, None, None, "model"), P(), P(), "glob", 1, r"k_cache dim 3 \(last dim\)"),
    "cache_page_slot": (P(), P(None, "model"), P(), P(), "glob", 1, r"k_cache dim 1 \(page slot\)"),
    "pages_inside_sequence": (P(), P("data"), P(), P(), "glob", 1,
                              r"k_cache dim 0 \(num_blocks\) sharded over \('data'\) -> replicated"),
    "block_table_other_axis": (P("data"), P("data"), P("model"), P("data"), "local", 1,
                               r"block_table dim 0 \(batch\) sharded over \('model'\) -> \('data'\)"),
    "kv_heads_not_following_q": (P(None, None, "model"), P(), P(), P(), "glob", 2,
                                 r"k_cache dim 2 \(num_heads_k\) replicated -> sliced"),
}


@pytest.mark.parametrize("case", sorted(RESHARDED))
def test_unsupported_sharding_is_resharded_with_a_warning(case):
    q_spec, cache_spec, table_spec, len_spec, ids, h_kv, pattern = RESHARDED[case]
    p = make_problem("bf16", h_kv)
    fn = decode_fn("bf16", p["kw"])
    with pytest.warns(sharding.ReshardWarning, match=pattern):
        got, _ = run_sharded(fn, make_mesh(), [p["q"], p["k_cache"], p[ids], p["seqlens"]],
                             [q_spec, cache_spec, table_spec, len_spec])
    assert_close_to_unsharded(got, fn, p)


def test_cache_pools_on_other_axes_than_the_batch_is_an_error():
    p = make_problem("bf16")
    with pytest.raises(Exception, match=r"k_cache dim 0 \(num_blocks\) is sharded over mesh axes \('model'\) but "
                                        r"the batch .* over \('data'\)"):
        run_sharded(decode_fn("bf16", p["kw"]), make_mesh(), [p["q"], p["k_cache"], p["local"], p["seqlens"]],
                    [P("data"), P("model"), P("data"), P("data")])


# ------------------------------------------------------------------------------------------------------------------
# Cache writes


def write_problem(kv_format, seed=1):
    rng = np.random.default_rng(seed)
    cache = np.asarray(fm.quantize_kv_cache(rng.standard_normal((DATA * POOL, 64, 1, 576)).astype(np.float32),
                                            kv_format, **({"scale": 0.01} if kv_format == "fp8_per_tensor" else {})))
    new_kv = rng.standard_normal((B, 2, 1, 576)).astype(np.float32)
    table = np.stack([rng.permutation(POOL)[:MAX_PAGES] for _ in range(B)]).astype(np.int32)  # local ids
    positions = rng.integers(0, MAX_PAGES * 64, (B, 2)).astype(np.int32)
    positions[:, 1] = np.minimum(positions[:, 0] + 1, MAX_PAGES * 64 - 1)
    positions[1, 1] = -1  # padding: dropped
    return cache, new_kv, table, positions


def write_fn(kv_format, write=sharding.write_kv_cache):
    scale = {"scale": jnp.float32(0.01)} if kv_format == "fp8_per_tensor" else {}
    return lambda cache, new_kv, table, positions: write(cache, new_kv, table, positions, kv_format, **scale)


@pytest.mark.parametrize("kv_format", fm.KV_FORMATS)
@pytest.mark.parametrize("pooled", [True, False], ids=["page_pools", "replicated_cache"])
def test_sharded_write_is_local_exact_and_in_place(kv_format, pooled):
    """Page pools over "data" (batch rows split the same way), or one replicated cache that every device updates; the
    "model" axis replicates both (the write of the 2-D strategy)."""
    cache, new_kv, table, positions = write_problem(kv_format)
    fn = write_fn(kv_format)
    row_spec = P("data") if pooled else P()
    if not pooled:  # one cache for all: global ids
        table = table + (np.arange(B)[:, None] // ROWS) * POOL
    with warnings.catch_warnings():
        warnings.simplefilter("error", sharding.ReshardWarning)
        got, compiled = run_sharded(fn, make_mesh(), [cache, new_kv, table, positions],
                                    [row_spec, row_spec, row_spec, row_spec], donate=(0,))
    text = compiled.as_text()
    assert hlo.collectives_in(text) == []
    assert "input_output_alias={ {}: (0, {}, may-alias) }" in text  # the cache shard is updated in place
    if pooled:
        rows = lambda x, i: x[i * ROWS:(i + 1) * ROWS]
        want = np.concatenate([np.asarray(run_single(fn, cache[i * POOL:(i + 1) * POOL], rows(new_kv, i),
                                                     rows(table, i), rows(positions, i))) for i in range(DATA)])
    else:
        want = np.asarray(run_single(fn, cache, new_kv, table, positions))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))


def test_sharded_write_of_token_scales():
    """ds_scales="token" reaches every shard's write: the page pools hold what the single-device write leaves."""
    cache, new_kv, table, positions = write_problem("fp8_ds_mla")
    fn = lambda cache, new_kv, table, positions: sharding.write_kv_cache(cache, new_kv, table, positions,
                                                                          "fp8_ds_mla", ds_scales="token")
    got, compiled = run_sharded(fn, make_mesh(), [cache, new_kv, table, positions], [P("data")] * 4, donate=(0,))
    assert hlo.collectives_in(compiled) == []
    rows = lambda x, i: x[i * ROWS:(i + 1) * ROWS]
    want = np.concatenate([np.asarray(run_single(fn, cache[i * POOL:(i + 1) * POOL], rows(new_kv, i),
                                                 rows(table, i), rows(positions, i))) for i in range(DATA)])
    np.testing.assert_array_equal(np.asarray(got), want)
    scales = np.asarray(got)[..., 512:528].copy().view("<f4")
    written = (scales != np.asarray(cache)[..., 512:528].copy().view("<f4")).any(-1)
    assert written.any() and (scales[written] == scales[written][:, :1]).all()  # four equal scales per written token


def test_plain_jnp_write_into_page_pools_communicates():
    """Why the public write_kv_cache is sharding.write_kv_cache: the plain scatter (quant.write_kv_cache) treats block ids as global (Auto mode: gathers and
    permutes; Explicit mode: rejects the ambiguous scatter)."""
    cache, new_kv, table, positions = write_problem("bf16")
    specs = [P("data")] * 4
    _, compiled = run_sharded(write_fn("bf16", quant.write_kv_cache), make_mesh(AxisType.Auto),
                              [cache, new_kv, table, positions], specs)
    assert hlo.collectives_in(compiled)
    with pytest.raises(Exception, match="out_sharding"):
        run_sharded(write_fn("bf16", quant.write_kv_cache), make_mesh(), [cache, new_kv, table, positions], specs)


def test_write_into_replicated_cache_from_a_sharded_batch_warns():
    cache, new_kv, table, positions = write_problem("bf16")
    table = table + (np.arange(B)[:, None] // ROWS) * POOL  # one cache: global ids
    fn = write_fn("bf16")
    with pytest.warns(sharding.ReshardWarning, match=r"new_kv dim 0 \(batch\) sharded over \('data'\) -> replicated"):
        got, _ = run_sharded(fn, make_mesh(), [cache, new_kv, table, positions], [P(), P("data"), P("data"), P()])
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(run_single(fn, cache, new_kv, table, positions), np.float32))


def test_sharded_write_to_a_layer_of_stacked_caches():
    """layer=: caches [num_layers, num_blocks, ...] with the page pools over num_blocks (dim 1)."""
    cache, new_kv, table, positions = write_problem("fp8_ds_mla")
    caches = np.stack([cache, cache[::-1]])
    fn = lambda caches, new_kv, table, positions: sharding.write_kv_cache(caches, new_kv, table, positions,
                                                                           "fp8_ds_mla", layer=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sharding.ReshardWarning)
        got, compiled = run_sharded(fn, make_mesh(), [caches, new_kv, table, positions],
                                    [P(None, "data"), P("data"), P("data"), P("data")], donate=(0,))
    assert hlo.collectives_in(compiled) == []
    rows = lambda x, i: x[i * ROWS:(i + 1) * ROWS]
    want = np.concatenate([np.asarray(run_single(fn, caches[:, i * POOL:(i + 1) * POOL], rows(new_kv, i),
                                                 rows(table, i), rows(positions, i))) for i in range(DATA)], axis=1)
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(got)[0], caches[0])


@pytest.mark.parametrize("strategy", ["heads", "2d"])
def test_sharded_decode_of_a_layer_of_stacked_caches(strategy):
    """layer=: k_cache [num_layers, num_blocks, ...], the page pools over num_blocks (dim 1) for the batch; local,
    no communication, and bit for bit the decode of that layer's own cache under the same sharding."""
    q_spec, cache_spec, row_spec, ids, *_ = STRATEGIES[strategy]
    p = make_problem("fp8_ds_mla")
    caches = np.stack([p["k_cache"][::-1], p["k_cache"]])  # layer 1 holds the problem's cache
    stacked_spec = P(None, *cache_spec)
    fn = decode_fn("fp8_ds_mla", p["kw"])
    layered = lambda q, c, table, seqlens: fm.flash_mla_with_kvcache(q, c, table, seqlens, 512, causal=True,
                                                                     kv_format="fp8_ds_mla", layer=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sharding.ReshardWarning)
        got, compiled = run_sharded(layered, make_mesh(), [p["q"], caches, p[ids], p["seqlens"]],
                                    [q_spec, stacked_spec, row_spec, row_spec])
        want, _ = run_sharded(fn, make_mesh(), [p["q"], p["k_cache"], p[ids], p["seqlens"]],
                              [q_spec, cache_spec, row_spec, row_spec])
    assert hlo.collectives_in(compiled) == []
    assert_bitwise(got, (np.asarray(want[0], np.float32), np.asarray(want[1])))


def test_sharded_layers_dimension_is_resharded_with_a_warning():
    p = make_problem("bf16")
    caches = np.stack([p["k_cache"], p["k_cache"][::-1]])
    layered = lambda q, c, table, seqlens: fm.flash_mla_with_kvcache(q, c, table, seqlens, 512, causal=True,
                                                                     kv_format="bf16", layer=0)
    with pytest.warns(sharding.ReshardWarning, match=r"k_cache dim 0 \(num_layers\) sharded over \('model'\)"):
        got, _ = run_sharded(layered, make_mesh(), [p["q"], caches, p["glob"], p["seqlens"]],
                             [P(), P("model"), P(), P()])
    assert_close_to_unsharded(got, decode_fn("bf16", p["kw"]), p)
