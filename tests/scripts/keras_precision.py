"""Keras fit with jit_compile=True or a mixed-precision policy, under a strategy or on one device.

Usage: python keras_precision.py OUT_DIR RUN [RUN ...]      (RUN: STRATEGY,VARIANT)
  STRATEGY: reference (plain Keras, one device) | mirrored | central_storage | mwms
  VARIANT: jit (jit_compile=True; the reference runs eagerly) | mixed_bfloat16 | mixed_float16
  or RUN = grad_scaler,KIND: grad_scaler.py's run of KIND (torch autocast and GradScaler) on the same
  replica processes, written to OUT_DIR/RUN/scaler_{rank}.json
Each RUN builds a fresh model under a fresh strategy (the runs of one program share its processes:
process start-up is most of what a run costs) and writes OUT_DIR/RUN/weights_{rank}.npz and
history_{rank}.json (History, evaluate, the loss scale if any). The reference runs come after the
strategy runs, on replica 0 only (the other replicas run the same program: they skip them).
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

import phalanx as px  # noqa: E402
import phalanx.keras  # noqa: E402,F401

FEATURES, CLASSES, GLOBAL_BATCH = 12, 3, 32


def data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = (x[:, :3].sum(1) > 0).astype("int64") + (x[:, 3] > 1).astype("int64")
    return x, y


def build(variant, strategy_name):
    # Global: a run after a mixed-precision one must not inherit its policy.
    keras.mixed_precision.set_global_policy(variant if variant.startswith("mixed") else "float32")
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(CLASSES, activation="softmax", dtype="float32"),
        ]
    )
    jit = variant == "jit" and strategy_name != "reference"
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        jit_compile=jit,
    )
    return model


def main():
    runs = sys.argv[2:]
    rank = 0
    # Strategy runs first: a replica process started by the first strategy runs this program too,
    # and knows it is not replica 0 only from there on.
    for run in sorted(runs, key=lambda r: r.startswith("reference,")):
        name, variant = run.split(",")
        if name == "reference" and rank != 0:
            continue
        out = os.path.join(sys.argv[1], run)
        os.makedirs(out, exist_ok=True)
        if name == "grad_scaler":
            import grad_scaler  # a sibling script: this script's folder is on sys.path

            rank = grad_scaler.run(out, variant)
        else:
            rank = train(out, name, variant)


def train(out, name, variant):
    if name == "reference":
        strategy, rank = None, 0
    else:
        strategy = {
            "mirrored": lambda: px.MirroredStrategy(["cpu:0", "cpu:1"]),
            "central_storage": lambda: px.CentralStorageStrategy(["cpu:0", "cpu:1"]),
            "mwms": px.MultiWorkerMirroredStrategy,
        }[name]()
        rank = px.process_index()
    keras.utils.set_random_seed(1234 + 1000 * rank)  # the chief's initial weights must win
    if strategy is None:
        model = build(variant, name)
    else:
        with strategy.scope():
            model = build(variant, name)
    keras.utils.set_random_seed(99 + rank)
    x, y = data(256, 1)
    history = model.fit(x, y, epochs=2, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0).history
    xt, yt = data(64, 2)
    evaluation = model.evaluate(xt, yt, batch_size=16, verbose=0, return_dict=True)
    scale = getattr(model.optimizer, "dynamic_scale", None)
    np.savez(os.path.join(out, f"weights_{rank}.npz"), *[np.asarray(w) for w in model.get_weights()])
    with open(os.path.join(out, f"history_{rank}.json"), "w") as f:
        json.dump(
            {
                "history": history,
                "evaluate": evaluation,
                "loss_scale": None if scale is None else float(np.asarray(scale)),
            },
            f,
        )
    if strategy is not None:
        strategy.close()
    return rank


if __name__ == "__main__":
    main()
