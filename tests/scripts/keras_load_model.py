"""TF's resume workflow: ``load_model`` of a compiled ``.keras`` file inside ``strategy.scope()``,
then ``fit`` goes on with the saved optimizer state (Adam's moments and its iteration count).

Usage: python keras_load_model.py OUT_DIR [mirrored|sharded]   (starts its second replica itself)

Replica 0's process first trains a compiled model for 2 epochs on one device, saves it to
``OUT_DIR/model.keras``, and trains it 2 epochs more (the uninterrupted run). Then, under
MirroredStrategy (or FullyShardedStrategy) on 2 CPU replicas, each replica loads the file in scope and trains the same 2
epochs. Each process writes ``OUT_DIR/load_model_{rank}.json`` (replica 0 with the reference).
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")
import keras  # noqa: E402
import numpy as np  # noqa: E402

import phalanx as px  # noqa: E402

OUT = sys.argv[1]
KIND = sys.argv[2] if len(sys.argv) > 2 else "mirrored"
PATH = os.path.join(OUT, "model.keras")
rng = np.random.default_rng(0)
X = rng.normal(size=(96, 8)).astype("float32")
Y = rng.integers(0, 3, size=96)


def record(model, history):
    return {
        "weights": [w.tolist() for w in model.get_weights()],
        # numpy(): whole values, also of a sharded slot (a collective there: every replica reads them)
        "optimizer": [np.asarray(v.numpy()).tolist() for v in model.optimizer.variables],
        "iterations": int(model.optimizer.iterations.value),
        "loss": history.history["loss"],
    }


reference = {}
if px.process_index() == 0:
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.SparseCategoricalCrossentropy(True))
    model.fit(X, Y, epochs=2, batch_size=32, shuffle=False, verbose=0)
    model.save(PATH)
    saved_iterations = int(model.optimizer.iterations.value)
    history = model.fit(X, Y, epochs=2, batch_size=32, shuffle=False, verbose=0)
    reference = {**record(model, history), "saved_iterations": saved_iterations}

strategy = (px.MirroredStrategy if KIND == "mirrored" else px.FullyShardedStrategy)(["cpu:0", "cpu:1"])
with strategy.scope():
    loaded = keras.models.load_model(PATH)
restored_iterations = int(loaded.optimizer.iterations.value)
history = loaded.fit(X, Y, epochs=2, batch_size=32, shuffle=False, verbose=0)
result = {**record(loaded, history), "restored_iterations": restored_iterations, "reference": reference}
with open(os.path.join(OUT, f"load_model_{strategy.extended.process_index}.json"), "w") as f:
    json.dump(result, f)
