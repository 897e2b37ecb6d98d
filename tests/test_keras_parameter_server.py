"""Keras ``fit`` / ``evaluate`` / ``predict`` under ParameterServerStrategy.

In process (the production services over the in-process transport): one worker equals one-device
Keras training step for step, in fit and in the PS tutorial's custom loop (a Keras optimizer and
metric inside a scheduled function); the seed notebook's MLP on 2 PS and 2 workers learns the digits with
the Adam state on the servers; callbacks run on the chief; unsupported input fails clearly.
Across processes (gRPC): the seed example under ``phalanx run --ps 2 --workers 2``
(test_keras_examples.py).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("cloudpickle")
os.environ.setdefault("KERAS_BACKEND", "torch")
keras = pytest.importorskip("keras")

# Before the per-test environment check: set_random_seed imports TensorFlow when it is installed
# (which sets TF's variables), torch's first Adam step sets TORCHINDUCTOR_CACHE_DIR, and importing
# scikit-learn sets KMP_DUPLICATE_LIB_OK and KMP_INIT_AT_FORK (the full suite's doctests of
# phalanx.demo import it earlier; this file run on its own must not depend on that).
import sklearn.datasets  # noqa: E402,F401

import phalanx.keras  # noqa: E402,F401
from phalanx.errors import PhalanxError  # noqa: E402
from phalanx.keras.parameter_server import UnsupportedOptimizerError, torch_optimizer_config  # noqa: E402
from phalanx.ps.testing import InProcessCluster  # noqa: E402

keras.utils.set_random_seed(0)
_p = torch.nn.Parameter(torch.zeros(1))
_p.grad = torch.zeros(1)
torch.optim.Adam([_p]).step()


def _digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype("float32"), y.astype("int64")


def _mlp(dropout: float = 0.0, hidden: int = 32):
    layers = [keras.Input((64,)), keras.layers.Dense(hidden, activation="relu")]
    if dropout:
        layers.append(keras.layers.Dropout(dropout))
    return keras.Sequential(layers + [keras.layers.Dense(10, activation="softmax")])


def test_one_worker_equals_one_device_keras_training():
    x, y = _digits()
    x, y = x[:640], y[:640]
    keras.utils.set_random_seed(3)
    reference = _mlp()
    reference.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="sparse_categorical_crossentropy")
    initial = reference.get_weights()
    ref_history = reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        with cluster.strategy.scope():
            model = _mlp()
            model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="sparse_categorical_crossentropy")
            model.set_weights(initial)  # sent to the servers before the first step
        history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
        updates = sum(s["updates"] for s in cluster.strategy.extended.parameter_server_stats())
    assert updates == 2 * 10 * 4  # 2 epochs x 10 steps x 4 variables, each updated once per step
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)
    print(
        f"\none worker vs one device: max |dw| = "
        f"{max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), reference.get_weights())):.2e}"
    )


class _Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches, self.epochs = 0, []

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs))
        if epoch == 4:
            self.model.stop_training = True


class _StepCounter(keras.callbacks.Callback):
    batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1


def test_seed_mlp_on_two_ps_and_two_workers_learns_with_adam_state_on_the_servers(tmp_path):
    x, y = _digits()
    keras.utils.set_random_seed(0)
    recorder = _Recorder()
    with InProcessCluster(num_ps=2, num_workers=2) as cluster:
        with cluster.strategy.scope():
            model = _mlp(dropout=0.2, hidden=128)  # the notebook's model
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        history = model.fit(
            x[:1500],
            y[:1500],
            epochs=10,
            batch_size=25,
            steps_per_epoch=40,
            validation_data=(x[1500:], y[1500:]),
            verbose=0,
            callbacks=[
                recorder,
                keras.callbacks.ModelCheckpoint(str(tmp_path / "m.weights.h5"), save_weights_only=True),
            ],
        )
        loss, accuracy = model.evaluate(x[1500:], y[1500:], verbose=0)
        predictions = model.predict(x[1500:], verbose=0)
        slots = [s for ps in cluster.ps for s in ps._slots.values() if s.optimizer is not None]
        stats = cluster.strategy.extended.parameter_server_stats()
    keras.utils.set_random_seed(0)
    reference = _mlp(dropout=0.2, hidden=128)
    reference.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    # Plain Keras keeps one iterator across epochs when steps_per_epoch is given and stops when it
    # runs dry (60 batches here); repeat the data so the reference really takes the same 200 steps.
    steps = _StepCounter()
    reference.fit(
        np.concatenate([x[:1500]] * 4),
        np.concatenate([y[:1500]] * 4),
        epochs=5,
        batch_size=25,
        steps_per_epoch=40,
        verbose=0,
        callbacks=[steps],
    )
    assert steps.batches == 5 * 40
    ref_loss, ref_accuracy = reference.evaluate(x[1500:], y[1500:], verbose=0)
    print(
        f"\nPS Keras fit (2 ps, 2 workers, 200 async steps): held-out accuracy {accuracy:.3f}, loss {loss:.3f}; "
        f"one device, same steps: {ref_accuracy:.3f}, {ref_loss:.3f}"
    )
    assert recorder.batches == 5 * 40 and len(recorder.epochs) == 5  # stop_training after epoch 5
    assert sum(s["updates"] for s in stats) == 5 * 40 * 4
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert accuracy > ref_accuracy - 0.05 and loss < 1.2 * ref_loss  # asynchronous, yet as good as one device
    assert abs(history.history["val_accuracy"][-1] - accuracy) < 1e-6
    assert predictions.shape == (297, 10) and float((predictions.argmax(1) == y[1500:]).mean()) == pytest.approx(
        accuracy
    )
    assert len(slots) == 4 and all({"exp_avg", "exp_avg_sq"} <= set(s.optimizer.state[s.value]) for s in slots)
    assert (tmp_path / "m.weights.h5").exists()


def test_optimizer_mapping_and_refusals():
    rmsprop = torch_optimizer_config(keras.optimizers.RMSprop(0.01, rho=0.8))
    assert rmsprop["class"] == "KerasRMSprop" and rmsprop["hyper"]["rho"] == pytest.approx(0.8)
    adam = torch_optimizer_config(keras.optimizers.AdamW(0.002, weight_decay=0.01))
    assert adam["class"] == "AdamW" and adam["hyper"]["weight_decay"] == pytest.approx(0.01)
    with pytest.raises(UnsupportedOptimizerError, match="clipnorm"):
        torch_optimizer_config(keras.optimizers.Adam(clipnorm=1.0))
    with pytest.raises(UnsupportedOptimizerError, match="Nadam"):
        torch_optimizer_config(keras.optimizers.Nadam())


def test_input_without_length_needs_steps_per_epoch():
    x, y = _digits()

    class Batches:  # re-iterable, picklable, no len()
        def __iter__(self):
            for i in range(0, 200, 50):
                yield x[i : i + 50], y[i : i + 50]

    with InProcessCluster(num_ps=1, num_workers=1) as cluster:
        with cluster.strategy.scope():
            model = _mlp()
            model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        with pytest.raises(PhalanxError, match="steps_per_epoch"):
            model.fit(Batches(), epochs=1, verbose=0)
        history = model.fit(Batches(), epochs=2, steps_per_epoch=6, verbose=0)  # cycles over the 4 batches
        assert len(history.history["loss"]) == 2
        assert sum(s["updates"] for s in cluster.strategy.extended.parameter_server_stats()) == 2 * 6 * 4


@pytest.mark.parametrize("momentum,centered", [(0.0, False), (0.9, False), (0.0, True)])
def test_servers_rmsprop_is_keras_rmsprop_step_for_step(momentum, centered):
    """torch.optim.RMSprop puts epsilon outside the square root and diverged where Keras' learns;
    the servers run Keras' own update."""
    from phalanx.ps.variable_server import optimizer_class

    torch.manual_seed(0)
    start = torch.randn(5, 3)
    grads = [torch.randn(5, 3) * 10**-k for k in range(6)]  # small gradients: where the two differ
    variable = keras.Variable(start.numpy())
    keras_opt = keras.optimizers.RMSprop(0.1, rho=0.9, momentum=momentum, centered=centered)
    config = torch_optimizer_config(keras_opt)
    param = torch.nn.Parameter(start.clone())
    server_opt = optimizer_class(config["class"])([param], **config["hyper"])
    for g in grads:
        keras_opt.apply([g.clone()], [variable])
        param.grad = g.clone()
        server_opt.step()
    keras_value = torch.as_tensor(np.asarray(variable.value.detach().cpu()))
    assert torch.allclose(param.detach(), keras_value, atol=1e-6), (param, keras_value)


def _embedding_classifier():
    """The parameter-server tutorial's custom-loop model, narrower: mean of 3 embeddings -> logit."""
    ids = keras.layers.Input(shape=(3,), dtype="int64", name="features")
    mean = keras.ops.mean(keras.layers.Embedding(8, 256)(ids), axis=1)
    logit = keras.layers.Dense(1, kernel_regularizer=keras.regularizers.L2(1e-4))(mean)
    return keras.Model({"features": ids}, logit)


_OPTIMIZERS = {"rmsprop": lambda: keras.optimizers.RMSprop(learning_rate=0.1), "sgd": lambda: keras.optimizers.SGD(2.0)}


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_custom_loop_with_keras_optimizer_and_metric_equals_one_device_step_for_step(name):
    """The tutorial's custom loop (issue 16) on one worker equals the same loop in one process.

    A scheduled step_fn calls a Keras optimizer's apply_gradients (the tutorial's RMSprop(0.1);
    SGD, which unlike RMSprop is not blind to the gradients' scale) and updates a Keras metric
    created in scope; the embedding is split over both servers. Equal losses, weights and accuracy
    rule out, for that loop, wrongly scaled gradients (compute_average_loss), stale variable reads,
    optimizer state kept off the servers, a learning rate applied twice and a metric misread on
    the chief.
    """
    from phalanx import ReduceOp, nn
    from phalanx.experimental import partitioners

    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(7, generator=g)[:3] + 1 for _ in range(96)])
    labels = (ids == 1).any(1, keepdim=True).long()  # "avenger" among the features
    batches = [({"features": ids[i : i + 32]}, labels[i : i + 32]) for i in (0, 32, 64, 0, 32, 64)]
    bce = keras.losses.BinaryCrossentropy(from_logits=True, reduction=None)
    partitioner = partitioners.MinSizePartitioner(min_shard_bytes=1024, max_shards=2)
    with InProcessCluster(num_ps=2, num_workers=1, variable_partitioner=partitioner) as cluster:
        strategy = cluster.strategy
        with strategy.scope():
            model = _embedding_classifier()
            optimizer = _OPTIMIZERS[name]()
            accuracy = keras.metrics.Accuracy()
        reference = _embedding_classifier()
        reference.set_weights(model.get_weights())
        ref_optimizer, ref_accuracy = _OPTIMIZERS[name](), keras.metrics.Accuracy()

        def step_fn(iterator):
            def replica_fn(batch_data, y):
                logits = model(batch_data, training=True)
                loss = nn.compute_average_loss(bce(y, logits)) + nn.scale_regularization_loss(sum(model.losses))
                model.zero_grad()
                loss.backward()
                optimizer.apply_gradients(
                    zip([v.value.grad for v in model.trainable_variables], model.trainable_variables)
                )
                accuracy.update_state(y, (keras.ops.sigmoid(logits) > 0.5).long())
                return loss

            batch_data, y = next(iterator)
            return strategy.reduce(ReduceOp.SUM, strategy.run(replica_fn, args=(batch_data, y)), axis=None)

        coordinator = cluster.coordinator()
        iterator = iter(coordinator.create_per_worker_dataset(lambda: iter(batches)))
        for batch_data, y in batches:
            got = float(coordinator.schedule(step_fn, args=(iterator,)).fetch())
            logits = reference(batch_data, training=True)
            loss = bce(y, logits).mean() + sum(reference.losses)
            reference.zero_grad()
            loss.backward()
            ref_optimizer.apply_gradients(
                zip([v.value.grad for v in reference.trainable_variables], reference.trainable_variables)
            )
            ref_accuracy.update_state(y, (keras.ops.sigmoid(logits) > 0.5).long())
            assert got == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
        coordinator.join()
        assert [v.shape[0] for v in strategy.extended.variables[0].variables] == [4, 4]  # the embedding's 2 shards
        for got_w, want_w in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-5)
        assert float(accuracy.result()) == pytest.approx(float(ref_accuracy.result()))
    learned = float(((reference({"features": ids}) > 0).long() == labels).float().mean())
    assert learned > 0.9, learned  # both learn this in 6 steps


def test_tutorial_loss_takes_the_logits_as_tf_does():
    """The premise of the PS tutorial's note 6 (examples/tutorials/parameter_server_training.py):
    on a saturated sigmoid output predicted wrong, Keras 3's torch BinaryCrossentropy on the
    probabilities has no gradient (it clips them); on the logits it has TF's, sigmoid(z) - y. If
    Keras starts taking the logits itself (as its TF backend does), this fails and the tutorial can
    go back to the tutorial's own loss."""
    label = torch.zeros(1, 1)
    logit = torch.full((1, 1), 30.0, requires_grad=True)
    keras.losses.BinaryCrossentropy()(label, keras.activations.sigmoid(logit)).backward()
    assert logit.grad.item() == 0.0
    logit.grad = None
    keras.losses.BinaryCrossentropy(from_logits=True)(label, logit).backward()
    assert logit.grad.item() == pytest.approx(1.0)
