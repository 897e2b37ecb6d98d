"""Cases translated from tf_keras/distribute/keras_image_model_correctness_test.py.

A small CNN (Conv2D with L2, optional BatchNormalization, MaxPooling, softmax) trained with and
without the strategy. With plain BatchNormalization each replica normalises its own part of the
batch, so on more than one replica the results must differ from one device's (TF's
``assertRaises(AssertionError)``) and on one replica they must match. TF's 1,280 training images
are 128 here and its 1,000 evaluation images (a partial last batch) 100.
"""

from __future__ import annotations

import keras
import numpy as np

from tf_conformance.keras import correctness
from tf_conformance.keras.common import maybe_scope
from tf_conformance.registry import case

SRC = "keras_image_model_correctness_test.py"
CLS = "DistributionStrategyCnnCorrectnessTest"
INPUTS = [(True, True), (True, False), (False, True), (False, False)]


def _name(use_numpy: bool, use_validation_data: bool) -> str:
    return ("numpy" if use_numpy else "dataset") + ("_validation" if use_validation_data else "")


def cnn_model(with_batch_norm: str | None):
    def get_model(initial_weights=None, distribution=None):
        with maybe_scope(distribution):
            image = keras.Input(shape=(28, 28, 3), name="image")
            c1 = keras.layers.Conv2D(
                name="conv1",
                filters=16,
                kernel_size=(3, 3),
                strides=(4, 4),
                kernel_regularizer=keras.regularizers.l2(1e-4),
            )(image)
            if with_batch_norm == "regular":
                c1 = keras.layers.BatchNormalization(name="bn1")(c1)
            elif with_batch_norm == "sync":
                # TF: two parallel synchronized batch norms, to check that the all-reduce works.
                bn1 = keras.layers.BatchNormalization(name="bn1", synchronized=True)(c1)
                bn2 = keras.layers.BatchNormalization(name="bn2", synchronized=True)(c1)
                c1 = keras.layers.Add()([bn1, bn2])
            c1 = keras.layers.MaxPooling2D(pool_size=(2, 2))(c1)
            logits = keras.layers.Dense(10, activation="softmax", name="pred")(keras.layers.Flatten()(c1))
            model = keras.Model(inputs=[image], outputs=[logits])
            if initial_weights:
                model.set_weights(initial_weights)
            model.compile(
                optimizer=keras.optimizers.SGD(learning_rate=0.1),
                loss="sparse_categorical_crossentropy",
                metrics=["sparse_categorical_accuracy"],
            )
        return model

    return get_model


def _images(count, shape=(28, 28, 3), num_classes=10):
    centers = np.random.randn(num_classes, *shape)
    labels = np.random.randint(0, num_classes, size=count)
    offsets = np.random.normal(loc=0, scale=0.1, size=(count, *shape))
    return (centers[labels] + offsets).astype(np.float32), labels.astype(np.float32).reshape((count, 1))


def get_data():
    x_train, y_train = _images(correctness.GLOBAL_BATCH_SIZE * correctness.EVAL_STEPS)
    return x_train, y_train, x_train


def get_data_with_partial_last_batch_eval():
    x_train, y_train = _images(128)
    x_eval, y_eval = _images(100)
    return x_train, y_train, x_eval, y_eval, x_eval


for _numpy, _validation in INPUTS:
    _suffix = _name(_numpy, _validation)
    _params = f"(use_numpy, use_validation_data = {_numpy}, {_validation})"

    def _cnn(strategy, ctx, _n=_numpy, _v=_validation):
        correctness.run_correctness_test(strategy, cnn_model(None), get_data, _n, _v)

    _cnn.__name__ = f"cnn_correctness_{_suffix}"
    case(f"{SRC} {CLS}.test_cnn_correctness {_params}")(_cnn)

    def _bn(strategy, ctx, _n=_numpy, _v=_validation):
        correctness.run_correctness_test(strategy, cnn_model("regular"), get_data, _n, _v, with_batch_norm="regular")

    _bn.__name__ = f"cnn_with_batch_norm_correctness_{_suffix}"
    case(f"{SRC} {CLS}.test_cnn_with_batch_norm_correctness {_params}")(_bn)

    def _partial(strategy, ctx, _n=_numpy, _v=_validation):
        # TF passes partial_last_batch=True: compared as "eval" (the loss of evaluate left out).
        correctness.run_correctness_test(
            strategy, cnn_model(None), get_data_with_partial_last_batch_eval, _n, _v, partial_last_batch="eval",
            training_epochs=1,
        )  # fmt: skip

    _partial.__name__ = f"cnn_correctness_with_partial_last_batch_eval_{_suffix}"
    case(f"{SRC} {CLS}.test_cnn_correctness_with_partial_last_batch_eval {_params}")(_partial)

    def _bn_partial(strategy, ctx, _n=_numpy, _v=_validation):
        correctness.run_correctness_test(
            strategy, cnn_model("regular"), get_data_with_partial_last_batch_eval, _n, _v, with_batch_norm="regular",
            partial_last_batch="eval",
        )  # fmt: skip

    _bn_partial.__name__ = f"cnn_with_batch_norm_correctness_and_partial_last_batch_eval_{_suffix}"
    case(f"{SRC} {CLS}.test_cnn_with_batch_norm_correctness_and_partial_last_batch_eval {_params}")(_bn_partial)


@case(f"{SRC} {CLS}.test_cnn_with_sync_batch_norm_correctness (the four input configurations)")
def cnn_with_sync_batch_norm_correctness(strategy, ctx):
    for use_numpy, use_validation in INPUTS:
        correctness.run_correctness_test(
            strategy, cnn_model("sync"), get_data, use_numpy, use_validation, with_batch_norm="sync"
        )
