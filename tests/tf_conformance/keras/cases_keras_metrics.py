"""Cases translated from tf_keras/distribute/keras_metrics_test.py.

Keras metrics called inside ``strategy.run`` report global results in cross-replica context.
``testMean`` gives each replica its own batch of 4 per update (TF's ``make_input_fn_iterator``:
here a distributed dataset of global batches of 4 per replica); the classification metrics are
called with the same (non-distributed) labels and predictions on every replica, so their ratios
are one device's. TF runs them on the default, OneDevice and Mirrored strategies.
"""

from __future__ import annotations

import keras
import numpy as np
import torch

from tf_conformance.keras.common import loader
from tf_conformance.registry import SINGLE_WORKER, assert_close, case

SRC = "keras_metrics_test.py"
CLS = "KerasMetricsTest"


@case(f"{SRC} {CLS}.testMean", SINGLE_WORKER)
def mean(strategy, ctx):
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        metric = keras.metrics.Mean()
    iterator = iter(
        strategy.experimental_distribute_dataset(loader(np.arange(1000, dtype=np.float32), batch_size=4 * n))
    )
    batches_consumed = 0
    for i in range(4):
        strategy.run(metric, args=(next(iterator),))
        batches_consumed += n
        # Mean(0..3) = 1.5, Mean(0..7) = 3.5, Mean(0..11) = 5.5, ...
        assert_close(float(metric.result()), batches_consumed * 2 - 0.5, f"after update #{i + 1}", tol=0.001)
        if batches_consumed >= 4:
            break


class MetricLayer(keras.layers.Layer):
    """TF's ``MetricLayer``; Keras 3 has no ``add_metric``: the layer tracks a Sum and a Mean metric."""

    def __init__(self):
        super().__init__(name="metric_layer")
        self.sum = keras.metrics.Sum(name="sum")
        self.mean = keras.metrics.Mean(name="mean")
        self.sum_var = keras.Variable(1.0)

    def call(self, inputs):
        self.sum.update_state(inputs)
        self.mean.update_state(keras.ops.mean(inputs))
        self.sum_var.assign(self.sum.result())
        return inputs


@case(f"{SRC} {CLS}.testAddMetric (jit_compile False)", SINGLE_WORKER)
def add_metric(strategy, ctx):
    with strategy.scope():
        layer = MetricLayer()

    def func():
        return layer(torch.ones(()))

    strategy.run(func)
    # TF 2.21 with Keras 3 (its tf.keras) returns sum n, mean 1.0 and sum_var 1.0: inside the
    # replica context result() is the replica's own (tf_keras's was global, so its test says n).
    assert [m.name for m in layer.metrics] == ["sum", "mean"], [m.name for m in layer.metrics]
    assert_close(float(layer.metrics[0].result()), 1.0 * ctx.n, "sum")
    assert_close(float(layer.metrics[1].result()), 1.0, "mean")
    assert_close(float(layer.sum_var.value), 1.0, "sum_var")


def _classification(name, make, label_prediction, expected):
    def fn(strategy, ctx):
        with strategy.scope():
            metric = make()
        labels, predictions = (torch.tensor(v, dtype=torch.float32) for v in label_prediction)
        strategy.run(metric, args=(labels, predictions))
        assert_close(float(metric.result()), expected, name, tol=1e-6)

    fn.__name__ = name
    return case(f"{SRC} {CLS}.test_{name}", SINGLE_WORKER)(fn)


# True positives 2, false positives 1: precision 2/3.
_classification("precision", keras.metrics.Precision, ([0, 1, 1, 1], [1, 0, 1, 1]), 0.6666667)
_classification("recall", keras.metrics.Recall, ([0, 1, 1, 1], [1, 0, 1, 1]), 0.6666667)
_classification(
    "SensitivityAtSpecificity",
    lambda: keras.metrics.SensitivityAtSpecificity(0.5),
    ([0, 0, 0, 1, 1], [0, 0.3, 0.8, 0.3, 0.8]),
    0.5,
)
_classification(
    "SpecificityAtSensitivity",
    lambda: keras.metrics.SpecificityAtSensitivity(0.5),
    ([0, 0, 0, 1, 1], [0, 0.3, 0.8, 0.3, 0.8]),
    0.66666667,
)
_classification(
    "PrecisionAtRecall",
    lambda: keras.metrics.PrecisionAtRecall(0.5),
    ([0, 0, 0, 1, 1], [0, 0.3, 0.8, 0.3, 0.8]),
    0.5,
)
_classification(
    "RecallAtPrecision", lambda: keras.metrics.RecallAtPrecision(0.8), ([0, 0, 1, 1], [0, 0.5, 0.3, 0.9]), 0.5
)
_classification("auc", lambda: keras.metrics.AUC(num_thresholds=3), ([0, 0, 1, 1], [0, 0.5, 0.3, 0.9]), 0.75)
