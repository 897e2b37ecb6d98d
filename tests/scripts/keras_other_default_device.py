"""Keras whose default device is not the replicas' (as on a GPU host with CPU replicas).

Keras on the torch backend makes its tensors on the GPU whenever one exists. Here its default is
the meta device (which holds no data) standing in for that GPU: every tensor the strategy's
replicas make through Keras must still land on their CPU. Usage:
``python keras_other_default_device.py OUT.json STRATEGY`` (``one_device`` or ``mirrored``, the
latter under ``phalanx run -n 2`` or self-launched).
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import phalanx as px  # noqa: E402
import phalanx.keras  # noqa: E402,F401

out, kind = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(0)
X = rng.normal(size=(64, 8)).astype("float32")
Y = rng.integers(0, 3, size=64)


def build():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["sparse_categorical_accuracy"],
    )
    return model


reference = build()  # on the CPU, Keras' own default here
reference.fit(X, Y, epochs=2, batch_size=16, shuffle=False, verbose=0)
expected = reference.get_weights()

with keras.device("meta"):  # from here on Keras' default device is not the replicas'
    strategy = px.OneDeviceStrategy("cpu") if kind == "one_device" else px.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = build()
    history = model.fit(X, Y, epochs=2, batch_size=16, shuffle=False, verbose=0)
    evaluated = model.evaluate(X, Y, batch_size=16, verbose=0)
    made_in_run = strategy.run(lambda: keras.ops.ones((2,)))
    with strategy.scope():  # outside it, Keras copies a variable to its default device on reading
        weights = sorted({str(w.value.device) for w in model.weights + model.optimizer.variables})
        trained = model.get_weights()
    result = {
        "weights": weights,
        "made_in_run": str(strategy.experimental_local_results(made_in_run)[0].device),
        "worst": max(float(np.abs(a - b).max()) for a, b in zip(trained, expected)),
        "loss": history.history["loss"],
        "evaluated": evaluated,
        "outside": str(keras.ops.ones((1,)).device),
    }
if strategy.extended.process_index == 0:
    with open(out, "w") as f:
        json.dump(result, f)
