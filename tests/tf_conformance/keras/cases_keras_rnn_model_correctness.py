"""Cases translated from tf_keras/distribute/keras_rnn_model_correctness_test.py and
keras_stateful_lstm_model_correctness_test.py.

An Embedding + GRU / LSTM classifier trained with and without the strategy (numpy arrays and
DataLoaders, with and without ``validation_data``), the LSTM also under the ``mixed_float16`` policy
(TF skips CentralStorage there: "CentralStorageStrategy is not supported by mixed precision"); and a
stateful LSTM, which tf_keras refuses under a strategy with more than one replica ("Stateful RNNs
... are not yet supported with tf.distribute.Strategy").
"""

from __future__ import annotations

import keras

from tf_conformance.keras import correctness
from tf_conformance.keras.common import maybe_scope
from tf_conformance.registry import MIRRORED, MULTI, MULTI_WORKER, ONE_DEVICE, case, raises

SRC = "keras_rnn_model_correctness_test.py"
INPUTS = [(True, True), (True, False), (False, True), (False, False)]


def _name(use_numpy: bool, use_validation_data: bool) -> str:
    return ("numpy" if use_numpy else "dataset") + ("_validation" if use_validation_data else "")


def rnn_model(rnn_cls):
    def get_model(initial_weights=None, distribution=None, max_words=10):
        with maybe_scope(distribution):
            word_ids = keras.Input(shape=(max_words,), dtype="int32", name="words")
            word_embed = keras.layers.Embedding(input_dim=20, output_dim=10)(word_ids)
            rnn_embed = rnn_cls(units=4, return_sequences=False)(word_embed)
            dense_output = keras.layers.Dense(2)(rnn_embed)
            preds = keras.layers.Softmax(dtype="float32")(dense_output)
            model = keras.Model(inputs=[word_ids], outputs=[preds])
            if initial_weights:
                model.set_weights(initial_weights)
            model.compile(
                optimizer=keras.optimizers.SGD(learning_rate=0.1),
                loss="sparse_categorical_crossentropy",
                metrics=["sparse_categorical_accuracy"],
            )
        return model

    return get_model


def _mixed_precision(fn):
    """TF's ``policy.policy_scope("mixed_float16")``."""
    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        fn()
    finally:
        keras.config.set_dtype_policy(before)


for _numpy, _validation in INPUTS:
    _suffix = _name(_numpy, _validation)
    _params = f"(use_numpy, use_validation_data = {_numpy}, {_validation})"

    def _gru(strategy, ctx, _n=_numpy, _v=_validation):
        correctness.run_correctness_test(strategy, rnn_model(keras.layers.GRU), correctness.embedding_data, _n, _v)

    _gru.__name__ = f"gru_model_correctness_{_suffix}"
    case(f"{SRC} DistributionStrategyGruModelCorrectnessTest.test_gru_model_correctness {_params}")(_gru)

    def _lstm(strategy, ctx, _n=_numpy, _v=_validation):
        correctness.run_correctness_test(strategy, rnn_model(keras.layers.LSTM), correctness.embedding_data, _n, _v)

    _lstm.__name__ = f"lstm_model_correctness_{_suffix}"
    case(f"{SRC} DistributionStrategyLstmModelCorrectnessTest.test_lstm_model_correctness {_params}")(_lstm)

    def _lstm_mixed(strategy, ctx, _n=_numpy, _v=_validation):
        _mixed_precision(
            lambda: correctness.run_correctness_test(
                strategy, rnn_model(keras.layers.LSTM), correctness.embedding_data, _n, _v
            )
        )

    _lstm_mixed.__name__ = f"lstm_model_correctness_mixed_precision_{_suffix}"
    case(
        f"{SRC} DistributionStrategyLstmModelCorrectnessTest.test_lstm_model_correctness_mixed_precision {_params}",
        (ONE_DEVICE, MIRRORED, MULTI_WORKER),
    )(_lstm_mixed)

STATEFUL = "keras_stateful_lstm_model_correctness_test.py"


@case(
    f"{STATEFUL} DistributionStrategyStatefulLstmModelCorrectnessTest."
    "test_incorrectly_use_multiple_cores_for_stateful_lstm_model (TF: a TPU of several cores)",
    MULTI,
)
def incorrectly_use_multiple_replicas_for_stateful_lstm_model(strategy, ctx):
    # tf_keras raises when the stateful layer is created in the scope (base_rnn.py).
    with raises(ValueError, match="not yet supported with tf.distribute.Strategy"):
        with strategy.scope():
            word_ids = keras.Input(shape=(10,), batch_size=correctness.GLOBAL_BATCH_SIZE, dtype="int32")
            word_embed = keras.layers.Embedding(input_dim=20, output_dim=10)(word_ids)
            lstm_embed = keras.layers.LSTM(units=4, return_sequences=False, stateful=True)(word_embed)
            preds = keras.layers.Dense(2, activation="softmax")(lstm_embed)
            model = keras.Model(inputs=[word_ids], outputs=[preds])
            model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="sparse_categorical_crossentropy")
