"""Keras compile / fit / evaluate / predict under FullyShardedStrategy against one-device Keras (issue 32).

Usage: python sharded_keras.py OUT_DIR MODE        (MODE: reference | sharded | plain, in that order)

``reference`` runs every case with plain Keras in this process; ``sharded`` on two CPU replicas.
Each case writes, from the chief, ``OUT_DIR/{mode}_{case}.npz`` (the weights from
``get_weights``, the predictions) and ``.json`` (History, evaluate); every replica writes
``OUT_DIR/{mode}_{case}_local_{rank}.json``: the elements of trainable weights and optimizer
slots it holds itself.

Cases: SGD with momentum and L2 regularisation on a Sequential whose last batch splits 3/2
(unequal shares of the global batch); Adam on a functional model with an Embedding and
validation_split; AdamW with a BatchNormalization layer (its statistics stay whole: compared for
consistency across replicas only) and set_weights before fit. After the SGD case, ``model.save``
(every replica calls it) writes OUT_DIR/{mode}_sgd.keras, and under the strategy a fit with a
ModelCheckpoint is refused: each replica writes the error to OUT_DIR/{mode}_refused_{rank}.txt.
After the Adam case a phalanx Checkpoint of the model (its optimizer with it) is written to
OUT_DIR/{mode}_adam_ckpt; then a fresh model restores a checkpoint and trains one epoch more
(:func:`continue_from_checkpoint`): ``reference`` its own, ``sharded`` the reference's (one device
-> two shards), ``plain`` (plain Keras, this case only) the sharded one (two shards -> one device).
"""

import contextlib
import faulthandler
import json
import os
import sys

from phalanx.config import stack_signal  # PHALANX_STACK_SIGNAL, as the test harness sends

faulthandler.register(stack_signal(), all_threads=True)
os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import phalanx as px  # noqa: E402
import phalanx.keras  # noqa: E402,F401
from phalanx.checkpoint import Checkpoint  # noqa: E402

keras.config.disable_traceback_filtering()

from keras_equivalence import CLASSES, FEATURES, data  # noqa: E402 - the Mirrored Keras tests' data

SEED, GLOBAL_BATCH = 77, 20


X_TEST, Y_TEST = data(41, 7)  # the last batch of evaluate and predict has one row


def case_sgd():
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(48, activation="tanh", kernel_regularizer=keras.regularizers.L2(1e-3)),
            keras.layers.Dense(CLASSES, activation="softmax"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="sparse_categorical_crossentropy", metrics=["accuracy"]
    )
    x, y = data(125, 1)  # 6 batches of 20 and one of 5: split 3/2 between the replicas
    return model, lambda: model.fit(x, y, epochs=2, batch_size=GLOBAL_BATCH, verbose=0)


def case_adam():
    tokens = keras.Input((4,), dtype="int64")
    dense = keras.Input((FEATURES,))
    embedded = keras.layers.Flatten()(keras.layers.Embedding(50, 6)(tokens))
    hidden = keras.layers.Dense(32, activation="relu")(keras.layers.Concatenate()([embedded, dense]))
    model = keras.Model([tokens, dense], keras.layers.Dense(CLASSES, activation="softmax")(hidden))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x, y = data(120, 2)
    ids = (np.abs(x[:, :4]) * 10).astype("int64") % 50
    test_ids = (np.abs(X_TEST[:, :4]) * 10).astype("int64") % 50
    model._phalanx_test_inputs = [test_ids, X_TEST]
    model._phalanx_train = ([ids, x], y)
    return model, lambda: model.fit([ids, x], y, epochs=2, batch_size=GLOBAL_BATCH, validation_split=0.25, verbose=0)


def case_adamw_batchnorm():
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(24),
            keras.layers.BatchNormalization(),
            keras.layers.Activation("relu"),
            keras.layers.Dense(CLASSES, activation="softmax"),
        ]
    )
    model.compile(optimizer=keras.optimizers.AdamW(1e-2, weight_decay=0.05), loss="sparse_categorical_crossentropy")
    # set_weights with whole values: each replica keeps its shard of them.
    rng = np.random.default_rng(SEED)
    chosen = [np.abs(rng.normal(scale=0.3, size=w.shape)).astype(w.dtype) for w in model.get_weights()]
    model.set_weights(chosen)
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), chosen)), "set_weights did not hold"
    x, y = data(100, 3)
    return model, lambda: model.fit(x, y, epochs=1, batch_size=GLOBAL_BATCH, verbose=0)


CASES = {"sgd": case_sgd, "adam": case_adam, "adamw_batchnorm": case_adamw_batchnorm}


def local_elements(model):
    """Elements of trainable weights and optimizer slots this process holds itself."""

    def local(t):
        return t.to_local().numel() if hasattr(t, "to_local") else t.numel()

    weights = sum(local(v.value) for v in model.trainable_weights)
    slots = sum(local(v.value) for v in model.optimizer.variables if len(v.shape) > 0)
    return {"weights": weights, "slots": slots, "whole": sum(int(np.prod(v.shape)) for v in model.trainable_weights)}


def run_case(name, out, mode, strategy):
    rank = 0 if strategy is None else strategy.extended.process_index
    keras.utils.set_random_seed(SEED + 1000 * rank)  # replicas start from other weights: the chief's must win
    if strategy is None:
        model, fit = CASES[name]()
    else:
        with strategy.scope():
            model, fit = CASES[name]()
    history = fit()
    test_inputs = getattr(model, "_phalanx_test_inputs", X_TEST)
    evaluation = model.evaluate(test_inputs, Y_TEST, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
    predictions = model.predict(test_inputs, batch_size=GLOBAL_BATCH, verbose=0)
    weights = model.get_weights()  # collective under FullyShardedStrategy: every replica gathers
    with open(os.path.join(out, f"{mode}_{name}_local_{rank}.json"), "w") as f:
        json.dump(local_elements(model), f)
    if rank == 0:
        np.savez(os.path.join(out, f"{mode}_{name}.npz"), *weights, predictions=predictions)
        with open(os.path.join(out, f"{mode}_{name}.json"), "w") as f:
            json.dump({"history": history.history, "evaluate": evaluation}, f)
    if name == "adam":  # every replica writes its shards (sharded) or the chief the whole (reference)
        Checkpoint(model=model).write(os.path.join(out, f"{mode}_adam_ckpt"))
    if name == "sgd":
        model.save(os.path.join(out, f"{mode}_{name}.keras"))  # every replica calls it; the chief writes
        if strategy is not None:
            # A writing callback on the chief alone would gather alone: refused, typed.
            try:
                x, y = data(40, 9)
                model.fit(
                    x,
                    y,
                    batch_size=GLOBAL_BATCH,
                    verbose=0,
                    callbacks=[keras.callbacks.ModelCheckpoint(os.path.join(out, "never.keras"))],
                )
            except px.errors.ShardingError as e:
                with open(os.path.join(out, f"{mode}_refused_{rank}.txt"), "w") as f:
                    f.write(str(e))
    if name == "adamw_batchnorm" and strategy is not None:
        # The statistics stay whole on every replica: the same everywhere.
        stats = torch.cat([torch.as_tensor(np.asarray(w)).reshape(-1) for w in weights])
        gathered = strategy.extended.all_gather(stats[None], 0)
        assert torch.equal(gathered[0], gathered[-1]), "replicas disagree after fit"


# Where each mode's continued Adam training restores from: one device -> sharded, sharded -> one device.
RESTORE_FROM = {"reference": "reference", "sharded": "reference", "plain": "sharded"}


def continue_from_checkpoint(out, mode, strategy):
    """A fresh Adam model restores RESTORE_FROM[mode]'s checkpoint (weights, and the optimizer's
    slots when it builds them) and trains one more epoch; the chief writes {mode}_adam_continued.npz."""
    keras.utils.set_random_seed(SEED + 1)  # the fresh model's own weights are overwritten
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model, _ = case_adam()
    Checkpoint(model=model).read(os.path.join(out, f"{RESTORE_FROM[mode]}_adam_ckpt"))
    inputs, y = model._phalanx_train
    model.fit(inputs, y, epochs=1, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
    weights = model.get_weights()
    if strategy is None or strategy.extended.process_index == 0:
        np.savez(os.path.join(out, f"{mode}_adam_continued.npz"), *weights)


def custom_loop(out, mode, strategy):
    """TF's custom training loop shape: a Keras model and optimizer built in scope, the step in
    ``strategy.run`` with ``compute_average_loss``; the chief writes {mode}_custom.npz (weights)."""
    strategy = strategy or px.get_strategy()  # reference: the default strategy, one device
    keras.utils.set_random_seed(SEED + 2 + 1000 * strategy.extended.process_index)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((FEATURES,)), keras.layers.Dense(24, activation="tanh"), keras.layers.Dense(CLASSES)]
        )
        optimizer = keras.optimizers.Adam(1e-2)
    x, y = data(80, 5)
    batches = [
        (torch.from_numpy(x[i : i + GLOBAL_BATCH]), torch.from_numpy(y[i : i + GLOBAL_BATCH]))
        for i in range(0, 80, GLOBAL_BATCH)
    ]

    def step(xb, yb):
        per_example = torch.nn.functional.cross_entropy(model(xb), yb, reduction="none")
        loss = px.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        model.zero_grad()
        loss.backward()
        optimizer.apply([v.value.grad for v in model.trainable_weights], model.trainable_weights)
        return loss.detach()

    for _ in range(2):
        for xb, yb in strategy.experimental_distribute_dataset(batches):
            strategy.run(step, args=(xb, yb))
    weights = model.get_weights()
    if strategy.extended.process_index == 0:
        np.savez(os.path.join(out, f"{mode}_custom.npz"), *weights)


def main():
    out, mode = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    strategy = None if mode in ("reference", "plain") else px.FullyShardedStrategy(["cpu:0", "cpu:1"])
    try:
        for name in CASES if mode != "plain" else ():
            run_case(name, out, mode, strategy)
        if mode != "plain":
            custom_loop(out, mode, strategy)
        continue_from_checkpoint(out, mode, strategy)
    except px.errors.ShardingError as e:
        if "Keras >= 3.7" not in str(e):
            raise
        with open(os.path.join(out, f"old_keras_refused_{strategy.extended.process_index}.txt"), "w") as f:
            f.write(str(e))  # Keras 3.6: refused, typed (the test checks it)
    print("DONE", mode, flush=True)


if __name__ == "__main__":
    main()
