"""Keras fit / evaluate / predict under a strategy, for comparison with one-device Keras.

Usage: python keras_equivalence.py OUT_DIR MODE      (MODE: reference | mirrored | central_storage | mwms,
or several separated by commas: reference,mirrored,central_storage)

``reference`` runs every case with plain Keras (no strategy) and again under OneDeviceStrategy;
``mirrored`` and ``central_storage`` run them on 2 CPU replicas; ``mwms`` under
MultiWorkerMirroredStrategy (TF_CONFIG).
Each case writes ``{prefix}_{case}_{rank}.npz`` (weights, predictions) and ``.json`` (History,
evaluate). Cases: an SGD-with-momentum Sequential with L2 regularisation whose last batch has one
row (replicas without rows); an Adam functional model with validation_split; a lazily built
subclassed model fitted on a torch DataLoader with validation_data; a PyDataset; a Sequential
without input shape, adapted with ``phalanx.keras.distribute``; fine-tuning (a frozen base
unfrozen for a second fit); and a BatchNormalization model
(only replica consistency is checked for it: each replica normalises with its own batch's statistics).
"""

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

SEED, FEATURES, CLASSES, GLOBAL_BATCH = 1234, 12, 3, 32


def data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = (x[:, :3].sum(1) > 0).astype("int64") + (x[:, 3] > 1).astype("int64")
    return x, y


X_TEST, Y_TEST = data(101, 7)  # 101 rows, batches of 20: the last batch has one row


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(24, activation="tanh")
        self.out = keras.layers.Dense(CLASSES, activation="softmax")

    def call(self, x):
        return self.out(self.hidden(x))


class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch):
        super().__init__()
        self.x, self.y, self.batch = x, y, batch

    def __len__(self):
        return -(-len(self.x) // self.batch)

    def __getitem__(self, i):
        s = slice(i * self.batch, (i + 1) * self.batch)
        return self.x[s], self.y[s]


def case_sgd():
    model = keras.Sequential(
        [
            keras.layers.Dense(
                32, activation="relu", input_shape=(FEATURES,), kernel_regularizer=keras.regularizers.L2(1e-3)
            ),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(CLASSES, activation="softmax"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="sparse_categorical_crossentropy", metrics=["accuracy"]
    )
    x, y = data(257, 1)  # 8 batches of 32 and one of 1
    return model, lambda: model.fit(x, y, epochs=1, batch_size=GLOBAL_BATCH, shuffle=True, verbose=0)


def case_adam():
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(CLASSES, activation="softmax")(hidden))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x, y = data(250, 2)
    return model, lambda: model.fit(x, y, epochs=1, batch_size=GLOBAL_BATCH, validation_split=0.2, verbose=0)


def case_subclassed_dataloader():
    model = Subclassed()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x, y = data(250, 3)
    xv, yv = data(45, 4)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=GLOBAL_BATCH, shuffle=True
    )
    return model, lambda: model.fit(loader, epochs=1, validation_data=(xv, yv), verbose=0)


def case_pydataset():
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(CLASSES, activation="softmax"),
        ]
    )
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x, y = data(230, 5)
    return model, lambda: model.fit(Batches(x, y, 25), epochs=2, shuffle=True, verbose=0)


def case_lazy_sequential():
    # Nothing is built in scope (no input shape): phalanx.keras.distribute() adapts it explicitly.
    model = keras.Sequential(
        [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(CLASSES, activation="softmax")]
    )
    if px.has_strategy():
        phalanx.keras.distribute(model)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x, y = data(100, 8)
    return model, lambda: model.fit(x, y, epochs=1, batch_size=GLOBAL_BATCH, verbose=0)


def case_batchnorm():
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16),
            keras.layers.BatchNormalization(),
            keras.layers.Activation("relu"),
            keras.layers.Dense(CLASSES, activation="softmax"),
        ]
    )
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x, y = data(200, 6)
    return model, lambda: model.fit(x, y, epochs=1, batch_size=GLOBAL_BATCH, verbose=0)


def case_accumulate_sgd():
    # Keras 3's own gradient accumulation: every 3rd step applies the mean of 3 batches' gradients
    # (the last step, a batch of one row, only accumulates).
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(CLASSES, activation="softmax"),
        ]
    )
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=3)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x, y = data(257, 9)  # 8 batches of 32 and one of 1
    return model, lambda: model.fit(x, y, epochs=1, batch_size=GLOBAL_BATCH, verbose=0)


def case_accumulate_adam():
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(24, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(CLASSES, activation="softmax")(hidden))
    optimizer = keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x, y = data(224, 10)  # 7 batches: 3 updates, the last batch only accumulates
    return model, lambda: model.fit(x, y, epochs=2, batch_size=GLOBAL_BATCH, shuffle=True, verbose=0)


def case_fine_tune():
    # Transfer learning's usual moves: train a head over a frozen base, then unfreeze the base,
    # compile again and fine-tune everything (the base's gradients were never summed: the
    # replicas drifted apart silently).
    strategy = px.get_strategy()
    base = keras.Sequential([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(8, activation="tanh")])
    base.trainable = False
    model = keras.Sequential([keras.Input((FEATURES,)), base, keras.layers.Dense(CLASSES, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="sparse_categorical_crossentropy")
    x, y = data(192, 11)

    def fit():
        model.fit(x, y, epochs=1, batch_size=GLOBAL_BATCH, verbose=0)
        with strategy.scope():
            base.trainable = True
            model.compile(
                optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                loss="sparse_categorical_crossentropy",
                metrics=["accuracy"],
            )
        return model.fit(x, y, epochs=1, batch_size=GLOBAL_BATCH, verbose=0)

    return model, fit


CASES = {
    "sgd": case_sgd,
    "adam": case_adam,
    "subclassed_dataloader": case_subclassed_dataloader,
    "pydataset": case_pydataset,
    "lazy_sequential": case_lazy_sequential,
    "batchnorm": case_batchnorm,
    "accumulate_sgd": case_accumulate_sgd,
    "accumulate_adam": case_accumulate_adam,
    "fine_tune": case_fine_tune,
}


def run_case(name, strategy, rank, out, prefix):
    # Replicas other than the chief start from other weights: the chief's must win.
    keras.utils.set_random_seed(SEED + 1000 * rank)
    if strategy is None:
        model, fit = CASES[name]()
    else:
        with strategy.scope():
            model, fit = CASES[name]()
    # Each replica's random state differs; the shuffles must follow the chief's.
    keras.utils.set_random_seed(SEED + 1 + 1000 * rank)
    history = fit().history
    evaluation = model.evaluate(X_TEST, Y_TEST, batch_size=20, verbose=0, return_dict=True)
    predictions = model.predict(X_TEST, batch_size=20, verbose=0)
    np.savez(
        os.path.join(out, f"{prefix}_{name}_{rank}.npz"),
        predictions=predictions,
        **{f"w{i}": np.asarray(w) for i, w in enumerate(model.get_weights())},
    )
    with open(os.path.join(out, f"{prefix}_{name}_{rank}.json"), "w") as f:
        json.dump({"history": history, "evaluate": evaluation}, f)


if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    if len(sys.argv) > 3:  # only these cases (comma-separated), for a quick look
        CASES = {name: CASES[name] for name in sys.argv[3].split(",")}
    # MODE may name several runs (reference,mirrored,central_storage): they run one after the other
    # on the same processes (process start-up is most of what a job costs). The reference runs
    # first, on this process alone: the first multi-replica strategy starts the other replicas
    # (they run this script again and skip it).
    for kind in mode.split(","):
        if kind == "reference":
            if int(os.environ.get("PHALANX_RANK", "0")) == 0:
                for name in CASES:
                    run_case(name, None, 0, out, "ref")
                one = px.OneDeviceStrategy("cpu")
                for name in CASES:
                    run_case(name, one, 0, out, "one")
            continue
        strategy = {
            "mirrored": lambda: px.MirroredStrategy(["cpu:0", "cpu:1"]),
            "central_storage": lambda: px.CentralStorageStrategy(["cpu:0", "cpu:1"]),
            "mwms": px.MultiWorkerMirroredStrategy,
        }[kind]()
        rank = strategy.extended.process_index
        for name in CASES:
            run_case(name, strategy, rank, out, kind)
        strategy.close()
