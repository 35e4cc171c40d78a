"""scripts/model_pair_orders.py, the discrete-event model of bf16's page-pair protocol: main's order and experiment
fmo's (FlashMLA's hand-off order) pass its checks over odd, even, lone-page and empty chunks, and every broken
protocol in its list is caught, so the checks can fail."""

import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "model_pair_orders.py"
_spec = importlib.util.spec_from_file_location("model_pair_orders", _PATH)
model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(model)


@pytest.mark.parametrize("order", ["main", "fmo"])
@pytest.mark.parametrize("chunks", model.CHUNK_SETS, ids=lambda c: "-".join(map(str, c)))
def test_protocol_holds(order, chunks):
    for seed in range(20):
        model.Sim(chunks, order, seed).run()


@pytest.mark.parametrize("order, mutation", model.MUTATIONS, ids=[m for _, m in model.MUTATIONS])
def test_broken_protocol_is_caught(order, mutation):
    assert model.mutation_caught(order, mutation, seeds=20) > 0

