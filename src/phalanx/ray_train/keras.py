"""Keras ``fit`` in Ray Train workers: a callback that reports each epoch and resumes from Ray.

Ray's own Keras callback (``ray.train.tensorflow.keras.ReportCheckpointCallback``) is TensorFlow's;
this one serves Keras 3 on torch under a phalanx strategy. It runs on every replica (``report`` is
collective), restores Ray's latest checkpoint when training begins and makes ``fit`` continue from
the epoch after it, as ``BackupAndRestore`` does.

Example (inside ``train_loop_per_worker``)::

    strategy = px.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = make_model(); model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, epochs=10, callbacks=[ReportCheckpointCallback()])
"""

from __future__ import annotations

from typing import Any

import keras

from phalanx._compat import keras as compat_keras
from phalanx.checkpoint import Checkpoint, Counter
from phalanx.ray_train import report, restore


class ReportCheckpointCallback(keras.callbacks.Callback):
    """Reports ``fit``'s logs to Ray Train after each epoch, with a checkpoint every ``checkpoint_every``.

    Args:
        checkpoint_every: epochs between two checkpoints (0: metrics only).
        metrics: the logs to report (default: all); ``epoch`` (epochs done) is always reported.

    Raises:
        ValueError: ``checkpoint_every`` is negative.
    """

    def __init__(self, checkpoint_every: int = 1, metrics: list[str] | None = None) -> None:
        super().__init__()
        if not isinstance(checkpoint_every, int) or checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be a non-negative integer; received {checkpoint_every!r}")
        self._every = checkpoint_every
        self._metrics = None if metrics is None else list(metrics)
        self._epochs = Counter(0)
        self._checkpoint: Checkpoint | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._checkpoint = Checkpoint(model=self.model, epochs=self._epochs)
        if restore(self._checkpoint) is not None:  # a restarted worker group: go on after its epoch
            compat_keras.set_initial_epoch(self.model, int(self._epochs))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._epochs.assign(epoch + 1)
        logs = dict(logs or {})
        chosen = logs if self._metrics is None else {k: logs[k] for k in self._metrics if k in logs}
        metrics: dict[str, Any] = {**chosen, "epoch": epoch + 1}
        due = self._every > 0 and (epoch + 1) % self._every == 0
        report(metrics, checkpoint=self._checkpoint if due else None)
