"""Keras ``fit``'s metrics in the trackers of a ``phalanx.summary`` writer: one callback, any strategy.

``Trackers(writer)`` logs what the progress bar and ``History`` show (aggregated over every
replica) to every tracker of ``writer`` (TensorBoard, CSV, MLflow, W&B; see
:func:`phalanx.summary.create_file_writer`), once per job:

* ``batch_<name>`` (``batch_loss``, ``batch_accuracy``: Keras' ``TensorBoard`` names) every
  ``update_freq`` training batches (``"batch"``: each, an int N: every N-th, ``"epoch"``: none),
  at the job's global step (the training batches so far, counted from 1);
* ``epoch_<name>`` (``epoch_loss``, ``epoch_val_loss``, ...) and ``epoch`` (the epoch's index) at
  each epoch's end, at the global step reached then, so one axis serves both (as Lightning
  logs them) and a tracker that wants steps in order (W&B) keeps every point.

It runs on the chief only, like the other writing callbacks, and its writer writes in the chief
only. The writer is closed at ``on_train_end`` when ``close=True`` (the default), which ends the
runs (an MLflow run becomes FINISHED).

Example::

    from phalanx import summary
    from phalanx.keras.callbacks import Trackers

    writer = summary.create_file_writer("logs", trackers=("csv", "mlflow", "wandb"), config={"lr": 0.01})
    model.fit(x, y, epochs=5, validation_split=0.2, callbacks=[Trackers(writer, update_freq="batch")])
"""

from __future__ import annotations

from typing import Any

import keras

from phalanx import summary


class Trackers(keras.callbacks.Callback):
    """Logs ``fit``'s batch and epoch metrics through ``writer`` (see the module docstring).

    Args:
        writer: a :func:`phalanx.summary.create_file_writer` writer.
        update_freq: ``"epoch"`` (epoch metrics only), ``"batch"`` or an int N (also the batch
            metrics of every N-th batch).
        close: close the writer when training ends.
    """

    def __init__(self, writer: summary.SummaryWriter, update_freq: str | int = "epoch", close: bool = True) -> None:
        super().__init__()
        if update_freq not in ("epoch", "batch") and not (isinstance(update_freq, int) and update_freq > 0):
            raise ValueError(f"update_freq must be 'epoch', 'batch' or a positive int; received {update_freq!r}")
        if not isinstance(writer, summary.SummaryWriter):
            raise TypeError(f"Trackers needs a phalanx.summary writer; received {writer!r}")
        self.writer = writer
        self.update_freq = 1 if update_freq == "batch" else update_freq
        self.close = close
        # The training batches so far, over every fit this callback took part in: a second fit's
        # points follow the first's (a summary's steps never go back).
        self.global_step = 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.global_step += 1
        if self.update_freq == "epoch" or self.global_step % self.update_freq:
            return
        with self.writer.as_default(step=self.global_step):
            for name, value in (logs or {}).items():
                summary.scalar(f"batch_{name}", _number(value))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        with self.writer.as_default(step=self.global_step):
            summary.scalar("epoch", epoch)
            for name, value in (logs or {}).items():
                summary.scalar(f"epoch_{name}", _number(value))

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.close:
            self.writer.close()
        else:
            self.writer.flush()


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else float(keras.ops.convert_to_numpy(value))
