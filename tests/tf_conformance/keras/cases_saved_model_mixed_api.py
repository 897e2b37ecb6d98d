"""Cases translated from tf_keras/distribute/saved_model_mixed_api_test.py.

Saved with Keras (TF: ``model.save(save_format="tf")``; here Keras 3's whole-model file) and run
without Keras' ``predict`` (TF: ``tf.saved_model.load`` and its serving signature called in
``strategy.run`` on the distributed predict batch, the replicas' outputs concatenated; here the
restored model called in ``strategy.run`` the same way). TF runs them on its single-worker strategies.
"""

from __future__ import annotations

import keras

from tf_conformance.keras import saved_models
from tf_conformance.registry import SINGLE_WORKER, case


def _save(model, folder):
    model.save(str(folder / "model.keras"))


def _load_and_run(strategy, folder, x_predict):
    return saved_models.run_per_replica(strategy, keras.saving.load_model(str(folder / "model.keras")), x_predict)


saved_models.register(
    saved_models.Harness("saved_model_mixed_api", _save, _load_and_run),
    "saved_model_mixed_api_test.py SavedModelSaveAndLoadTest",
    case,
    SINGLE_WORKER,
    __name__,
)
