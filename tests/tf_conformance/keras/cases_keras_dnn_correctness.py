"""Cases translated from tf_keras/distribute/keras_dnn_correctness_test.py.

A small DNN (Sequential, and the same network subclassed) trained with and without the strategy:
numpy arrays or DataLoaders, with or without ``validation_data``, with a partial last batch in
evaluation or in training too, and with a learning rate a callback changes every batch; then the
metric tests (``BinaryAccuracy`` in ``fit``; ``accuracy`` and ``BinaryAccuracy`` in ``evaluate``).
TF's ``gradient_descent_keras.SGD`` is ``keras.optimizers.SGD``; TF's v1 ``GradientDescentOptimizer``
too.
"""

from __future__ import annotations

import keras
import numpy as np

from tf_conformance.keras import correctness
from tf_conformance.keras.common import all_close, loader, maybe_scope, replicas_agree, seed
from tf_conformance.registry import case

SRC = "keras_dnn_correctness_test.py"
INPUTS = [(True, True), (True, False), (False, True), (False, False)]  # (use_numpy, use_validation_data)


def _input_name(use_numpy: bool, use_validation_data: bool) -> str:
    return ("numpy" if use_numpy else "dataset") + ("_validation" if use_validation_data else "")


def _compile(model):
    model.compile(loss=keras.losses.mean_squared_error, optimizer=keras.optimizers.SGD(0.05), metrics=["mse"])
    return model


def get_model(initial_weights=None, distribution=None):
    """TF's ``TestDistributionStrategyDnnCorrectness.get_model``."""
    with maybe_scope(distribution):
        model = keras.Sequential(
            [
                keras.Input((1,)),
                keras.layers.Dense(10, activation="relu"),
                keras.layers.Dense(10, activation="relu", kernel_regularizer=keras.regularizers.l2(1e-4)),
                keras.layers.Dense(10, activation="relu"),
                keras.layers.Dense(1),
            ]
        )
        if initial_weights:
            model.set_weights(initial_weights)
        return _compile(model)


class SubclassedModel(keras.Model):
    """TF's ``SubclassedModel``: the DNN's layers, built in the constructor."""

    def __init__(self, initial_weights):
        super().__init__()
        self.dense1 = keras.layers.Dense(10, activation="relu")
        self.dense2 = keras.layers.Dense(10, activation="relu", kernel_regularizer=keras.regularizers.l2(1e-4))
        self.dense3 = keras.layers.Dense(10, activation="relu")
        self.dense4 = keras.layers.Dense(1)
        self(np.zeros((1, 1), "float32"))  # TF's self.build((None, 1)): Keras 3 builds a subclassed model by a call
        if initial_weights:
            self.set_weights(initial_weights)

    def call(self, inputs):
        return self.dense4(self.dense3(self.dense2(self.dense1(inputs))))


def get_subclassed_model(initial_weights=None, distribution=None):
    """TF's ``TestDistributionStrategyDnnCorrectnessWithSubclassedModel.get_model``."""
    with maybe_scope(distribution):
        return _compile(SubclassedModel(initial_weights))


N_TRAIN = 2 * correctness.GLOBAL_BATCH_SIZE  # TF's 9,984: whole batches only
N_PARTIAL = N_TRAIN + 16  # TF's 10,000: a last batch of 16


def get_data():
    x_train = np.random.rand(N_TRAIN, 1).astype("float32")
    return x_train, 3 * x_train, np.array([[1.0], [2.0], [3.0], [4.0]], dtype=np.float32)


def get_data_with_partial_last_batch():
    x_train = np.random.rand(N_PARTIAL, 1).astype("float32")
    x_eval = np.random.rand(N_PARTIAL, 1).astype("float32")
    return x_train, 3 * x_train, x_eval, 3 * x_eval, np.array([[1.0], [2.0], [3.0], [4.0]], dtype=np.float32)


def get_data_with_partial_last_batch_eval():
    x_train = np.random.rand(N_TRAIN, 1).astype("float32")
    x_eval = np.random.rand(N_PARTIAL, 1).astype("float32")
    return x_train, 3 * x_train, x_eval, 3 * x_eval, np.array([[1.0], [2.0], [3.0], [4.0]], dtype=np.float32)


def _register(cls: str, model_fn, prefix: str) -> None:
    for use_numpy, use_validation in INPUTS:
        suffix = _input_name(use_numpy, use_validation)

        def correctness_case(strategy, ctx, _n=use_numpy, _v=use_validation):
            correctness.run_correctness_test(strategy, model_fn, get_data, _n, _v)

        correctness_case.__name__ = f"{prefix}correctness_{suffix}"
        case(f"{SRC} {cls}.test_dnn_correctness (use_numpy, use_validation_data = {use_numpy}, {use_validation})")(
            correctness_case
        )

        def partial_case(strategy, ctx, _n=use_numpy, _v=use_validation):
            # TF: experimental_enable_get_next_as_optional, one epoch, a partial last batch in
            # training and evaluation (tolerance 1e-3, the loss of evaluate not compared).
            correctness.run_correctness_test(
                strategy,
                model_fn,
                get_data_with_partial_last_batch,
                _n,
                _v,
                partial_last_batch="train_and_eval",
                training_epochs=1,
            )

        partial_case.__name__ = f"{prefix}correctness_with_partial_last_batch_{suffix}"
        case(
            f"{SRC} {cls}.test_dnn_correctness_with_partial_last_batch "
            f"(use_numpy, use_validation_data = {use_numpy}, {use_validation})"
        )(partial_case)


_register("TestDistributionStrategyDnnCorrectness", get_model, "dnn_")
_register("TestDistributionStrategyDnnCorrectnessWithSubclassedModel", get_subclassed_model, "subclassed_dnn_")

for _numpy, _validation in INPUTS:

    def _partial_eval(strategy, ctx, _n=_numpy, _v=_validation):
        correctness.run_correctness_test(
            strategy, get_model, get_data_with_partial_last_batch_eval, _n, _v, partial_last_batch="eval"
        )

    _partial_eval.__name__ = f"dnn_correctness_with_partial_last_batch_eval_{_input_name(_numpy, _validation)}"
    case(
        f"{SRC} TestDistributionStrategyDnnCorrectness.test_dnn_correctness_with_partial_last_batch_eval "
        f"(use_numpy, use_validation_data = {_numpy}, {_validation}; TF runs it on MultiWorkerMirrored and TPU)"
    )(_partial_eval)


class LearningRateBatchScheduler(keras.callbacks.Callback):
    """TF's ``LearningRateBatchScheduler``: sets the learning rate at each batch's beginning."""

    def on_batch_begin(self, batch, logs=None):
        self.model.optimizer.learning_rate.assign(0.001 * (batch % 10))


def _dynamic_lr(strategy, model_fn):
    """TF's ``run_dynamic_lr_test``."""
    seed()
    x_train, y_train, _ = get_data()
    initial_weights = model_fn().get_weights()
    results = []
    for distribution in (strategy, None) if strategy.extended.process_index == 0 else (strategy,):
        inputs = (
            {
                "x": x_train,
                "y": y_train,
                "batch_size": correctness.GLOBAL_BATCH_SIZE,
                "shuffle": False,
                "epochs": 2,
                "callbacks": [LearningRateBatchScheduler()],
                "validation_data": (x_train, y_train),
            },
            None,
            {"x": x_train[:4]},
        )
        results.append(correctness.fit_eval_and_predict(initial_weights, inputs, model_fn, distribution))
        if distribution is not None:
            replicas_agree(strategy, results[0], "results under the strategy")
    if len(results) == 2:
        correctness.compare_results(results[0], results[1])


@case(f"{SRC} TestDistributionStrategyDnnCorrectness.test_dnn_with_dynamic_learning_rate")
def dnn_with_dynamic_learning_rate(strategy, ctx):
    _dynamic_lr(strategy, get_model)


@case(f"{SRC} TestDistributionStrategyDnnCorrectnessWithSubclassedModel.test_dnn_with_dynamic_learning_rate")
def subclassed_dnn_with_dynamic_learning_rate(strategy, ctx):
    # TF 2 runs it eagerly (graph mode refused subclassed models under a strategy).
    _dynamic_lr(strategy, get_subclassed_model)


@case(f"{SRC} TestDistributionStrategyDnnMetricCorrectness.test_simple_dnn_metric_correctness")
def simple_dnn_metric_correctness(strategy, ctx):
    seed()
    num_samples = 10 * correctness.GLOBAL_BATCH_SIZE  # TF: 10,000 rows, 10 steps per epoch
    x_train = np.reshape(np.random.randint(0, 2, num_samples), (num_samples, 1)).astype("float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="ones")])
        model.compile(
            loss=keras.losses.mean_squared_error,
            optimizer=keras.optimizers.SGD(0.05),
            metrics=[keras.metrics.BinaryAccuracy()],
        )
    history = model.fit(
        x=loader(x_train, x_train, batch_size=correctness.GLOBAL_BATCH_SIZE), epochs=2, steps_per_epoch=10, verbose=0
    )
    assert history.history["binary_accuracy"] == [1.0, 1.0], history.history


@case(f"{SRC} TestDistributionStrategyDnnMetricEvalCorrectness.test_identity_model_metric_eval_correctness")
def identity_model_metric_eval_correctness(strategy, ctx):
    seed()
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(3, activation="relu", kernel_initializer="ones"),
                keras.layers.Dense(1, activation="sigmoid", kernel_initializer="ones"),
            ]
        )
        model.compile(loss="mae", metrics=["accuracy", keras.metrics.BinaryAccuracy()], optimizer="sgd")
    x = np.ones((40, 4)).astype("float32")  # TF: 100 rows repeated, 10 steps of 4
    outs = model.evaluate(loader(x, np.ones((40, 1), "float32"), batch_size=4), steps=10, verbose=0)
    all_close(outs[1:], [1.0, 1.0], 0, 0, "ones")
    outs = model.evaluate(loader(x, np.zeros((40, 1), "float32"), batch_size=4), steps=10, verbose=0)
    all_close(outs[1:], [0.0, 0.0], 0, 0, "zeros")
