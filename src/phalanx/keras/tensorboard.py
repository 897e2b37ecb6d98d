"""A Keras ``TensorBoard`` callback that works on the torch backend, written once under any strategy.

Keras 3's own ``keras.callbacks.TensorBoard`` writes through TensorFlow, so on the torch backend
without TensorFlow it cannot write. This one writes the same event files through
``torch.utils.tensorboard`` (``pip install -e ".[tensorboard]"``), with Keras' layout and tag
names, so ``tensorboard --logdir DIR`` shows what it shows for a tf.keras job:

* ``DIR/train``: ``epoch_loss``, ``epoch_<metric>``, ``epoch_learning_rate`` at every epoch;
  ``batch_loss``, ``batch_<metric>`` every ``update_freq`` batches (when it is ``"batch"`` or
  an int); ``<weight path>/histogram`` of every weight every ``histogram_freq`` epochs;
* ``DIR/validation``: ``epoch_loss`` and ``epoch_<metric>`` of the validation data;
* ``DIR/plugins/profile/batches_<a>-<b>/replica<r>.pt.trace.json`` with ``profile_batch=(a, b)``:
  a ``torch.profiler`` trace of training batches ``a`` to ``b`` (counted from 1 over the whole
  ``fit``, as Keras counts them), one per replica, with phalanx's collectives marked
  (:mod:`phalanx.profiler`); Perfetto and ``chrome://tracing`` open it.

Under a strategy it runs on the chief only (as the other writing callbacks; when it profiles, on
every replica, so that each writes its trace), and its writers
(:mod:`phalanx.summary`) write only in the chief process, so a job leaves one set of event files.
The losses and metrics are those of the progress bar and ``History``: aggregated over all
replicas.

Example::

    from phalanx.keras.callbacks import TensorBoard

    model.fit(x, y, epochs=10, validation_split=0.2,
              callbacks=[TensorBoard("logs", histogram_freq=1)])
"""

from __future__ import annotations

import os
from typing import Any

import keras
import numpy as np

from phalanx import summary


class TensorBoard(keras.callbacks.Callback):
    """Writes losses, metrics, the learning rate and weight histograms for TensorBoard.

    Args:
        log_dir: the directory of the ``train`` and ``validation`` event files.
        histogram_freq: every how many epochs to write weight histograms (0: never).
        update_freq: ``"epoch"`` (default), ``"batch"`` or an int N: also write the batch logs
            every N batches.
        profile_batch: the training batches to profile: ``(a, b)``, ``"a,b"`` or one batch
            ``n`` (0: none, the default).
        write_graph, write_images, write_steps_per_second, embeddings_freq, embeddings_metadata:
            accepted for compatibility with ``keras.callbacks.TensorBoard``; nothing is written
            for them.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str] = "logs",
        histogram_freq: int = 0,
        write_graph: bool = True,
        write_images: bool = False,
        write_steps_per_second: bool = False,
        update_freq: str | int = "epoch",
        profile_batch: Any = 0,
        embeddings_freq: int = 0,
        embeddings_metadata: Any = None,
    ) -> None:
        super().__init__()
        if update_freq not in ("epoch", "batch") and not (isinstance(update_freq, int) and update_freq > 0):
            raise ValueError(f"update_freq must be 'epoch', 'batch' or a positive int; received {update_freq!r}")
        self.log_dir = os.fspath(log_dir)
        self.histogram_freq = int(histogram_freq)
        self.update_freq = 1 if update_freq == "batch" else update_freq
        self._train = summary.create_file_writer(os.path.join(self.log_dir, "train"))
        self._validation = summary.create_file_writer(os.path.join(self.log_dir, "validation"))
        self._train_step = 0
        self._profile = None
        if profile_batch not in (0, None, "", (0, 0), "0"):
            from phalanx.profiler import Profile

            self._profile = Profile(self.log_dir, profile_batch, label="batches")

    @property
    def profiles(self) -> bool:
        """Whether it takes a profile (then it runs on every replica, each writing its trace)."""
        return self._profile is not None

    def on_train_begin(self, logs: dict | None = None) -> None:
        # The batch step goes on across fits of one callback (Keras' restarts at 0): a summary's
        # steps must not go back (phalanx.summary refuses it), and a second fit's batches follow
        # the first's on one axis.
        pass

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._profile is not None and self._train_step + 1 == self._profile.first:
            self._profile.start()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._train_step += 1
        if self._profile is not None and self._train_step == self._profile.last:
            self._profile.stop()
        if self.update_freq == "epoch" or self._train_step % self.update_freq:
            return
        with self._train.as_default(step=self._train_step):
            for name, value in (logs or {}).items():
                summary.scalar(f"batch_{name}", _number(value))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        logs = logs or {}
        with self._train.as_default(step=epoch):
            for name, value in logs.items():
                if not name.startswith("val_"):
                    summary.scalar(f"epoch_{name}", _number(value))
            learning_rate = self._learning_rate()
            if learning_rate is not None and "learning_rate" not in logs:
                summary.scalar("epoch_learning_rate", learning_rate)
            if self.histogram_freq and epoch % self.histogram_freq == 0:
                for weight in self.model.weights:
                    summary.histogram(f"{weight.path}/histogram", np.asarray(keras.ops.convert_to_numpy(weight)))
        validation = {k[len("val_") :]: v for k, v in logs.items() if k.startswith("val_")}
        if validation:
            with self._validation.as_default(step=epoch):
                for name, value in validation.items():
                    summary.scalar(f"epoch_{name}", _number(value))

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._profile is not None:
            self._profile.stop()  # fit ended inside the range: write what was recorded
        self._train.flush()
        self._validation.flush()

    def _learning_rate(self) -> float | None:
        optimizer = getattr(self.model, "optimizer", None)
        rate = getattr(optimizer, "learning_rate", None)
        if rate is None:
            return None
        try:
            return float(keras.ops.convert_to_numpy(rate))
        except (TypeError, ValueError):  # a schedule object not evaluated by this optimizer
            return None


def _number(value: Any) -> float:
    return float(keras.ops.convert_to_numpy(value)) if not isinstance(value, (int, float)) else float(value)
