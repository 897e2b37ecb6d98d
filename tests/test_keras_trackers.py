"""The Keras callbacks that watch a run, in one process: Trackers and TensorBoard across two fits.

The jobs under MultiWorkerMirroredStrategy are in tests/test_watch_job.py.
"""

from __future__ import annotations

import csv
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from phalanx import summary  # noqa: E402
from phalanx.keras.callbacks import TensorBoard, Trackers  # noqa: E402


def _model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


# Keras' first fit imports what sets KERAS/KMP/TF variables and torch's first optimizer step sets
# TORCHINDUCTOR_CACHE_DIR: done once here, before the hygiene fixture compares the environment.
_model().fit(np.ones((4, 4), "float32"), np.ones((4, 1), "float32"), epochs=1, verbose=0)


def test_trackers_and_tensorboard_callbacks_go_on_across_two_fits(tmp_path):
    """A second fit with the same callbacks continues their steps (a summary's steps never go back)."""
    writer = summary.create_file_writer(tmp_path / "run", trackers=("csv",))
    callbacks = [Trackers(writer, update_freq="batch", close=False), TensorBoard(tmp_path / "tb", update_freq="batch")]
    model = _model()
    x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
    history = model.fit(x, y, epochs=1, batch_size=4, verbose=0, callbacks=callbacks)
    history2 = model.fit(x, y, epochs=2, initial_epoch=1, batch_size=4, verbose=0, callbacks=callbacks)
    writer.close()
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        rows = [(int(s), n, float(v)) for s, n, v in list(csv.reader(f))[1:]]
    assert [s for s, n, _ in rows if n == "batch_loss"] == [1, 2, 3, 4]
    assert [(s, v) for s, n, v in rows if n == "epoch"] == [(2, 0.0), (4, 1.0)]
    losses = history.history["loss"] + history2.history["loss"]
    assert [v for s, n, v in rows if n == "epoch_loss"] == pytest.approx(losses)


def test_trackers_refuses_what_is_not_a_summary_writer(tmp_path):
    with pytest.raises(TypeError, match="needs a phalanx.summary writer"):
        Trackers(str(tmp_path))
    with pytest.raises(ValueError, match="update_freq"):
        Trackers(summary.create_file_writer(tmp_path, trackers=("csv",)), update_freq="sometimes")


def test_tensorboard_profile_batch_of_one_process_writes_its_trace(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model = _model()
    model.fit(
        np.ones((16, 4), "float32"),
        np.ones((16, 1), "float32"),
        epochs=1,
        batch_size=4,
        verbose=0,
        callbacks=[TensorBoard(tmp_path / "tb", profile_batch="2,3")],
    )
    trace = json.loads((tmp_path / "tb" / "plugins" / "profile" / "batches_2-3" / "replica0.pt.trace.json").read_text())
    assert trace["traceEvents"]
