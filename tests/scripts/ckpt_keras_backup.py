"""keras.callbacks.BackupAndRestore under a strategy: interrupted fit, then fit again.

Usage: python ckpt_keras_backup.py OUT_DIR STRATEGY[,STRATEGY...]
    STRATEGY: one_device | mirrored | central (2 CPU replicas each) | mwms (under phalanx run -n 2)

Several strategies run one after the other in the same processes, each in OUT_DIR/STRATEGY
(process start-up is most of what a job costs). ``one_device`` runs on the first process alone:
listed before a multi-replica strategy, it runs before that strategy starts the other replicas
(which run this script again and skip it).

3 epochs of 5 batches. The first fit raises at the end of batch 2 of epoch 1; the second fit, with
a new BackupAndRestore on the same directory, resumes from the backup taken after epoch 0 (Keras
redoes the unfinished epoch). Each replica writes result_<rank>.json: the optimizer's iterations
and a canary layer's count (both restored from the backup: batches trained, as training state
sees them), the batches executed in both fits, the epochs of the second fit, and whether the
backup directory is gone at the end.
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

EPOCHS, BATCHES, BATCH = 3, 5, 8


class Canary(keras.layers.Layer):
    """Counts training batches in a non-trainable weight, which the backup saves and restores."""

    def build(self, shape):
        self.count = self.add_weight(shape=(), initializer="zeros", trainable=False, name="count")

    def call(self, x, training=None):
        if training:
            self.count.assign_add(1.0)
        return x


class Executed(keras.callbacks.Callback):
    def __init__(self, interrupt=False):
        super().__init__()
        self.interrupt, self.batches, self.epochs = interrupt, 0, []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self.epochs.append(epoch)

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        if self.interrupt and self.epoch == 1 and batch == 2:
            raise RuntimeError("interrupted at batch 2 of epoch 1")


def main(out, kind):
    strategy = {
        "one_device": lambda: px.OneDeviceStrategy("cpu"),
        "mirrored": lambda: px.MirroredStrategy(["cpu:0", "cpu:1"]),
        "central": lambda: px.CentralStorageStrategy(["cpu:0", "cpu:1"]),
        "mwms": px.MultiWorkerMirroredStrategy,
    }[kind]()
    rank = strategy.extended.process_index
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), Canary(), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x = np.random.RandomState(0).rand(BATCHES * BATCH, 4).astype("float32")
    y = x.sum(1, keepdims=True)
    backup = os.path.join(out, "backup")
    first, second = Executed(interrupt=True), Executed()
    try:
        model.fit(
            x,
            y,
            epochs=EPOCHS,
            batch_size=BATCH,
            verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(backup), first],
        )
        raise SystemExit("the first fit was not interrupted")
    except RuntimeError as e:
        if "interrupted at batch 2" not in str(e):
            raise
    model.fit(
        x, y, epochs=EPOCHS, batch_size=BATCH, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(backup), second]
    )
    result = {
        "iterations": int(model.optimizer.iterations.numpy()),
        "canary": float(model.layers[0].count.numpy()),
        "executed": first.batches + second.batches,
        "second_fit_epochs": second.epochs,
        "backup_deleted": not os.path.exists(backup),
    }
    with open(os.path.join(out, f"result_{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    for kind in sys.argv[2].split(","):
        if kind == "one_device" and int(os.environ.get("PHALANX_RANK", "0")) != 0:
            continue
        os.makedirs(os.path.join(sys.argv[1], kind), exist_ok=True)
        main(os.path.join(sys.argv[1], kind), kind)
