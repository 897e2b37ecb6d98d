"""Checkpoints of Keras objects (issue 16): Keras optimizers, object-graph matching, deferred restoration.

In one process, with real Keras 3 on the torch backend. TF's behaviour is the reference: a
``tf.train.Checkpoint`` holds Keras optimizers, matches objects by their place in the object
graph (so a fresh copy of a model restores although Keras named its layers ``dense_2``...), and
restores into variables created after ``restore()`` when they are created.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("needs Keras on the torch backend", allow_module_level=True)

import phalanx as px  # noqa: E402
import phalanx.keras  # noqa: E402,F401  (Keras models built in scope() are distributed)
from phalanx.checkpoint import Checkpoint, CheckpointManager, CheckpointMismatchError, load_state  # noqa: E402

X = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
Y = np.random.default_rng(1).normal(size=(16, 1)).astype("float32")


def _model(input_shape: bool = True, compiled: bool = True):
    layers = [keras.layers.Dense(8, activation="tanh"), keras.layers.BatchNormalization(), keras.layers.Dense(1)]
    model = keras.Sequential(([keras.Input((4,))] if input_shape else []) + layers)
    if compiled:
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def _trained():
    keras.utils.set_random_seed(0)
    model = _model()
    for i in range(3):
        model.train_on_batch(X[i * 4 : (i + 1) * 4], Y[i * 4 : (i + 1) * 4])
    return model


def _weights(model) -> list[np.ndarray]:
    return [np.array(w) for w in model.get_weights()]


def _slots(optimizer) -> list[np.ndarray]:
    return [np.array(keras.ops.convert_to_numpy(v)) for v in optimizer.variables]


def _assert_equal(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_keras_optimizer_is_checkpointed(tmp_path):
    model = _trained()
    path = Checkpoint(optimizer=model.optimizer).write(str(tmp_path / "c"))  # was UnsupportedStateError
    saved = load_state(path)["optimizer"]
    assert len(saved["vars"]) == len(model.optimizer.variables) == 2 + 2 * 6  # iterations, lr, m and v of 6
    assert int(saved["vars"]["0"]) == 3  # iterations


def test_fresh_copy_of_the_model_restores_by_object_graph_not_by_auto_names(tmp_path):
    model = _trained()
    path = Checkpoint(model=model).write(str(tmp_path / "c"))
    keras.utils.set_random_seed(7)
    fresh = _model()  # its layers are sequential_1/dense_2, ...: other names than the saved ones
    assert [v.path for v in fresh.weights] != [v.path for v in model.weights]
    Checkpoint(model=fresh).restore(path)  # was CheckpointMismatchError (names)
    _assert_equal(_weights(fresh), _weights(model))  # BatchNorm's moving statistics too


def test_optimizer_slots_created_after_restore_receive_the_saved_values(tmp_path):
    """TF's deferred restoration: a fresh Keras optimizer has no slots until its first step."""
    model = _trained()
    path = Checkpoint(model=model, optimizer=model.optimizer).write(str(tmp_path / "c"))
    fresh = _model()
    assert not fresh.optimizer.built
    status = Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(path)
    assert status.pending == ["optimizer"]
    with pytest.raises(CheckpointMismatchError, match="waiting for their variables"):
        status.assert_consumed()
    status.assert_existing_objects_matched()
    # One more step on both: equal only if Adam's moments and step count were restored before use.
    model.train_on_batch(X[12:], Y[12:])
    fresh.train_on_batch(X[12:], Y[12:])
    assert status.pending == [] and status.assert_consumed()
    _assert_equal(_slots(fresh.optimizer), _slots(model.optimizer))
    _assert_equal(_weights(fresh), _weights(model))


def test_checkpoint_of_a_compiled_model_carries_its_optimizer(tmp_path):
    """``tf.train.Checkpoint(model=model)`` in TF's multi-worker Keras tutorial: the optimizer comes along."""
    model = _trained()
    path = Checkpoint(model=model).write(str(tmp_path / "c"))
    fresh = _model()
    status = Checkpoint(model=fresh).restore(path)
    assert status.pending == ["model/optimizer"]
    model.train_on_batch(X[12:], Y[12:])
    fresh.train_on_batch(X[12:], Y[12:])
    _assert_equal(_slots(fresh.optimizer), _slots(model.optimizer))
    _assert_equal(_weights(fresh), _weights(model))


def test_lazily_built_model_receives_its_values_when_it_is_built(tmp_path):
    model = _trained()
    path = Checkpoint(model=model).write(str(tmp_path / "c"))
    lazy = _model(input_shape=False, compiled=False)
    assert not lazy.built and not lazy.weights
    status = Checkpoint(model=lazy).restore(path)
    assert sorted(status.pending) == ["model/batch_normalization", "model/dense", "model/dense_1"]
    out = lazy(X[:4])  # builds every layer; each gets its values before computing
    assert status.pending == []
    _assert_equal(_weights(lazy), _weights(model))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(out), keras.ops.convert_to_numpy(model(X[:4])))


def test_keras_variable_and_a_manager_round_trip(tmp_path):
    step = keras.Variable(0, dtype="int64", trainable=False)
    ckpt = Checkpoint(step=step)
    manager = CheckpointManager(ckpt, str(tmp_path), max_to_keep=1)
    step.assign(41)
    manager.save()
    again = keras.Variable(0, dtype="int64", trainable=False)
    CheckpointManager(Checkpoint(step=again), str(tmp_path), max_to_keep=1).restore_or_initialize()
    assert int(again.numpy()) == 41


def test_a_different_model_is_refused_with_a_typed_error(tmp_path):
    model = _trained()
    path = Checkpoint(model=model).write(str(tmp_path / "c"))
    other = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(5), keras.layers.BatchNormalization(), keras.layers.Dense(1)]
    )
    with pytest.raises(CheckpointMismatchError, match="dense"):
        Checkpoint(model=other).restore(path)


def test_keras_model_made_in_scope_checkpointed_outside_it(tmp_path, monkeypatch):
    """The owner of a Keras model's variables is found as for torch modules (issue 13 item 7)."""
    strategy = px.OneDeviceStrategy("cpu")
    with strategy.scope():
        model = _model()
    monkeypatch.setenv("PHALANX_WORLD_SIZE", "2")  # refused if no strategy were found
    path = Checkpoint(model=model).write(str(tmp_path / "c"))
    from phalanx.checkpoint import storage

    assert storage.read_manifest(path)["saved_by"]["strategy"] == "OneDeviceStrategy"


def test_torch_modules_still_store_their_state_dict(tmp_path):
    """Plain PyTorch restore keeps working: only Keras objects use the object graph."""
    module = torch.nn.Linear(3, 2)
    path = Checkpoint(model=module).write(str(tmp_path / "c"))
    plain = torch.nn.Linear(3, 2)
    plain.load_state_dict(load_state(path)["model"])
    assert torch.equal(plain.weight, module.weight)


class _Residual(keras.Model):
    """A subclassed model: its layers are attributes, matched by tracking order."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = keras.layers.Dense(4)
        self.head = keras.layers.Dense(1)

    def call(self, x):
        return self.head(x + self.inner(x))


def test_subclassed_model_and_metric_restore_into_fresh_copies(tmp_path):
    keras.utils.set_random_seed(0)
    model, metric = _Residual(), keras.metrics.Mean()
    model(X[:2])
    metric.update_state([1.0, 2.0, 6.0])
    path = Checkpoint(model=model, metric=metric).write(str(tmp_path / "c"))
    keras.utils.set_random_seed(3)
    fresh, fresh_metric = _Residual(), keras.metrics.Mean()
    status = Checkpoint(model=fresh, metric=fresh_metric).restore(path)
    assert float(fresh_metric.result()) == 3.0  # a metric through its variables
    assert sorted(status.pending) == ["model/dense", "model/dense_1"]  # built at the first call
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(fresh(X[:4])), keras.ops.convert_to_numpy(model(X[:4])))
    status.assert_consumed()
