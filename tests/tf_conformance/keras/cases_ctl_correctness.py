"""Cases translated from tf_keras/distribute/ctl_correctness_test.py.

A custom training loop (TF's ``tf.GradientTape`` + ``optimizer.apply_gradients``; here torch's
``loss.backward()`` and the Keras optimizer's ``apply_gradients``) trains the same DNN (with a
BatchNormalization layer, in inference mode as TF's ``model(samples)`` calls it) with and without
the strategy; weights, the mean loss and a CategoricalAccuracy metric must agree within 1e-3.
The loss is ``compute_average_loss`` over the global batch plus ``scale_regularization_loss``.
Iteration over the distributed dataset or an iterator of it, inside or outside the step function
(TF's ``tf.function``: here plain functions), as in TF. Optimizers: TF's ``optimizers_v2``
(SGD, Adagrad) on every strategy, and Adam on MultiWorkerMirrored, as TF's combinations say.
TF's ``test_fused_batch_norm_uneven_batch`` is skipped in TF (it downloads Fashion-MNIST) and not
translated.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np

import phalanx as px
from tf_conformance.keras.common import all_close, loader, replicas_agree, seed
from tf_conformance.registry import ALL, MULTI_WORKER, case

SRC = "ctl_correctness_test.py"
NUM_SAMPLES, BATCH_SIZE, NUM_EPOCHS, STEPS_PER_EPOCH = 66, 32, 2, 2
OPTIMIZERS = {
    "sgd": (lambda: keras.optimizers.SGD(0.001), ALL),
    "adagrad": (lambda: keras.optimizers.Adagrad(0.001), ALL),
    "adam": (lambda: keras.optimizers.Adam(0.001), (MULTI_WORKER,)),
}


def get_model(sync_batchnorm=False):
    return keras.Sequential(
        [
            keras.Input((1,)),
            keras.layers.Dense(10, activation="relu"),
            keras.layers.Dense(10, activation="relu", kernel_regularizer=keras.regularizers.l2(1e-4)),
            keras.layers.BatchNormalization(synchronized=True) if sync_batchnorm else keras.layers.BatchNormalization(),
            keras.layers.Dense(10, activation="relu"),
            keras.layers.Dense(1),
        ]
    )


def get_data():
    x_train = np.random.rand(NUM_SAMPLES, 1)
    y_train = 3 * x_train
    return loader(x_train.astype("float32"), y_train.astype("float32"), batch_size=BATCH_SIZE)


def compute_loss(labels, logits, reg_losses):
    pred_loss = keras.losses.mean_squared_error(labels, logits)
    scaled_loss = px.nn.compute_average_loss(pred_loss, global_batch_size=BATCH_SIZE)
    return scaled_loss + px.nn.scale_regularization_loss(sum(reg_losses))


def train(initial_weights, dataset, optimizer_fn, iteration_type, inside_func, strategy=None, sync_batchnorm=False):
    """TF's ``iteration_inside_func`` / ``iteration_outside_func``: (weights, loss, accuracy)."""
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = get_model(sync_batchnorm)
        model.set_weights(initial_weights)
        optimizer = optimizer_fn()
        training_accuracy = keras.metrics.CategoricalAccuracy("training_accuracy", dtype="float32")

    def step_fn(inputs):
        samples, labels = inputs
        logits = model(samples)
        loss = compute_loss(labels, logits, model.losses)
        model.zero_grad()
        loss.backward()
        grads = [v.value.grad for v in model.trainable_variables]
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        training_accuracy.update_state(labels, logits)
        return loss.detach()

    def train_step(x):
        if strategy is None:
            return float(step_fn(x))
        return float(strategy.reduce(px.ReduceOp.SUM, strategy.run(step_fn, args=(x,)), axis=None))

    def batches(data):
        if iteration_type == "dataset":
            yield from data
        else:
            iterator = iter(data)
            for _ in range(STEPS_PER_EPOCH):
                yield next(iterator)

    data = strategy.experimental_distribute_dataset(dataset) if strategy is not None else dataset
    if inside_func:  # TF: the loop inside a tf.function returns the last epoch's mean loss
        for _ in range(NUM_EPOCHS):
            losses = [train_step(x) for x in batches(data)]
            loss = sum(losses) / len(losses)
    else:
        losses = [train_step(x) for _ in range(NUM_EPOCHS) for x in batches(data)]
        loss = sum(losses) / len(losses)
    return model.get_weights(), loss, float(training_accuracy.result())


def dnn_correctness(strategy, optimizer_fn, iteration_type, inside_func, sync_batchnorm=False):
    seed()
    initial_weights = get_model(sync_batchnorm).get_weights()
    dataset = get_data()
    with_ds = train(initial_weights, dataset, optimizer_fn, iteration_type, inside_func, strategy, sync_batchnorm)
    replicas_agree(strategy, with_ds, "results under the strategy")
    if strategy.extended.process_index == 0:
        without = train(initial_weights, dataset, optimizer_fn, iteration_type, inside_func, None, sync_batchnorm)
        for what, got, expected in zip(("weights", "loss", "accuracy"), with_ds, without):
            all_close(got, expected, atol=1e-3, rtol=1e-3, what=what)


for _opt, (_fn, _strategies) in OPTIMIZERS.items():
    for _iteration in ("iterator", "dataset"):
        for _inside in (False, True):

            def _case(strategy, ctx, _f=_fn, _i=_iteration, _n=_inside):
                dnn_correctness(strategy, _f, _i, _n)

            _case.__name__ = f"dnn_correctness_{_opt}_{_iteration}_{'inside' if _inside else 'outside'}_func"
            case(
                f"{SRC} TestDistributionStrategyDnnCorrectness.test_dnn_correctness_minus_tpus "
                f"(optimizer {_opt}, iteration_type {_iteration}, inside_func {_inside}, sync_batchnorm False)",
                _strategies,
            )(_case)


@case(
    f"{SRC} TestDistributionStrategyDnnCorrectness.test_dnn_correctness_minus_tpus "
    "(sync_batchnorm True; SGD, by iterator and by dataset, outside the function)"
)
def dnn_correctness_sync_batchnorm(strategy, ctx):
    for iteration in ("iterator", "dataset"):
        dnn_correctness(strategy, OPTIMIZERS["sgd"][0], iteration, False, sync_batchnorm=True)
