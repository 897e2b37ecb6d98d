"""Callbacks under a 2-replica strategy: writers run once, stopping is agreed.

Usage: python keras_callbacks.py OUT_DIR MODE      (MODE: mirrored | mwms)

Fit 1 (6 epochs): ModelCheckpoint and TensorBoard on every replica (only the chief may write),
EarlyStopping on replica 1 only, asking for an improvement of 1.0 that no epoch makes: it stops replica 1 after epoch 2
and, through the agreement, every replica. Fit 2: a LambdaCallback on the chief alone stops
training after the 4th batch of the first epoch. Each replica writes ``result_{rank}.json``.
"""

import faulthandler
import json
import os
import sys

from phalanx.config import stack_signal  # PHALANX_STACK_SIGNAL, as the test harness sends

faulthandler.register(stack_signal(), all_threads=True)
os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import phalanx as px  # noqa: E402
import phalanx.keras  # noqa: E402,F401

OUT, MODE = sys.argv[1], sys.argv[2]


class CountingCheckpoint(keras.callbacks.ModelCheckpoint):
    """ModelCheckpoint that also notes, per process, each time it saves."""

    def _save_model(self, epoch, batch, logs):
        with open(os.path.join(OUT, f"saves_rank{RANK}.txt"), "a") as f:
            f.write(f"{epoch}\n")
        super()._save_model(epoch, batch, logs)


class _FileWriter:
    """The part of tf.summary's writer that Keras' TensorBoard uses (TensorFlow is not installed)."""

    def __init__(self, logdir):
        os.makedirs(logdir, exist_ok=True)
        self.path = os.path.join(logdir, f"events.out.rank{RANK}.pid{os.getpid()}")

    def as_default(self, step=None):
        import contextlib

        return contextlib.nullcontext()

    def write(self, name, value, step):
        with open(self.path, "a") as f:
            f.write(f"{name} {step} {float(value)}\n")

    def flush(self):
        pass

    def close(self):
        pass


class _Summary:
    def __init__(self):
        self.writer = None

    def create_file_writer(self, logdir):
        self.writer = _FileWriter(logdir)
        return self.writer

    def scalar(self, name, data, step=None):
        self.writer.write(name, data, step)

    def record_if(self, condition):
        import contextlib

        return contextlib.nullcontext()


class FileTensorBoard(keras.callbacks.TensorBoard):
    def __init__(self, log_dir):
        super().__init__(log_dir=log_dir, histogram_freq=0, write_graph=False, update_freq="epoch")
        self._summary_module = _Summary()


strategy = px.MirroredStrategy(["cpu:0", "cpu:1"]) if MODE == "mirrored" else px.MultiWorkerMirroredStrategy()
RANK = strategy.extended.process_index
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.normal(size=(200, 8)).astype("float32")
y = (x.sum(1) > 0).astype("float32")

with strategy.scope():
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1, activation="sigmoid")]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="binary_crossentropy", metrics=["accuracy"])

callbacks = [
    CountingCheckpoint(os.path.join(OUT, "ckpt-{epoch:02d}.weights.h5"), save_weights_only=True),
    FileTensorBoard(os.path.join(OUT, "tb")),
]
if RANK == 1:
    callbacks.append(keras.callbacks.EarlyStopping(monitor="loss", min_delta=1.0, patience=1))
history = model.fit(x, y, epochs=6, batch_size=20, callbacks=callbacks)
first = {
    "epochs": history.epoch,
    "loss": history.history["loss"],
    "iterations": int(model.optimizer.iterations.numpy()),
}

stopper = keras.callbacks.LambdaCallback(
    on_train_batch_end=lambda batch, logs: setattr(model, "stop_training", batch == 3)
)
history = model.fit(x, y, epochs=3, batch_size=20, callbacks=[stopper] if RANK == 0 else [], verbose=0)
second = {"epochs": history.epoch, "iterations": int(model.optimizer.iterations.numpy())}

with open(os.path.join(OUT, f"result_{RANK}.json"), "w") as f:
    json.dump({"first": first, "second": second}, f)
