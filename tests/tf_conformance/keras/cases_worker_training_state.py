"""Cases translated from tf_keras/distribute/worker_training_state_test.py.

TF runs it without a strategy; here under each (the model built in the scope). The model and data
are those of cases_multi_worker_callback_tf2.py (TF's ``multi_worker_testing_utils``).
"""

from __future__ import annotations

import os

import keras

from tf_conformance.keras.cases_multi_worker_callback_tf2 import get_mnist_model, mnist_synthetic_dataset
from tf_conformance.keras.common import seed, shared_dir
from tf_conformance.registry import case


@case("worker_training_state_test.py WorkerTrainingStateTest.testCheckpointExists")
def checkpoint_exists(strategy, ctx):
    seed()
    model = get_mnist_model(strategy)
    saving_dir = shared_dir("worker_training_state")
    assert not os.listdir(saving_dir)
    model.fit(
        x=mnist_synthetic_dataset(),
        epochs=2,
        callbacks=[keras.callbacks.BackupAndRestore(backup_dir=str(saving_dir), delete_checkpoint=False)],
        verbose=0,
    )
    # TF keeps one checkpoint (chief/ckpt-2.index); Keras 3 keeps its latest weights and metadata.
    assert sorted(os.listdir(saving_dir)) == ["latest.weights.h5", "training_metadata.json"], os.listdir(saving_dir)
