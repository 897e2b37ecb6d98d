"""A Keras custom training loop (TF's custom-training tutorial) under CentralStorage x2, Mirrored x2, one device.

Usage: python keras_custom_loop_central.py OUT_DIR   (starts its second replica itself)

The same model (the same initial weights), data and global batch train K steps three times: under
CentralStorageStrategy on 2 CPU replicas, under MirroredStrategy on the same two processes, and
without a strategy on the whole global batch. Gradients come from torch autograd; the steps
alternate ``optimizer.apply_gradients(zip(grads, vars))`` and ``optimizer.apply(grads, vars)``.
Each process writes ``OUT_DIR/{kind}_{rank}.npz`` (weights) and ``.json`` (losses, iterations,
accuracy) per kind: central, mirrored, none.
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import phalanx as px  # noqa: E402

OUT = sys.argv[1]
K, GLOBAL_BATCH, FEATURES, CLASSES = 4, 8, 6, 3
rng = np.random.default_rng(0)
X = rng.normal(size=(K * GLOBAL_BATCH, FEATURES)).astype("float32")
Y = rng.integers(0, CLASSES, size=K * GLOBAL_BATCH)
SHAPES = [(FEATURES, 5), (5,), (5, CLASSES), (CLASSES,)]
W0 = [rng.normal(scale=0.5, size=s).astype("float32") for s in SHAPES]
loader = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.as_tensor(X), torch.as_tensor(Y)), batch_size=GLOBAL_BATCH
)


def train(kind, strategy):
    scope = strategy.scope() if strategy is not None else px.get_strategy().scope()
    with scope:
        model = keras.Sequential(
            [keras.Input((FEATURES,)), keras.layers.Dense(5, activation="relu"), keras.layers.Dense(CLASSES)]
        )
        model.set_weights(W0)
        optimizer = keras.optimizers.Adam(0.01)
        accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    calls = []

    def train_step(inputs):
        images, labels = inputs
        predictions = model(images, training=True)
        loss = px.nn.compute_average_loss(loss_object(labels, predictions), global_batch_size=GLOBAL_BATCH)
        model.zero_grad()
        loss.backward()
        gradients = [v.value.grad for v in model.trainable_variables]
        if len(calls) % 2 == 0:
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        else:
            optimizer.apply(gradients, model.trainable_variables)
        calls.append(1)
        accuracy.update_state(labels, predictions)
        return loss

    losses = []
    if strategy is None:
        rank = 0
        for batch in loader:
            losses.append(float(train_step(batch).detach()))
    else:
        rank = strategy.extended.process_index
        for batch in strategy.experimental_distribute_dataset(loader):
            per_replica = strategy.run(train_step, args=(batch,))
            losses.append(float(strategy.reduce(px.ReduceOp.SUM, per_replica, axis=None)))
    rank = px.process_index() if strategy is None else rank
    np.savez(os.path.join(OUT, f"{kind}_{rank}.npz"), *model.get_weights())
    record = {"losses": losses, "iterations": int(optimizer.iterations), "accuracy": float(accuracy.result())}
    with open(os.path.join(OUT, f"{kind}_{rank}.json"), "w") as f:
        json.dump(record, f)
    print(kind, rank, record, flush=True)


train("central", px.CentralStorageStrategy(["cpu:0", "cpu:1"]))
train("mirrored", px.MirroredStrategy(["cpu:0", "cpu:1"]))
train("none", None)
