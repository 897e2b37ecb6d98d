"""Cases translated from tf_keras/distribute/keras_embedding_model_correctness_test.py.

An Embedding model (with and without a TimeDistributed Dense) and a siamese one (one Embedding
shared by two inputs of named features) trained with and without the strategy, over numpy arrays
and DataLoaders, with and without ``validation_data``. TF runs them on OneDevice, its
GPU/TPU strategies and MultiWorkerMirrored; the CPU strategies here stand in for the GPU ones.
"""

from __future__ import annotations

import keras
import numpy as np

from tf_conformance.keras import correctness
from tf_conformance.keras.common import maybe_scope
from tf_conformance.registry import case

SRC = "keras_embedding_model_correctness_test.py"
INPUTS = [(True, True), (True, False), (False, True), (False, False)]


def _name(use_numpy: bool, use_validation_data: bool) -> str:
    return ("numpy" if use_numpy else "dataset") + ("_validation" if use_validation_data else "")


def embedding_model(use_distributed_dense: bool):
    def get_model(initial_weights=None, distribution=None, max_words=10):
        with maybe_scope(distribution):
            word_ids = keras.Input(shape=(max_words,), dtype="int32", name="words")
            word_embed = keras.layers.Embedding(input_dim=20, output_dim=10)(word_ids)
            if use_distributed_dense:
                word_embed = keras.layers.TimeDistributed(keras.layers.Dense(4))(word_embed)
            avg = keras.layers.GlobalAveragePooling1D()(word_embed)
            preds = keras.layers.Dense(2, activation="softmax")(avg)
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


def siamese_model(initial_weights=None, distribution=None, max_words=10):
    """TF's ``DistributionStrategySiameseEmbeddingModelCorrectnessTest.get_model``."""
    with maybe_scope(distribution):
        word_ids_a = keras.Input(shape=(max_words,), dtype="int32", name="words_a")
        word_ids_b = keras.Input(shape=(max_words,), dtype="int32", name="words_b")
        word_embed = keras.layers.Embedding(
            input_dim=20, output_dim=10, embeddings_initializer=keras.initializers.RandomUniform(0, 1)
        )

        def submodel(embedding, word_ids):
            rep = keras.layers.GlobalAveragePooling1D()(embedding(word_ids))
            return keras.Model(inputs=[word_ids], outputs=[rep])

        a_rep = submodel(word_embed, word_ids_a).outputs[0]
        b_rep = submodel(word_embed, word_ids_b).outputs[0]
        sim = keras.layers.Dot(axes=1, normalize=True)([a_rep, b_rep])
        model = keras.Model(inputs=[word_ids_a, word_ids_b], outputs=[sim])
        if initial_weights:
            model.set_weights(initial_weights)
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse", metrics=["mse"])
    return model


def siamese_data():
    count = correctness.GLOBAL_BATCH_SIZE * correctness.EVAL_STEPS
    features_a, labels_a, _ = correctness.embedding_data(count)
    features_b, labels_b, _ = correctness.embedding_data(count)
    y_train = np.zeros((count, 1), dtype=np.float32)
    y_train[labels_a == labels_b] = 1.0
    y_train[labels_a != labels_b] = -1.0
    x_train = {"words_a": features_a, "words_b": features_b}
    return x_train, y_train, x_train


TESTS = [
    ("DistributionStrategyEmbeddingModelCorrectnessTest.test_embedding_model_correctness", "embedding_model",
     embedding_model(False), correctness.embedding_data),
    ("DistributionStrategyEmbeddingModelCorrectnessTest.test_embedding_time_distributed_model_correctness",
     "embedding_time_distributed_model", embedding_model(True), correctness.embedding_data),
    ("DistributionStrategySiameseEmbeddingModelCorrectnessTest.test_siamese_embedding_model_correctness",
     "siamese_embedding_model", siamese_model, siamese_data),
]  # fmt: skip

for _test, _prefix, _model, _data in TESTS:
    for _numpy, _validation in INPUTS:

        def _case(strategy, ctx, _m=_model, _d=_data, _n=_numpy, _v=_validation):
            correctness.run_correctness_test(strategy, _m, _d, _n, _v)

        _case.__name__ = f"{_prefix}_correctness_{_name(_numpy, _validation)}"
        case(f"{SRC} {_test} (use_numpy, use_validation_data = {_numpy}, {_validation})")(_case)
