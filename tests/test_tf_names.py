"""The tf.distribute names a ported program reaches for, with TF's semantics (issue 16).

In process: OneDevice for the single-replica semantics; ParameterServerStrategy over the
in-process cluster (production services, in-process transport) for Keras optimizers and metrics in
scheduled functions. The multi-replica semantics are in test_tf_semantics.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import phalanx as px
from phalanx.errors import ContextError, StrategyScopeError
from phalanx.input import EmptyOptionalError, Optional, TensorSpec

os.environ.setdefault("KERAS_BACKEND", "torch")
try:
    import keras

    import phalanx.keras
except ImportError:  # pragma: no cover - the keras extra is not installed
    keras = None
# Before the per-test environment check: Keras' first random seed and torch's first optimizer
# step set environment variables of their own (see test_keras_parameter_server.py).
if keras is not None:
    keras.utils.set_random_seed(0)
    _p = torch.nn.Parameter(torch.zeros(1))
    _p.grad = torch.zeros(1)
    torch.optim.SGD([_p], lr=0.0).step()


def test_exported_dataset_classes_element_spec_and_optional():
    strategy = px.OneDeviceStrategy("cpu")
    batches = [(torch.zeros(4, 3), torch.arange(4)), (torch.ones(2, 3), torch.arange(2))]
    dist = strategy.experimental_distribute_dataset(batches)
    assert isinstance(dist, px.DistributedDataset)
    spec = (TensorSpec((None, 3), torch.float32), TensorSpec((None,), torch.int64))
    assert dist.element_spec == spec
    it = iter(dist)
    assert isinstance(it, px.DistributedIterator)
    assert it.element_spec == spec  # read ahead, then handed out by next()
    first = it.get_next_as_optional()
    assert isinstance(first, Optional) and first.has_value() and first.get_value()[0].shape == (4, 3)
    assert it.get_next()[0].shape == (2, 3)
    end = it.get_next_as_optional()
    assert not end.has_value()
    with pytest.raises(EmptyOptionalError):
        end.get_value()
    total = dist.reduce(0.0, lambda state, batch: state + float(batch[0].sum()))
    assert total == 6.0


def test_strategy_extended_library_api_single_replica():
    strategy = px.OneDeviceStrategy("cpu")
    with strategy.scope():
        layer = torch.nn.Linear(2, 1)
    ext = strategy.extended
    assert ext.variable_created_in_scope(layer.weight)
    assert not ext.variable_created_in_scope(torch.nn.Linear(2, 1).weight)
    assert ext.value_container(layer.weight) is layer.weight
    with ext.colocate_vars_with(layer.weight):
        pass
    with pytest.raises(TypeError):
        ext.colocate_vars_with("not a variable")
    value = strategy.run(lambda: torch.tensor([1.0, 2.0]))
    assert ext.reduce_to("SUM", value, destinations=layer.weight).tolist() == [1.0, 2.0]
    a, b = ext.batch_reduce_to(px.ReduceOp.MEAN, [(value, layer.weight), (value * 2, layer.bias)])
    assert a.tolist() == [1.0, 2.0] and b.tolist() == [2.0, 4.0]
    before = layer.bias.detach().clone()
    ext.update(layer.bias, lambda v, d: v.add_(d), args=(torch.ones(1),))
    assert layer.bias.detach().item() == pytest.approx(before.item() + 1)
    with pytest.raises(ContextError):
        strategy.run(lambda: ext.update(layer.bias, lambda v: v))


def test_experimental_set_strategy_is_a_program_wide_scope():
    strategy = px.OneDeviceStrategy("cpu")
    px.experimental_set_strategy(strategy)
    try:
        assert px.get_strategy() is strategy and px.has_strategy() and px.in_cross_replica_context()
        layer = torch.nn.Linear(2, 2)  # created "in scope": distributed by the strategy
        assert strategy.extended.variable_created_in_scope(layer.weight)
        with pytest.raises(StrategyScopeError), strategy.scope():
            px.experimental_set_strategy(None)
    finally:
        px.experimental_set_strategy(None)
    assert not px.has_strategy()


def test_small_tf_names():
    assert px.experimental.ValueContext(1, 2).replica_id_in_sync_group == 1
    cfg = px.experimental.TerminationConfig(grace_period=30)
    assert cfg.grace_period == 30
    assert px.RunOptions().experimental_enable_dynamic_batch_size
    assert px.coordinator.PerWorkerValue is px.coordinator.PerWorkerValues
    assert px.experimental.coordinator.PerWorkerValues is px.coordinator.PerWorkerValues
    strategy = px.OneDeviceStrategy("cpu")
    out = strategy.run(lambda: torch.ones(1), options=px.RunOptions())
    assert out.tolist() == [1.0]
    with pytest.raises(RuntimeError, match="inside a function given to"):
        px.coordinator.experimental_get_current_worker_index()


# ------------------------------------------------------------------ Keras in scheduled functions
def _keras():
    pytest.importorskip("cloudpickle")
    if keras is None:
        pytest.skip("keras is not installed")
    return keras


def test_keras_optimizer_in_a_scheduled_function_updates_the_parameter_servers():
    """The parameter-server tutorial's custom loop: a Keras optimizer's apply_gradients on a worker."""
    keras = _keras()
    from phalanx.ps.testing import InProcessCluster

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype("float32")
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], dtype="float32")).reshape(-1, 1)
    with InProcessCluster(num_ps=2, num_workers=2) as cluster:
        strategy = cluster.strategy
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            optimizer = keras.optimizers.SGD(learning_rate=0.1)
        coordinator = cluster.coordinator()

        def step(xb, yb):
            def replica_fn(xb, yb):
                loss = torch.mean((model(xb) - yb) ** 2)
                model.zero_grad()
                loss.backward()
                optimizer.apply_gradients(
                    zip([v.value.grad for v in model.trainable_variables], model.trainable_variables)
                )
                return loss

            return strategy.run(replica_fn, args=(xb, yb))

        def loss_now():
            coordinator.join()
            with torch.no_grad():
                return float(torch.mean((model(torch.as_tensor(x)) - torch.as_tensor(y)) ** 2))

        first = loss_now()
        for i in range(40):
            j = (i * 32) % 256
            coordinator.schedule(step, args=(torch.as_tensor(x[j : j + 32]), torch.as_tensor(y[j : j + 32])))
        last = loss_now()
        assert last < 0.2 * first, (first, last)
        assert sum(s["updates"] for s in strategy.extended.parameter_server_stats()) > 0
        coordinator.shutdown()


def test_keras_metric_in_scheduled_functions_counts_on_the_parameter_servers():
    """The parameter-server tutorial's accuracy metric: updated on the workers, read on the chief."""
    keras = _keras()
    from phalanx.ps.testing import InProcessCluster

    with InProcessCluster(num_ps=2, num_workers=2) as cluster:
        with cluster.strategy.scope():
            accuracy = keras.metrics.Accuracy()
            seen = keras.metrics.Sum()
        coordinator = cluster.coordinator()

        def step(labels, pred):
            accuracy.update_state(labels, pred)
            seen.update_state(float(len(labels)))

        for _ in range(10):  # 10 batches of 4: 3 of each 4 right
            coordinator.schedule(step, args=(torch.tensor([1, 1, 0, 0]), torch.tensor([1, 1, 0, 1])))
        coordinator.join()
        assert float(seen.result()) == 40.0
        assert float(accuracy.result()) == pytest.approx(0.75)
        accuracy.reset_state()
        coordinator.schedule(step, args=(torch.tensor([1]), torch.tensor([1])))
        coordinator.join()
        assert float(accuracy.result()) == 1.0  # the chief's reset reached the servers first
        coordinator.shutdown()
