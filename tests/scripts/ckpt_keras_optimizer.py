"""Restoring a Keras optimizer from a Checkpoint: what exists at once, the slots when created.

Usage: python ckpt_keras_optimizer.py OUT_DIR   (starts its second replica itself)

A Keras model and Adam train K steps, are saved with ``phalanx.checkpoint.Checkpoint(optimizer=...,
model=...)``, and train one step more (the uninterrupted run). Fresh models and optimizers then
restore the checkpoint:

* ``unbuilt``: a fresh, unbuilt optimizer; read right after ``restore()``, then built explicitly;
* ``continued``: a fresh, unbuilt optimizer, then the steps from ``optimizer.iterations`` to K+1
  (a resuming loop; its first apply builds the optimizer);
* ``lr_set``: a fresh, unbuilt optimizer whose learning rate is set after the restore, then a step;
* ``built``: an optimizer built before the restore, then the same resuming loop.

All of it runs once without a strategy (in replica 0's process, before the strategy starts the
other) and once under MirroredStrategy on 2 CPU replicas. Each process writes
``OUT_DIR/ckpt_keras_{rank}.json``: ``{"mirrored": {...}}``, and replica 0 ``"none"`` too.
"""

import contextlib
import json
import os
import sys
import tempfile

os.environ.setdefault("KERAS_BACKEND", "torch")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import phalanx as px  # noqa: E402
import phalanx.checkpoint  # noqa: E402

OUT = sys.argv[1]
K, GLOBAL_BATCH, FEATURES, CLASSES, LR, FRESH_LR, NEW_LR = 3, 8, 6, 3, 0.05, 0.2, 0.01
rng = np.random.default_rng(0)
X = rng.normal(size=((K + 1) * GLOBAL_BATCH, FEATURES)).astype("float32")
Y = rng.integers(0, CLASSES, size=(K + 1) * GLOBAL_BATCH)
W0 = [rng.normal(scale=0.5, size=s).astype("float32") for s in [(FEATURES, 4), (4,), (4, CLASSES), (CLASSES,)]]
loader = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.as_tensor(X), torch.as_tensor(Y)), batch_size=GLOBAL_BATCH
)
loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def listed(variables):
    return [np.asarray(v.value.detach().cpu(), dtype=np.float64).tolist() for v in variables]


def scenarios(strategy, directory):
    batches = list(strategy.experimental_distribute_dataset(loader)) if strategy is not None else list(loader)

    def make(built=False, learning_rate=LR):
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            model = keras.Sequential(
                [keras.Input((FEATURES,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(CLASSES)]
            )
            model.set_weights(W0)
            optimizer = keras.optimizers.Adam(learning_rate)
            if built:
                optimizer.build(model.trainable_variables)
        return model, optimizer

    def train(model, optimizer, batch):
        def step(inputs):
            x, y = inputs
            loss = px.nn.compute_average_loss(loss_object(y, model(x)), global_batch_size=GLOBAL_BATCH)
            model.zero_grad()
            loss.backward()
            optimizer.apply([v.value.grad for v in model.trainable_variables], model.trainable_variables)

        if strategy is None:
            step(batch)
        else:
            strategy.run(step, args=(batch,))

    def state(model, optimizer):
        return {
            "iterations": int(optimizer.iterations),
            "learning_rate": float(optimizer.learning_rate),
            "slots": listed(optimizer.variables[2:]),
            "weights": listed(model.weights),
        }

    rec = {}
    model, optimizer = make()
    for batch in batches[:K]:
        train(model, optimizer, batch)
    path = phalanx.checkpoint.Checkpoint(optimizer=optimizer, model=model).save(os.path.join(directory, "ckpt"))
    rec["saved"] = state(model, optimizer)
    train(model, optimizer, batches[K])
    rec["uninterrupted"] = state(model, optimizer)

    def restored(built=False):
        model, optimizer = make(built, FRESH_LR)  # the saved learning rate replaces FRESH_LR
        status = phalanx.checkpoint.Checkpoint(optimizer=optimizer, model=model).restore(path)
        return model, optimizer, status

    model, optimizer, status = restored()
    rec["unbuilt"] = {"at_once": state(model, optimizer), "pending": status.pending}
    optimizer.build(model.trainable_variables)
    rec["unbuilt"]["created"] = state(model, optimizer)

    model, optimizer, _ = restored()
    # A resuming loop as TF programs write it: it starts where the restored count says.
    for batch in batches[int(optimizer.iterations) : K + 1]:
        train(model, optimizer, batch)
    rec["continued"] = state(model, optimizer)

    model, optimizer, _ = restored()
    optimizer.learning_rate = NEW_LR  # set by the user between the restore and the first step
    train(model, optimizer, batches[K])
    rec["lr_set"] = state(model, optimizer)

    model, optimizer, status = restored(built=True)
    rec["built"] = {"at_once": state(model, optimizer), "pending": status.pending}
    for batch in batches[int(optimizer.iterations) : K + 1]:
        train(model, optimizer, batch)
    rec["built"]["continued"] = state(model, optimizer)
    return rec


# Without a strategy: in the process the job starts with (replica 0; the other replica is started
# by the strategy below, and a process of a multi-process job refuses to save without one).
results = {"none": scenarios(None, tempfile.mkdtemp(prefix="ckpt_keras_"))} if px.process_index() == 0 else {}
strategy = px.MirroredStrategy(["cpu:0", "cpu:1"])
results["mirrored"] = scenarios(strategy, os.path.join(OUT, "mirrored"))
with open(os.path.join(OUT, f"ckpt_keras_{strategy.extended.process_index}.json"), "w") as f:
    json.dump(results, f)
