"""jax.export of decode steps: what serving stacks that ship serialized StableHLO need (README, "Exporting").

- Where no kernel is usable the step exports as plain StableHLO (the jnp reference), and the serialized module gives
  bit for bit what jit gives.
- Lowered with the kernels, the module holds the scheduler's and the format's FFI custom calls: jax.export refuses
  them unless `export_disabled_checks()` exempts them. The lowering for CUDA runs here on the CPU, with the
  "all devices are Hopper" test patched to true (the module is only lowered and serialized, never run);
  tests/test_decode_gpu.py runs an exported kernel module on the H200.
- A sharded step exports through jax.shard_map (custom_partitioning, which jit's sharding rules use, does not
  serialize), with the same results as the same step under jit.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_flash_mla as fm
from jax_flash_mla import _ffi
from jax_flash_mla.primitives import base

from oracle import SOFTMAX_SCALE, make_decode_inputs

pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers (the [test] extra has it)")

CPUS = jax.devices("cpu")
B, S_Q, H_Q = 2, 2, 16


def _inputs(kv_format, h_kv=1):
    rng = np.random.default_rng(11)
    return make_decode_inputs(rng, b=B, s_q=S_Q, h_q=H_Q, h_kv=h_kv, seqlens=np.array([130, 5], np.int32),
                              kv_format=kv_format)


def _step(inp, **extra):
    """The decode step as a serving loop writes it: metadata and attention in one jitted function."""
    _, kwargs = inp.kernel_args()

    def step(q, k_cache, block_table, cache_seqlens):
        h_kv = k_cache.shape[2]
        meta = fm.get_mla_metadata(cache_seqlens, S_Q * q.shape[2] // h_kv, h_kv, **extra)
        return fm.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, meta,
                                         softmax_scale=SOFTMAX_SCALE, causal=True, **kwargs, **extra)
    return step


def _custom_calls(exported) -> set:
    return set(re.findall(r"custom_call @(\w+)", exported.mlir_module()))


def _round_trip(exported):
    return jax.export.deserialize(exported.serialize())


@pytest.mark.parametrize("kv_format", fm.KV_FORMATS)
def test_reference_step_round_trips_bit_for_bit(kv_format):
    inp = _inputs(kv_format)
    args, _ = inp.kernel_args()
    step = jax.jit(_step(inp, implementation="reference"))
    exported = jax.export.export(step, platforms=("cpu",))(*args)
    assert not _custom_calls(exported) & set(_ffi.all_targets())
    for got, want in zip(_round_trip(exported).call(*args), step(*args)):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


@pytest.fixture
def kernels_lowered(monkeypatch):
    """The CUDA lowering takes the kernel path as on a Hopper host (this machine only lowers, never runs it)."""
    monkeypatch.setattr(base, "hopper_devices_only", lambda: True)


@pytest.mark.parametrize("kv_format", fm.KV_FORMATS)
def test_kernel_step_exports_with_the_exemptions(kv_format, kernels_lowered):
    if kv_format not in _ffi.kernel_formats():
        pytest.skip(f"this build has no {kv_format} kernel (no CUDA toolkit, or JAX_FLASH_MLA_DISABLE_FP8)")
    inp = _inputs(kv_format)
    args, _ = inp.kernel_args()
    step = jax.jit(_step(inp))  # "auto": the kernels on CUDA (patched usable), the reference elsewhere
    with pytest.raises(ValueError, match="custom calls whose targets have no compatibility guarantees"):
        jax.export.export(step, platforms=("cuda",))(*args)
    # One module for both platforms: the kernels on CUDA, the jnp reference on the CPU, which runs it here.
    exported = jax.export.export(step, platforms=("cpu", "cuda"), disabled_checks=fm.export_disabled_checks())(*args)
    assert _custom_calls(exported) >= {_ffi.TARGET_SCHED_META, _ffi.decode_target(kv_format)}
    restored = _round_trip(exported)
    assert restored.platforms == ("cpu", "cuda")
    assert [a.shape for a in restored.out_avals] == [(B, S_Q, H_Q, 512), (B, H_Q, S_Q)]
    reference_step = jax.jit(_step(inp, implementation="reference"))
    for got, want in zip(restored.call(*args), reference_step(*args)):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


def _head_sharded(inp, mesh, **extra):
    """The step of _step on each device's heads (h_kv 1: the cache, block table and lengths replicated)."""
    return jax.jit(jax.shard_map(_step(inp, **extra), mesh=mesh, in_specs=(P(None, None, "model"), P(), P(), P()),
                                 out_specs=(P(None, None, "model"), P(None, "model"))))


@pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 CPU devices (tests/conftest.py asks XLA for 8)")
@pytest.mark.parametrize("kv_format", fm.KV_FORMATS)
def test_head_sharded_step_exports_through_shard_map(kv_format):
    inp = _inputs(kv_format)
    mesh = Mesh(np.array(CPUS[:2]), ("model",))
    specs = (P(None, None, "model"), P(), P(), P())
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(inp.kernel_args()[0], specs)]
    step = _head_sharded(inp, mesh)
    exported = jax.export.export(step)(*args)
    assert exported.nr_devices == 2
    restored = _round_trip(exported)
    for got, want in zip(jax.jit(restored.call)(*args), step(*args)):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


@pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 CPU devices (tests/conftest.py asks XLA for 8)")
def test_head_sharded_kernel_step_has_no_partitioning_callback(kernels_lowered):
    if "bf16" not in _ffi.kernel_formats():
        pytest.skip("this build has no bf16 kernel (no CUDA toolkit)")
    inp = _inputs("bf16")
    args, _ = inp.kernel_args()
    mesh = Mesh(np.array(CPUS[:2]), ("model",))
    exported = jax.export.export(_head_sharded(inp, mesh, implementation="kernel"), platforms=("cuda",),
                                 disabled_checks=fm.export_disabled_checks())(*args)
    calls = _custom_calls(exported)
    assert _ffi.decode_target("bf16") in calls
    assert not any("SPMD" in c or "callback" in c.lower() for c in calls), calls
    _round_trip(exported)


@pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 CPU devices (tests/conftest.py asks XLA for 8)")
def test_jit_partitioned_steps_refuse_export_with_the_way_out():
    """Partitioned by jit through the sharding rules, decode and cache write cannot be serialized: the error names
    the op and jax.shard_map (not JAX's NotImplementedError about host callbacks)."""
    inp = _inputs("bf16")
    mesh = Mesh(np.array(CPUS[:2]), ("model",))
    specs = (P(None, None, "model"), P(), P(), P())
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(inp.kernel_args()[0], specs)]
    with pytest.raises(ValueError, match=r"flash_mla_with_kvcache: jax\.export .* jax\.shard_map"):
        jax.export.export(jax.jit(_step(inp)))(*args)

    cache = args[1]
    new_kv = jax.device_put(jnp.ones((B, 1, 1, 576), jnp.bfloat16), NamedSharding(mesh, P()))
    positions = jnp.array([[130], [5]], jnp.int32)
    write = jax.jit(lambda c, n, t, p: fm.write_kv_cache(c, n, t, p, "bf16"))
    with pytest.raises(ValueError, match=r"write_kv_cache: jax\.export .* jax\.shard_map"):
        jax.export.export(write)(cache, new_kv, args[2], positions)
