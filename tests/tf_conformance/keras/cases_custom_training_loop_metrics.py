"""Cases translated from tf_keras/distribute/custom_training_loop_metrics_test.py.

Keras metrics updated inside ``strategy.run`` (created in the scope, or outside it and updated in
cross-replica context) report the global result: the mean of 0..9 is 4.5 however the replicas
split the batches, and when every replica sees the same (non-distributed) batch.
"""

from __future__ import annotations

import keras
import numpy as np
import torch

from tf_conformance.keras.common import loader
from tf_conformance.registry import SINGLE_WORKER, assert_close, case

SRC = "custom_training_loop_metrics_test.py"
CLS = "KerasMetricsTest"


@case(f"{SRC} {CLS}.test_multiple_keras_metrics_experimental_run")
def multiple_keras_metrics_experimental_run(strategy, ctx):
    with strategy.scope():
        loss_metric = keras.metrics.Mean("loss", dtype="float32")
        loss_metric_2 = keras.metrics.Mean("loss_2", dtype="float32")

    def step_fn():
        loss = torch.tensor(5.0)
        loss_metric.update_state(loss)
        loss_metric_2.update_state(loss)

    strategy.run(step_fn)
    assert_close(float(loss_metric.result()), float(loss_metric_2.result()))
    assert_close(float(loss_metric.result()), 5.0)


@case(f"{SRC} {CLS}.test_update_keras_metric_declared_in_strategy_scope")
def update_keras_metric_declared_in_strategy_scope(strategy, ctx):
    with strategy.scope():
        metric = keras.metrics.Mean("test_metric", dtype="float32")
    dataset = strategy.experimental_distribute_dataset(loader(np.arange(10), batch_size=2))

    def step_fn(i):
        metric.update_state(i)

    for i in dataset:
        strategy.run(step_fn, args=(i,))
    # The mean of 0..9: a sum of 45 over a count of 10.
    assert_close(float(metric.result()), 4.5)


@case(f"{SRC} {CLS}.test_update_keras_metric_outside_strategy_scope_cross_replica", SINGLE_WORKER)
def update_keras_metric_outside_strategy_scope_cross_replica(strategy, ctx):
    metric = keras.metrics.Mean("test_metric", dtype="float32")
    with strategy.scope():
        for i in range(10):
            metric.update_state(i)
    assert_close(float(metric.result()), 4.5)


@case(f"{SRC} {CLS}.test_update_keras_metrics_dynamic_shape", SINGLE_WORKER)
def update_keras_metrics_dynamic_shape(strategy, ctx):
    with strategy.scope():
        metric = keras.metrics.Mean("test_metric", dtype="float32")
    weights = torch.tensor([0.1, 0.1])

    def step_fn(i):
        metric.update_state(i, weights)

    # Not distributed: every replica gets each whole batch.
    for i in loader(np.arange(10), batch_size=2):
        strategy.run(step_fn, args=(i,))
    assert_close(float(metric.result()), 4.5)
