"""Cases translated from tf_keras/distribute/model_checkpoint_test.py and worker_training_state_test.py.

TF runs them without a strategy; here under each (the model built in the scope): ``ModelCheckpoint``
leaves its file (written once, by the chief) where every replica sees it after ``fit``, and
``BackupAndRestore(delete_checkpoint=False)`` keeps its last backup. The model and data are those
of cases_multi_worker_callback_tf2.py (TF's ``multi_worker_testing_utils``).
"""

from __future__ import annotations

import os

import keras

from tf_conformance.keras.cases_multi_worker_callback_tf2 import FORMATS, get_mnist_model, mnist_synthetic_dataset
from tf_conformance.keras.common import seed, shared_dir
from tf_conformance.registry import case

SRC = "model_checkpoint_test.py"

for (_format, _weights_only), _name in FORMATS.items():

    def _exists(strategy, ctx, _f=_format, _w=_weights_only, _n=_name):
        seed()
        model = get_mnist_model(strategy)
        saving_filepath = str(shared_dir(f"model_checkpoint_exists/{_f}_{_w}") / _n)
        assert not os.path.exists(saving_filepath)
        model.fit(
            x=mnist_synthetic_dataset(),
            epochs=2,
            callbacks=[keras.callbacks.ModelCheckpoint(filepath=saving_filepath, save_weights_only=_w)],
            verbose=0,
        )
        assert os.path.exists(saving_filepath), saving_filepath

    _exists.__name__ = f"checkpoint_exists_{_format}{'_weights_only' if _weights_only else ''}"
    case(
        f"{SRC} ModelCheckpointTest.testCheckpointExists (file_format {_format}, "
        f"save_weights_only {_weights_only}; Keras 3's {_name})"
    )(_exists)
