"""Public API contract: argument errors, metadata, implementation switch, jit / vmap / grad behaviour."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash_mla as fm
from jax_flash_mla import _ffi
from jax_flash_mla import sharding as sharding_module
from jax_flash_mla.primitives import FORCE_REFERENCE_ENV, base, decode_p

B, S_Q, H_Q, H_KV, BLOCKS, MAX_PAGES = 2, 1, 4, 1, 6, 3


def inputs(kv_format="bf16", b=B, s_q=S_Q, h_q=H_Q, h_kv=H_KV):
    key = jax.random.key(1)
    latent = jax.random.normal(key, (BLOCKS, 64, h_kv, 576), jnp.float32).astype(jnp.bfloat16)
    q = jax.random.normal(jax.random.key(2), (b, s_q, h_q, 576), jnp.float32).astype(jnp.bfloat16)
    extra = {}
    if kv_format == "fp8_per_tensor":
        q = q.astype(jnp.float8_e4m3fn)
        extra = {"descale_q": jnp.float32(1.0), "descale_k": jnp.float32(0.5)}
        cache = fm.quantize_kv_cache(latent, kv_format, scale=jnp.float32(0.5))
    else:
        cache = fm.quantize_kv_cache(latent, kv_format)
    table = jnp.arange(b * MAX_PAGES, dtype=jnp.int32).reshape(b, MAX_PAGES) % BLOCKS
    seqlens = jnp.array([130, 5][:b] + [7] * max(0, b - 2), jnp.int32)
    return dict(q=q, k_cache=cache, block_table=table, cache_seqlens=seqlens, kv_format=kv_format, **extra)


def call(**kw):
    return fm.flash_mla_with_kvcache(**kw)


def replace(kind="bf16", **changes):
    kw = inputs(kind)
    kw.update(changes)
    return kw


@pytest.mark.parametrize("changes, error, match", [
    (dict(kv_format="fp16"), ValueError, "kv_format must be one of"),
    (dict(head_dim_v=576), ValueError, "head_dim_v must be 512"),
    (dict(q=jnp.zeros((2, 1, 4, 512), jnp.bfloat16)), ValueError, "q last dim must be 576"),
    (dict(q=jnp.zeros((2, 4, 576), jnp.bfloat16)), ValueError, "q must have rank 4"),
    (dict(q=jnp.zeros((2, 1, 4, 576), jnp.float32)), TypeError, "q must have dtype bfloat16"),
    (dict(k_cache=jnp.zeros((6, 32, 1, 576), jnp.bfloat16)), ValueError, "page size"),
    (dict(k_cache=jnp.zeros((6, 64, 1, 656), jnp.bfloat16)), ValueError, "k_cache last dim must be 576"),
    (dict(k_cache=jnp.zeros((6, 64, 1, 576), jnp.float16)), TypeError, "k_cache must have dtype bfloat16"),
    (dict(k_cache=jnp.zeros((6, 64, 3, 576), jnp.bfloat16)), ValueError, "must be a multiple of num_heads_k"),
    (dict(block_table=jnp.zeros((3, 3), jnp.int32)), ValueError, "block_table dim 0 must equal batch"),
    (dict(block_table=jnp.zeros((2, 3), jnp.int64 if jax.config.x64_enabled else jnp.float32)), TypeError,
     "block_table must have dtype int32"),
    (dict(cache_seqlens=jnp.zeros((3,), jnp.int32)), ValueError, r"cache_seqlens must have shape \[2\]"),
    (dict(cache_seqlens=jnp.array([1000, 1], jnp.int32)), ValueError, r"cache_seqlens must lie in \[0, 192\]"),
    (dict(cache_seqlens=jnp.array([-1, 1], jnp.int32)), ValueError, "cache_seqlens must lie in"),
    (dict(block_table=jnp.array([[0, 1, 99], [2, 3, 4]], jnp.int32)), ValueError, r"block_table\[0, 2\] = 99"),
    (dict(descale_q=jnp.float32(1)), ValueError, "descale_q is only used with kv_format='fp8_per_tensor'"),
    (dict(softmax_scale=-1.0), ValueError, "softmax_scale must be a positive finite"),
    (dict(softmax_scale="0.1"), ValueError, "softmax_scale must be a positive finite Python float .* got '0.1'"),
    (dict(head_dim_v="512"), ValueError, "head_dim_v must be 512 .* got '512'"),
    (dict(causal=1), TypeError, "causal must be a Python bool"),
    (dict(implementation="fast"), ValueError, "implementation must be one of"),
    (dict(ds_scales="tile"), ValueError, "ds_scales must be 'group' or 'token', got 'tile'"),
    (dict(ds_scales="token"), ValueError, "ds_scales='token' is only used by kv_format='fp8_ds_mla', got 'bf16'"),
])
def test_bad_arguments_raise_naming_the_argument(changes, error, match):
    with pytest.raises(error, match=match):
        call(**replace(**changes))


def test_ds_scales_does_not_change_the_reference():
    """ds_scales picks the kernel's decoder for fp8_ds_mla; the reference reads every cache alike, and a cache written
    with one scale per token decodes within e4m3's rounding of the per-group one."""
    kw = inputs("fp8_ds_mla")
    group = call(**kw, implementation="reference")
    token = call(**kw, implementation="reference", ds_scales="token")
    for a, b in zip(group, token):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    latent = jax.random.normal(jax.random.key(1), (BLOCKS, 64, H_KV, 576), jnp.float32)
    latent = latent.at[..., 128:256].multiply(2.0**-5).astype(jnp.bfloat16)  # a group below its token's largest
    kw["k_cache"] = fm.quantize_kv_cache(latent, "fp8_ds_mla")
    out_g, lse_g = call(**kw, implementation="reference")
    kw["k_cache"] = fm.quantize_kv_cache(latent, "fp8_ds_mla", ds_scales="token")
    out_t, lse_t = call(**kw, implementation="reference", ds_scales="token")
    out_g, out_t = (np.asarray(x.astype(jnp.float32)) for x in (out_g, out_t))
    rel = np.linalg.norm(out_t - out_g) / np.linalg.norm(out_g)
    assert 0 < rel < 3e-2  # that group's values rounded again at its token's scale, nothing more
    np.testing.assert_allclose(np.asarray(lse_t), np.asarray(lse_g), rtol=1e-2)


@pytest.mark.parametrize("changes, error, match", [
    (dict(q=jnp.zeros((2, 1, 4, 500), jnp.bfloat16)), ValueError, "q last dim must be 576"),
    (dict(k_cache=jnp.zeros((6, 64, 1, 576), jnp.float16)), TypeError, "k_cache must have dtype bfloat16"),
    (dict(cache_seqlens=jnp.array([-1, 1], jnp.int32)), ValueError, "cache_seqlens must lie in"),
    (dict(block_table=jnp.array([[0, 1, 99], [2, 3, 4]], jnp.int32)), ValueError, r"block_table\[0, 2\] = 99"),
    (dict(kv_format="fp16"), ValueError, "kv_format must be one of"),
    (dict(descale_k=jnp.float32(1)), ValueError, "descale_k is only used with kv_format='fp8_per_tensor'"),
])
def test_reference_checks_its_arguments_as_the_decode_does(changes, error, match):
    kw = replace(**changes)
    with pytest.raises(error, match=match):
        fm.mla_decode_reference(**kw, softmax_scale=576 ** -0.5, causal=False)


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_per_tensor"])
def test_python_lists_and_numbers_are_accepted(kv_format):
    """Lengths, block tables and descales may come as Python lists and numbers, as from a serving loop's host
    state; they mean the same as the int32 / float32 arrays, to the bit, for the decode (the kernel on a GPU) and
    for the reference alike."""
    kw = inputs(kv_format)
    loose = dict(kw, block_table=np.asarray(kw["block_table"]).tolist(),
                 cache_seqlens=np.asarray(kw["cache_seqlens"]).tolist())
    if kv_format == "fp8_per_tensor":
        loose.update(descale_q=1, descale_k=0.5)
    for fn in (call, lambda **k: fm.mla_decode_reference(**k, softmax_scale=576 ** -0.5, causal=False)):
        for a, b in zip(fn(**kw), fn(**loose)):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("kv_format", fm.KV_FORMATS)
def test_layer_of_stacked_caches_is_that_layers_decode(kv_format):
    """layer=: k_cache stacks the layers' caches [num_layers, num_blocks, ...]; the decode of layer l (a Python int,
    or traced) is bit for bit the decode of k_cache[l] with the same block ids."""
    kw = inputs(kv_format)
    cache = kw.pop("k_cache")
    caches = jnp.stack([cache[::-1], cache, cache[::-1]])
    want = call(**kw, k_cache=cache)
    in_jit = jax.jit(lambda caches, layer: call(**kw, k_cache=caches, layer=layer))
    for got in (call(**kw, k_cache=caches, layer=1), in_jit(caches, jnp.int32(1))):
        for a, b in zip(want, got):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("layer, error, match", [
    (3, ValueError, r"layer must lie in \[0, 3\) \(k_cache dim 0, num_layers\), got 3"),
    (-1, ValueError, r"layer must lie in \[0, 3\)"),
    (1.0, TypeError, "layer must be an integer scalar, got dtype float32"),
    (jnp.array([1]), TypeError, r"layer must be an integer scalar, got dtype int32 and shape \(1,\)"),
])
def test_layer_errors(layer, error, match):
    kw = inputs()
    kw["k_cache"] = jnp.stack([kw["k_cache"]] * 3)
    with pytest.raises(error, match=match):
        call(**kw, layer=layer)
    with pytest.raises(ValueError, match="k_cache must have rank 5"):
        call(**inputs(), layer=0)


class _DecodeRecorder:
    """Stands in for the decode primitive inside jax_flash_mla.sharding: records the k_cache shape that the kernel
    (or the reference) is given."""

    def __init__(self):
        self.cache_shapes = []

    def bind(self, q, k_cache, *args, **params):
        self.cache_shapes.append(k_cache.shape)
        return decode_p.bind(q, k_cache, *args, **params)


def test_a_layer_reaches_the_kernel_as_the_whole_stack(monkeypatch):
    """What keeps `layer=` free of copies: the decode primitive gets the stack itself, its leading dimensions merged
    into one pool of pages (a bitcast; the layer's block ids are offset into it), never the slice k_cache[layer],
    which XLA would materialize for the custom call (scripts/stacked_cache_copy.py)."""
    kw = inputs("fp8_ds_mla")
    recorder = _DecodeRecorder()
    monkeypatch.setattr(sharding_module, "decode_p", recorder)
    jax.clear_caches()  # lower again, through the recorder
    call(**dict(kw, k_cache=jnp.stack([kw["k_cache"]] * 3)), layer=2)
    assert recorder.cache_shapes == [(3 * BLOCKS, 64, 1, 656)]


def test_unused_block_table_entries_may_be_garbage():
    kw = inputs()
    kw["block_table"] = kw["block_table"].at[1, 1:].set(2147480000)  # sequence 1 uses one page
    out, lse = call(**kw)
    assert np.isfinite(np.asarray(out, np.float32)).all() and np.isfinite(np.asarray(lse)).all()


@pytest.mark.parametrize("changes, match", [
    (dict(descale_q=None), "descale_q is required"),
    (dict(descale_k=jnp.ones((2,), jnp.float32)), r"descale_k must be a float32 scalar of shape \[\] or \[1\]"),
    (dict(descale_k=jnp.ones((1,), jnp.bfloat16)), "descale_k must have dtype float32"),
    (dict(q=jnp.zeros((2, 1, 4, 576), jnp.bfloat16)), "q must have dtype float8_e4m3fn"),
    (dict(descale_q=jnp.float32(0)), "descale_q must be a positive finite number, got 0.0"),
    (dict(descale_k=jnp.full((1,), jnp.inf, jnp.float32)), "descale_k must be a positive finite number, got inf"),
])
def test_fp8_per_tensor_argument_errors(changes, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(**replace("fp8_per_tensor", **changes))


def test_metadata_errors():
    kw = inputs()
    with pytest.raises(ValueError, match="num_heads_k must be a positive Python int"):
        fm.get_mla_metadata(kw["cache_seqlens"], 4, 0)
    for num_sms in (0, True, 2.0):
        with pytest.raises(ValueError, match=f"num_sms must be a positive Python int, got {num_sms!r}"):
            fm.get_mla_metadata(kw["cache_seqlens"], 4, 1, num_sms=num_sms)
    with pytest.raises(ValueError, match="cache_seqlens must be >= 0, got min -3"):
        fm.get_mla_metadata(jnp.array([5, -3], jnp.int32), 4, 1)
    meta = fm.get_mla_metadata(jnp.array([5, 6, 7], jnp.int32), 4, 1)
    with pytest.raises(ValueError, match=r"num_splits must have shape \[3\]"):
        call(**kw, tile_scheduler_metadata=meta)
    with pytest.raises(ValueError, match="num_splits was given without tile_scheduler_metadata"):
        call(**kw, num_splits=meta.num_splits)


def test_metadata_given_as_lists_or_a_wrong_tuple():
    kw = inputs()
    meta = fm.get_mla_metadata(kw["cache_seqlens"], S_Q * H_Q // H_KV, H_KV)
    want = call(**kw, tile_scheduler_metadata=meta)
    got = call(**kw, tile_scheduler_metadata=np.asarray(meta[0]).tolist(), num_splits=np.asarray(meta[1]).tolist())
    for a, b in zip(want, got):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(ValueError, match="tile_scheduler_metadata must be an MlaMetadata .* got a tuple of 1"):
        call(**kw, tile_scheduler_metadata=(meta[0],))
    with pytest.raises(TypeError, match="cache_seqlens must have dtype int32, got int64"):
        fm.get_mla_metadata(np.asarray(kw["cache_seqlens"], np.int64), 4, 1)


def test_symbolic_shapes_are_a_clear_error():
    """jax.export's shape polymorphism: the scheduler and the kernels need static shapes."""
    (b,) = jax.export.symbolic_shape("b")
    kw = inputs()
    specs = [jax.ShapeDtypeStruct((b, S_Q, H_Q, 576), jnp.bfloat16), jax.ShapeDtypeStruct((b, MAX_PAGES), jnp.int32),
             jax.ShapeDtypeStruct((b,), jnp.int32)]
    decode = lambda q, table, seqlens: fm.flash_mla_with_kvcache(q, kw["k_cache"], table, seqlens)
    meta = lambda q, table, seqlens: fm.get_mla_metadata(seqlens, S_Q * H_Q, 1)
    for fn, name in ((decode, "q"), (meta, "cache_seqlens")):
        with pytest.raises(ValueError, match=f"{name} has a symbolic shape .* needs static shapes"):
            jax.export.export(jax.jit(fn))(*specs)


def test_metadata_of_other_lengths_reads_every_key():
    """Metadata computed for other lengths (an earlier step's, or one that split longer sequences past where they
    now end) reads every key once: each sequence's last split ends at its length, chunks past it read nothing.
    Same results as fresh metadata, eager and under jit. An edited schedule that would skip keys is an error
    outside jit."""
    kw = inputs()
    rows = S_Q * H_Q // H_KV
    lens = kw["cache_seqlens"]
    want = call(**kw, tile_scheduler_metadata=fm.get_mla_metadata(lens, rows, H_KV))
    arrays = {k: v for k, v in kw.items() if k != "kv_format"}
    step = jax.jit(lambda meta, arrays: call(**arrays, kv_format=kw["kv_format"], tile_scheduler_metadata=meta))
    for other in (lens - 1, jnp.array([4000, 5], jnp.int32), jnp.array([5, 130], jnp.int32)):
        meta = fm.get_mla_metadata(other, rows, H_KV)
        for got in (call(**kw, tile_scheduler_metadata=meta), step(meta, arrays)):
            for a, b in zip(want, got):
                np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=1e-3)
    edited = fm.get_mla_metadata(lens, rows, H_KV)
    meta = np.array(edited.tile_scheduler_metadata)
    meta[0, :5] = [2, 0, 1, 0, 0]  # partition 0 (sequence 0) dropped
    with pytest.raises(ValueError, match=r"tile_scheduler_metadata does not fit cache_seqlens\[0\] = 130"):
        call(**kw, tile_scheduler_metadata=jnp.asarray(meta), num_splits=edited.num_splits)


def test_metadata_shape_and_flashmla_style_arguments():
    kw = inputs()
    meta = fm.get_mla_metadata(kw["cache_seqlens"], S_Q * H_Q // H_KV, H_KV, num_sms=132)
    assert meta.tile_scheduler_metadata.shape == (132, 8) and meta.num_splits.shape == (B + 1,)
    assert meta.tile_scheduler_metadata.dtype == jnp.int32 and meta.num_splits.dtype == jnp.int32
    out_a, lse_a = call(**kw, tile_scheduler_metadata=meta)
    out_b, lse_b = call(**kw, tile_scheduler_metadata=meta.tile_scheduler_metadata, num_splits=meta.num_splits)
    np.testing.assert_array_equal(np.asarray(out_a, np.float32), np.asarray(out_b, np.float32))
    np.testing.assert_array_equal(lse_a, lse_b)


@pytest.mark.parametrize("kv_format", fm.KV_FORMATS)
def test_jit_matches_eager_and_reference(kv_format):
    kw = inputs(kv_format)
    kind = kw.pop("kv_format")
    scales = {k: kw.pop(k) for k in ("descale_q", "descale_k") if k in kw}
    eager = call(**kw, kv_format=kind, **scales)
    jitted = jax.jit(lambda kw, scales: call(**kw, kv_format=kind, **scales))(kw, scales)
    ref = fm.mla_decode_reference(kw["q"], kw["k_cache"], kw["block_table"], kw["cache_seqlens"],
                                  softmax_scale=576 ** -0.5, causal=False, kv_format=kind, **scales)
    for a, b in zip(eager, jitted):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    if not fm.kernel_formats():  # off-GPU the API runs the reference itself
        for a, b in zip(eager, ref):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert eager[0].shape == (B, S_Q, H_Q, 512) and eager[0].dtype == jnp.bfloat16
    assert eager[1].shape == (B, H_Q, S_Q) and eager[1].dtype == jnp.float32


def test_fp8_ds_mla_accepts_float8_view_of_the_bytes():
    kw = inputs("fp8_ds_mla")
    out_u8, _ = call(**kw)
    kw["k_cache"] = jax.lax.bitcast_convert_type(kw["k_cache"], jnp.float8_e4m3fn)
    out_f8, _ = call(**kw)
    np.testing.assert_array_equal(np.asarray(out_u8, np.float32), np.asarray(out_f8, np.float32))


def _decode_implementations(fn, *args):
    """The `implementation` parameter of every decode primitive (plain or partitioned) in fn's jaxpr."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    return [e.params["implementation"] for e in jaxpr.eqns
            if e.primitive.name.startswith("jax_flash_mla") and "decode" in e.primitive.name]


def test_reference_switch_argument_and_environment(monkeypatch):
    kw = inputs()
    kind = kw.pop("kv_format")
    assert _decode_implementations(lambda kw: call(**kw, kv_format=kind), kw) == ["auto"]
    assert _decode_implementations(lambda kw: call(**kw, kv_format=kind, implementation="reference"), kw) == [
        "reference"]
    monkeypatch.setenv(FORCE_REFERENCE_ENV, "1")
    assert _decode_implementations(lambda kw: call(**kw, kv_format=kind), kw) == ["reference"]


@pytest.mark.skipif(bool(fm.kernel_formats()), reason="a Hopper kernel is usable here")
def test_kernel_request_without_kernel_is_a_clear_error():
    with pytest.raises(ValueError, match="implementation='kernel'"):
        call(**inputs(), implementation="kernel")


def test_grad_is_a_clear_error():
    kw = inputs()
    q = kw.pop("q").astype(jnp.float32)
    with pytest.raises(NotImplementedError, match="no derivative"):
        jax.grad(lambda q: call(q=q.astype(jnp.bfloat16), **kw)[1].sum())(q)


def test_vmap_over_a_stack_of_queries():
    kw = inputs()
    qs = jnp.stack([kw["q"], -kw["q"]])
    kw.pop("q")
    outs, lses = jax.vmap(lambda q: call(q=q, **kw))(qs)
    for i in range(2):
        out, lse = call(q=qs[i], **kw)
        np.testing.assert_array_equal(np.asarray(outs[i], np.float32), np.asarray(out, np.float32))
        np.testing.assert_array_equal(lses[i], lse)


@pytest.mark.parametrize("kv_format", ["fp8_per_tensor", "fp8_ds_mla"])
def test_fp8_format_on_a_build_without_fp8_kernels_is_a_clear_error(monkeypatch, kv_format):
    """On a Hopper GPU, a JAX_FLASH_MLA_DISABLE_FP8 build refuses FP8 formats rather than silently running jnp."""
    monkeypatch.setattr(fm, "hopper_devices_only", lambda: True)
    monkeypatch.setattr(fm._ffi, "build_info", lambda: {"fp8_disabled": True})
    with pytest.raises(ValueError, match="JAX_FLASH_MLA_DISABLE_FP8"):
        call(**inputs(kv_format))
    out, _ = call(**inputs(kv_format), implementation="reference")
    assert out.shape == (B, S_Q, H_Q, 512)


def _lower_for_cuda(**kw):
    """Lowers a jitted decode for CUDA devices on this host (only lowered, never run)."""
    arrays = {k: v for k, v in kw.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in kw.items() if k not in arrays}
    return jax.export.export(jax.jit(lambda a: call(**a, **static)), platforms=("cuda",),
                             disabled_checks=fm.export_disabled_checks())(arrays)


@pytest.mark.skipif(bool(fm.kernel_formats()), reason="a Hopper kernel is usable here")
def test_cuda_lowering_without_a_kernel_warns():
    """"auto" lowered for CUDA where no kernel is usable runs the reference: a warning says so and how to silence it
    (a CPU-only build on a Hopper host must not pass for the fast path)."""
    with pytest.warns(fm.KernelFallbackWarning, match=r"pure-jnp reference.*implementation='reference'"):
        _lower_for_cuda(**inputs())


@pytest.mark.skipif(bool(fm.kernel_formats()), reason="a Hopper kernel is usable here")
def test_kernel_request_lowered_for_cuda_says_why_not():
    with pytest.raises(ValueError, match=r"implementation='kernel' but no kernel is usable here: \w"):
        _lower_for_cuda(**inputs(), implementation="kernel")


def test_chosen_or_expected_reference_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", fm.KernelFallbackWarning)
        _lower_for_cuda(**inputs(), implementation="reference")
        jax.jit(lambda q: call(**replace(q=q))[0])(inputs()["q"])  # lowered for this CPU: the reference is the path


def test_usable_kernel_does_not_warn(monkeypatch):
    if "bf16" not in _ffi.kernel_formats():
        pytest.skip("this build has no bf16 kernel (no CUDA toolkit)")
    monkeypatch.setattr(base, "hopper_devices_only", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fm.KernelFallbackWarning)
        _lower_for_cuda(**inputs())


class _FakeGpu:
    def __init__(self, compute_capability):
        self.compute_capability = compute_capability


def test_fallback_reasons(monkeypatch):
    if not _ffi.extension_available():
        assert "extension is not loaded" in base._no_kernel_reason(True)
        return
    assert "kernels only for" in base._no_kernel_reason(False)
    monkeypatch.setattr(base.jax, "devices", lambda *a: [_FakeGpu("9.0"), _FakeGpu("8.0")])
    assert "compute capability 9.0 (Hopper) on every CUDA device, found ['8.0', '9.0']" in base._no_kernel_reason(True)

    def no_cuda(*a):
        raise RuntimeError("no cuda backend")
    monkeypatch.setattr(base.jax, "devices", no_cuda)
    assert "this host has no CUDA device" in base._no_kernel_reason(True)
