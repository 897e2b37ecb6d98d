"""Cases translated from tf_keras/distribute/keras_save_load_test.py.

Keras' own save and load (TF's ``model.save(save_format="tf")`` and ``keras.models.load_model``):
here Keras 3's whole-model file, ``model.save("model.keras")`` and ``keras.saving.load_model``;
the restored model predicts with ``predict`` (under the strategy when restored in its scope).
TF runs them on its single-worker strategies.
"""

from __future__ import annotations

import keras

from tf_conformance.keras import saved_models
from tf_conformance.registry import SINGLE_WORKER, case


def _save(model, folder):
    model.save(str(folder / "model.keras"))


def _load_and_run(strategy, folder, x_predict):
    return saved_models.predict(keras.saving.load_model(str(folder / "model.keras")), x_predict)


saved_models.register(
    saved_models.Harness("keras_save_load", _save, _load_and_run),
    "keras_save_load_test.py KerasSaveLoadTest",
    case,
    SINGLE_WORKER,
    __name__,
)
