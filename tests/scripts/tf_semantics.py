"""TF semantics a ported program relies on, checked on 2 real replica processes (MirroredStrategy).

Usage: python tf_semantics.py OUT_DIR   (starts its second replica itself)
Each check is independent: a failure is recorded (as the exception's type and text) and the
script goes on, so one run reports every check. Writes OUT_DIR/sem_<rank>.json.
"""

import json
import os
import random
import sys
import traceback

os.environ.setdefault("KERAS_BACKEND", "torch")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import phalanx as px  # noqa: E402
import phalanx.keras  # noqa: E402,F401

out = sys.argv[1]
strategy = px.MirroredStrategy(["cpu:0", "cpu:1"])
rank = strategy.extended.process_index
# Each process's own random state differs, as in any unseeded program.
torch.manual_seed(1000 + rank)
np.random.seed(1000 + rank)
random.seed(1000 + rank)
res = {}


def check(name):
    def deco(fn):
        try:
            res[name] = fn()
        except Exception as e:  # noqa: BLE001 - recorded for the test to assert on
            res[name] = {"error": type(e).__name__, "text": str(e)[:500], "tb": traceback.format_exc()[-1500:]}
        return fn

    return deco


@check("ordering")
def _():
    # The input tutorial's recipe: Dataset.range(24).enumerate().batch(6), outputs put back in order.
    data = [(torch.arange(i, i + 6), torch.arange(i, i + 6)) for i in range(0, 24, 6)]
    dist_dataset = strategy.experimental_distribute_dataset(data)

    def predict(index, inputs):
        return index, 2 * inputs

    result = {}
    for index, inputs in dist_dataset:
        output_index, outputs = strategy.run(predict, args=(index, inputs))
        rindices = [i for a in strategy.experimental_local_results(output_index) for i in a.numpy()]
        routputs = [o for a in strategy.experimental_local_results(outputs) for o in a.numpy()]
        for i, value in zip(rindices, routputs):
            result[int(i)] = int(value)
    return result


@check("shuffle")
def _():
    # An unseeded shuffling DataLoader: every process must slice the same global batches.
    ds = torch.utils.data.TensorDataset(torch.arange(32, dtype=torch.float32))
    loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True)
    epochs = []
    for _ in range(3):
        rows = []
        for (x,) in strategy.experimental_distribute_dataset(loader):
            rows.append(strategy.gather(strategy.run(lambda t: t, args=(x,)), axis=0).tolist())
        epochs.append(rows)
    # The processes' own random streams were given back: they still differ.
    own = float(torch.rand(1))
    return {"epochs": epochs, "own_random": own}


@check("lazy_shuffle")
def _():
    # A generator that shuffles lazily with numpy's global stream (the input tutorial's from_generator):
    # every batch is drawn with the chief's seed, so the global batches agree.
    def batches():
        order = np.arange(16)
        for _ in range(4):
            np.random.shuffle(order)
            yield torch.as_tensor(order[:4].copy(), dtype=torch.float32)

    return [
        strategy.gather(strategy.run(lambda t: t, args=(x,)), axis=0).tolist()
        for x in strategy.experimental_distribute_dataset(batches())
    ]


@check("mismatch")
def _():
    # A generator with its own unseeded generator (OS entropy): cannot be aligned, must be detected.
    def batches():
        rng = np.random.default_rng()
        for _ in range(3):
            yield torch.as_tensor(rng.permutation(16)[:4], dtype=torch.float32)

    for x in strategy.experimental_distribute_dataset(batches()):
        strategy.run(lambda t: t, args=(x,))
    return "no error"


@check("lazy_model")
def _():
    # The custom_training tutorial's model has no input shape: built by its first call, inside run.
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
        optimizer = keras.optimizers.Adam(learning_rate=0.05)
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        accuracy = keras.metrics.SparseCategoricalAccuracy()
        mean_loss = keras.metrics.Mean()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 5, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()

    def train_step(inputs):
        xb, yb = inputs
        logits = model(xb)
        loss = px.nn.compute_average_loss(loss_object(yb, logits), global_batch_size=16)
        optimizer.zero_grad() if hasattr(optimizer, "zero_grad") else None
        model.zero_grad()
        loss.backward()
        optimizer.apply([v.value.grad for v in model.trainable_variables], model.trainable_variables)
        accuracy.update_state(yb, logits)
        mean_loss.update_state(loss_object(yb, logits))
        return loss

    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    for batch in strategy.experimental_distribute_dataset(batches):
        strategy.run(train_step, args=(batch,))
    flat = torch.cat([v.value.detach().reshape(-1) for v in model.weights])
    checksums = strategy.gather(strategy.run(lambda: flat.double().sum().reshape(1)), axis=0).tolist()
    # The global metric values equal those computed from everything, on one device.
    local_count = float(accuracy.variables[1].value)  # this replica's own count, kept
    return {
        "checksums": checksums,
        "accuracy": float(accuracy.result()),
        "mean_loss": float(mean_loss.result()),
        "local_count": local_count,
        "count_after": float(accuracy.variables[1].value),
        "x_checksum": float(x.sum()),
    }


@check("save")
def _():
    path = os.path.join(out, "model.keras")
    wpath = os.path.join(out, "w.weights.h5")
    with strategy.scope():
        model = keras.Sequential([keras.Input((200,)), keras.layers.Dense(300), keras.layers.Dense(50)])
    for _ in range(3):  # several rounds: a race shows up as a corrupt zip or a FileExistsError
        model.save(path)
        model.save_weights(wpath)
        # Every replica reads the file right after save returned: it must be complete.
        restored = keras.saving.load_model(path)
        assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), restored.get_weights()))
        model.load_weights(wpath)
    return "ok"


@check("reduce_to")
def _():
    with strategy.scope():
        holder = torch.nn.Module()
        holder.v = torch.nn.Parameter(torch.zeros(2))  # registered on a module: captured
        v = holder.v
    outside = torch.nn.Linear(2, 2).weight
    per_replica = strategy.run(lambda: torch.tensor([1.0, float(rank)]))
    summed = strategy.extended.reduce_to("SUM", per_replica, destinations=v)
    a, b = strategy.extended.batch_reduce_to("MEAN", [(per_replica, v), (per_replica, v)])
    strategy.extended.update(v, lambda var, t: var.add_(t), args=(summed,))
    return {
        "sum": summed.tolist(),
        "mean": a.tolist(),
        "v": v.detach().tolist(),
        "created": strategy.extended.variable_created_in_scope(v),
        "outside": strategy.extended.variable_created_in_scope(outside),
    }


with open(os.path.join(out, f"sem_{rank}.json"), "w") as f:
    json.dump(res, f)
