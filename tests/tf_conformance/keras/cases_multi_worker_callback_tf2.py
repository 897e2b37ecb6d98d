"""Cases translated from tf_keras/distribute/multi_worker_callback_tf2_test.py, model_checkpoint_test.py
and worker_training_state_test.py.

TF's callbacks under a strategy with several workers: ``ModelCheckpoint`` writes on the chief only
(a path of a worker's own: written by the chief; the same path on every worker: written once, and
there on every worker after ``fit``); ``BackupAndRestore`` resumes an interrupted ``fit`` at the
epoch it reached and removes its backup at the end; ``TensorBoard`` writes on the chief only (a
profile too, on phalanx's TensorBoard, where TF profiles every worker); ``EarlyStopping`` stops
every worker. TF runs these on MultiWorkerMirrored with two workers; they run on every strategy
here (a replica is a process). TF's MNIST model (``multi_worker_testing_utils.get_mnist_model``,
a Conv2D, BatchNormalization and a softmax Dense) takes 10x10 images here instead of 28x28; the
synthetic dataset is TF's: ones, labels 1, batches of 64, 2 steps per epoch. Keras 3 writes whole
models as ``.keras`` files (TF: ``tf`` and ``h5``) and weights as ``.weights.h5``; TF's ``tf``
weights-only checkpoint has no Keras 3 twin.
"""

from __future__ import annotations

import os

import keras
import numpy as np
import torch

import phalanx as px
from phalanx.keras.callbacks import TensorBoard
from tf_conformance.keras.common import loader, seed, shared_dir
from tf_conformance.registry import assert_equal, case

SRC = "multi_worker_callback_tf2_test.py"
CLS = "KerasCallbackMultiProcessTest"
BATCH_SIZE, STEPS = 64, 2


def mnist_synthetic_dataset():
    """TF's ``mnist_synthetic_dataset(64, 2)`` (training part): ones, every label 1."""
    x = np.ones((BATCH_SIZE * STEPS, 10, 10, 1), np.float32)
    y = np.ones((BATCH_SIZE * STEPS, 1), np.int32)
    return loader(x, y, batch_size=BATCH_SIZE, drop_last=True)


def get_mnist_model(strategy):
    with strategy.scope():
        inputs = keras.Input(shape=(10, 10, 1))
        x = keras.layers.Conv2D(
            32, kernel_size=(3, 3), activation="relu", kernel_initializer=keras.initializers.TruncatedNormal(seed=99)
        )(inputs)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.Add()([keras.layers.Flatten()(x), keras.layers.Flatten()(x)])
        x = keras.layers.Dense(
            10, activation="softmax", kernel_initializer=keras.initializers.TruncatedNormal(seed=99)
        )(x)
        model = keras.Model(inputs=inputs, outputs=x)
        model.compile(
            loss=keras.losses.sparse_categorical_crossentropy,
            optimizer=keras.optimizers.SGD(learning_rate=0.001),
            metrics=["accuracy"],
        )
    return model


FORMATS = {  # TF's (file_format, save_weights_only) -> Keras 3's file name
    ("h5", True): "checkpoint.weights.h5",
    # Keras 3 writes whole models in its .keras format (Keras 3.6's ModelCheckpoint refuses .h5).
    ("h5", False): "checkpoint_h5.keras",
    ("tf", False): "checkpoint.keras",
}


def _checkpoint_on_chief_only(strategy, ctx, file_format, save_weights_only):
    seed()
    model = get_mnist_model(strategy)
    train_ds = mnist_synthetic_dataset()
    name = FORMATS[(file_format, save_weights_only)]
    stem, dot, ext = name.partition(".")
    folder = shared_dir(f"model_checkpoint_saves_on_chief/{file_format}_{save_weights_only}")
    # TF: each worker gives a path of its own (checkpoint_<task type>_<index>).
    saving_filepath = str(folder / f"{stem}_{ctx.task_type}_{ctx.rank}{dot}{ext}")
    assert not os.path.exists(saving_filepath)
    model.fit(
        x=train_ds,
        epochs=2,
        validation_data=train_ds,
        callbacks=[keras.callbacks.ModelCheckpoint(filepath=saving_filepath, save_weights_only=save_weights_only)],
        verbose=0,
    )
    # The chief's checkpoint exists; no other replica wrote one.
    assert os.path.exists(saving_filepath) == (ctx.rank == 0), (saving_filepath, os.listdir(folder))


for (_format, _weights_only), _name in FORMATS.items():

    def _case(strategy, ctx, _f=_format, _w=_weights_only):
        _checkpoint_on_chief_only(strategy, ctx, _f, _w)

    _case.__name__ = (
        f"model_checkpoint_saves_on_chief_but_not_otherwise_{_format}{'_weights_only' if _weights_only else ''}"
    )
    case(
        f"{SRC} {CLS}.test_model_checkpoint_saves_on_chief_but_not_otherwise (file_format {_format}, "
        f"save_weights_only {_weights_only}; Keras 3's {_name})"
    )(_case)


@case(f"{SRC} {CLS}.test_model_checkpoint_works_with_same_file_path")
def model_checkpoint_works_with_same_file_path(strategy, ctx):
    seed()
    model = get_mnist_model(strategy)
    saving_filepath = str(shared_dir("model_checkpoint_same_path") / "checkpoint.keras")
    assert not os.path.exists(saving_filepath)
    model.fit(
        x=mnist_synthetic_dataset(),
        epochs=2,
        callbacks=[keras.callbacks.ModelCheckpoint(filepath=saving_filepath)],
        verbose=0,
    )
    assert os.path.exists(saving_filepath), saving_filepath


@case(f"{SRC} {CLS}.test_backupandrestore_checkpoint_works_with_interruption")
def backupandrestore_checkpoint_works_with_interruption(strategy, ctx):
    class InterruptingCallback(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("Interrupting!")

    epochs_seen = []

    class AssertCallback(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            epochs_seen.append(epoch)

    seed()
    model = get_mnist_model(strategy)
    folder = shared_dir("backupandrestore_interruption")
    saving_filepath = str(folder / "checkpoint.keras")
    bar_dir = str(folder / "backup")
    assert not os.path.exists(saving_filepath)
    try:
        model.fit(
            x=mnist_synthetic_dataset(),
            epochs=4,
            callbacks=[
                keras.callbacks.ModelCheckpoint(filepath=saving_filepath),
                keras.callbacks.BackupAndRestore(backup_dir=bar_dir),
                InterruptingCallback(),
            ],
            verbose=0,
        )
    except RuntimeError as e:
        if "Interrupting!" not in str(e):
            raise
    px.barrier()
    # TF: backup_dir/chief/checkpoint; Keras 3's backup is backup_dir/latest.weights.h5.
    backup_filepath = os.path.join(bar_dir, "latest.weights.h5")
    assert os.path.exists(backup_filepath) and os.path.exists(saving_filepath)
    model.fit(
        x=mnist_synthetic_dataset(),
        epochs=4,
        callbacks=[
            keras.callbacks.ModelCheckpoint(filepath=saving_filepath),
            keras.callbacks.BackupAndRestore(backup_dir=bar_dir),
            AssertCallback(),
        ],
        verbose=0,
    )
    px.barrier()
    assert epochs_seen == [2, 3], f"the second fit should resume at epoch 2; it began epochs {epochs_seen}"
    assert not os.path.exists(backup_filepath) and os.path.exists(saving_filepath)


@case(f"{SRC} {CLS}.test_profiler_saves_on_both_chief_and_non_chief")
def profiler_saves_on_both_chief_and_non_chief(strategy, ctx):
    seed()
    model = get_mnist_model(strategy)
    saving_filepath = str(shared_dir("profiler") / f"logfile_{ctx.task_type}_{ctx.rank}")
    assert not os.path.exists(saving_filepath)
    # Keras 3's TensorBoard needs TensorFlow; phalanx's (torch's profiler, every replica) stands in.
    model.fit(
        x=mnist_synthetic_dataset(),
        epochs=2,
        callbacks=[TensorBoard(log_dir=saving_filepath, profile_batch=(2, 4))],
        verbose=0,
    )
    px.barrier()
    assert os.path.isdir(saving_filepath) and os.listdir(saving_filepath), saving_filepath


@case(f"{SRC} {CLS}.test_tensorboard_saves_on_chief_but_not_otherwise")
def tensorboard_saves_on_chief_but_not_otherwise(strategy, ctx):
    seed()
    model = get_mnist_model(strategy)
    saving_filepath = str(shared_dir("tensorboard_chief") / f"logfile_{ctx.task_type}_{ctx.rank}")
    assert not os.path.exists(saving_filepath)
    model.fit(x=mnist_synthetic_dataset(), epochs=2, callbacks=[TensorBoard(log_dir=saving_filepath)], verbose=0)
    px.barrier()
    wrote = os.path.isdir(saving_filepath) and bool(os.listdir(saving_filepath))
    assert_equal(wrote, ctx.rank == 0, "wrote event files")


@case(f"{SRC} {CLS}.test_tensorboard_can_still_save_to_temp_even_if_it_exists")
def tensorboard_can_still_save_to_temp_even_if_it_exists(strategy, ctx):
    seed()
    model = get_mnist_model(strategy)
    folder = shared_dir("tensorboard_temp_exists")
    saving_filepath = folder / f"logfile_{ctx.task_type}"
    os.makedirs(saving_filepath / "workertemp_1", exist_ok=True)
    model.fit(x=mnist_synthetic_dataset(), epochs=2, callbacks=[TensorBoard(log_dir=str(saving_filepath))], verbose=0)


@case(f"{SRC} {CLS}.test_tensorboard_works_with_same_file_path")
def tensorboard_works_with_same_file_path(strategy, ctx):
    seed()
    model = get_mnist_model(strategy)
    saving_filepath = str(shared_dir("tensorboard_same_path") / "logfile")
    assert not os.path.exists(saving_filepath)
    px.barrier()
    model.fit(x=mnist_synthetic_dataset(), epochs=2, callbacks=[TensorBoard(log_dir=saving_filepath)], verbose=0)
    px.barrier()
    assert os.listdir(saving_filepath), saving_filepath


@case(f"{SRC} {CLS}.test_early_stopping")
def early_stopping(strategy, ctx):
    last_epoch = []

    class EpochCounterCallback(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            last_epoch.append(epoch)

    seed()
    model = get_mnist_model(strategy)
    # TF: around the 22nd epoch, asserted before the 50th (of 100). Every replica stops together.
    model.fit(
        x=mnist_synthetic_dataset(),
        epochs=100,
        callbacks=[keras.callbacks.EarlyStopping(monitor="loss", min_delta=0.05, patience=1), EpochCounterCallback()],
        verbose=0,
    )
    assert last_epoch[-1] < 50, last_epoch[-1]
    (total,) = strategy.extended.all_reduce([torch.tensor([float(last_epoch[-1])])], px.ReduceOp.SUM)
    assert float(total[0]) == last_epoch[-1] * px.num_processes(), "replicas stopped at different epochs"
