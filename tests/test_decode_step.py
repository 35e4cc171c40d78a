"""examples/decode_step.py on 8 CPU devices: sharded serving steps match an unsharded reference run, and the jitted
step updates the donated cache in place."""

import dataclasses
import importlib.util
import pathlib
import re
import sys

import jax
import numpy as np
import pytest

from jax_flash_mla import hlo

CPUS = jax.devices("cpu")
pytestmark = pytest.mark.skipif(len(CPUS) < 8, reason="needs 8 CPU devices (tests/conftest.py sets XLA_FLAGS)")

_spec = importlib.util.spec_from_file_location(
    "decode_step", pathlib.Path(__file__).resolve().parents[1] / "examples" / "decode_step.py")
ds = sys.modules["decode_step"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ds)

SMALL = dict(layers=2, hidden=128, heads=4, q_rank=64, nope_dim=32, v_dim=32, vocab=256, batch=8, max_len=192)
STEPS = 3


def run_teacher_forced(cfg, token_inputs):
    """Runs the jitted step on cfg's mesh feeding the given tokens; returns the logits and lengths of each step."""
    step, params, (cache, table, lengths, tokens) = ds.build(cfg, CPUS)
    out = []
    for fed in token_inputs:
        cache, lengths, _, logits = step(params, cache, table, lengths, jax.device_put(fed, tokens.sharding))
        out.append((np.asarray(logits), np.asarray(lengths)))
    return out


@pytest.mark.parametrize("strategy, data, model, kv_format, tokens_per_step", [
    ("heads", 1, 2, "bf16", 2),
    ("batch", 4, 1, "bf16", 1),
    ("2d", 4, 2, "bf16", 2),
    ("2d", 4, 2, "fp8_per_tensor", 1),
    ("2d", 4, 2, "fp8_ds_mla", 1),
])
def test_sharded_steps_match_an_unsharded_reference_run(strategy, data, model, kv_format, tokens_per_step):
    cfg = ds.Config(**SMALL, kv_format=kv_format, tokens_per_step=tokens_per_step, strategy=strategy, data=data,
                    model=model)
    # Same cache layout (one page pool per data shard) with global block ids, one device, the jnp reference.
    ref_cfg = dataclasses.replace(cfg, strategy="none", data=1, model=1, page_pools=cfg.pools,
                                  implementation="reference")
    want, _ = ds.run(ref_cfg, STEPS, devices=CPUS)
    first_tokens = ds.init_state(cfg, jax.random.key(1))[4]  # build() seeds the state with key(seed + 1)
    # Teacher forcing: both runs see the reference's tokens, so a near-tie argmax cannot make them diverge.
    fed = [first_tokens] + [tokens for _, tokens, _ in want[:-1]]
    got = run_teacher_forced(cfg, fed)
    for (logits, lengths), (ref_logits, ref_tokens, ref_lengths) in zip(got, want):
        np.testing.assert_array_equal(lengths, ref_lengths)
        # bf16 rounding of the attention output may differ by an ulp between batch-2 and batch-8 shapes.
        np.testing.assert_allclose(logits, ref_logits, rtol=2e-2, atol=2e-2)
        top2 = np.sort(ref_logits, axis=-1)[..., -2:]
        clear = top2[..., 1] - top2[..., 0] > 0.05
        np.testing.assert_array_equal(np.argmax(logits, -1)[clear], ref_tokens[clear])


def compile_step(cfg, donate=True):
    step, params, state = ds.build(cfg, CPUS, donate=donate)
    return step.lower(params, *state).compile().as_text(), state[0].sharding.shard_shape(state[0].shape)


def cache_updated_in_place(text: str, shape) -> bool:
    """The cache parameter is aliased to an output and nothing copies a whole cache."""
    return hlo.params_aliased(text, shape) and not {"copy", "copy-start"} & hlo.ops_producing(text, shape)


@pytest.mark.parametrize("strategy, data, model", [("none", 1, 1), ("batch", 4, 1), ("2d", 4, 2)])
def test_donated_cache_is_updated_in_place(strategy, data, model):
    cfg = ds.Config(**SMALL, kv_format="fp8_ds_mla", strategy=strategy, data=data, model=model)
    text, shape = compile_step(cfg)
    assert cache_updated_in_place(text, shape)
    # Strictly in place: the scan-carried cache is only scattered into (no convert round trip, no copy).
    assert hlo.ops_producing(text, shape) <= {"parameter", "get-tuple-element", "fusion", "scatter"}
    undonated, shape = compile_step(cfg, donate=False)
    assert not cache_updated_in_place(undonated, shape)  # the check fails without donation: XLA copies the cache
    assert "copy" in hlo.ops_producing(undonated, shape)


def test_communication_is_only_the_tensor_parallel_all_reduce():
    for strategy, data, model, allowed in [("batch", 4, 1, set()), ("heads", 1, 2, {"all-reduce"}),
                                           ("2d", 4, 2, {"all-reduce"})]:
        text, _ = compile_step(ds.Config(**SMALL, strategy=strategy, data=data, model=model))
        assert set(hlo.collectives_in(text)) <= allowed, strategy


def test_main_prints_a_table(capsys):
    ds.main(["--strategy", "2d", "--steps", "2", "--layers", "1", "--heads", "4", "--batch", "8"])
    out = capsys.readouterr().out
    assert "strategy 2d on mesh data=4 x model=2" in out
    assert len([line for line in out.splitlines() if re.match(r"\s+\d+\s+\d+\.\d+", line)]) == 2
