"""TensorFlow reference runs for the benchmark (optional: only where TensorFlow is installed).

Usage: ``python -m benchmarks.tf_worker tf_mirrored|tf_mwms MODEL OUT_JSON [--seconds S]``.
``tf_mirrored``: ``tf.distribute.MirroredStrategy`` over 2 logical CPU devices in one process.
``tf_mwms``: one of 2 ``MultiWorkerMirroredStrategy`` workers (TF_CONFIG set by the caller).
Same models, global batch 256 and Adam as ``benchmarks.worker``, in a custom training loop with
``strategy.run`` under ``tf.function`` (Keras 3 cannot run MWMS ``fit``, keras-team/keras#20585).
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

GLOBAL_BATCH = 256


def build(name: str):
    import keras

    if name == "seed_mlp":
        layers = [keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)]
    elif name == "large_mlp":
        layers = [
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(10),
        ]
    else:
        layers = [
            keras.layers.Reshape((28, 28, 1)),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    return keras.Sequential([keras.Input((784,)), *layers])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config", choices=["tf_mirrored", "tf_mwms"])
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    if args.config == "tf_mwms" and "TF_CONFIG" not in os.environ:
        _launch_two_workers()
        return
    import keras
    import numpy as np
    import tensorflow as tf

    if args.config == "tf_mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        rank = 0
    else:
        tf.config.threading.set_intra_op_parallelism_threads(1)
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    with strategy.scope():
        model = build(args.model)
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)  # slots created in scope, before tracing
    rng = np.random.default_rng(0)
    x = rng.standard_normal((GLOBAL_BATCH * 20, 784), dtype=np.float32)
    y = rng.integers(0, 10, GLOBAL_BATCH * 20)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).repeat().with_options(options)
    iterator = iter(strategy.experimental_distribute_dataset(dataset))

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            per_example = tf.keras.losses.sparse_categorical_crossentropy(
                yb, model(xb, training=True), from_logits=True
            )
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step():
        xb, yb = next(iterator)
        return strategy.run(replica_step, args=(xb, yb))

    for _ in range(5):
        step()
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < args.seconds:
        for _ in range(10):
            loss = step()
        steps += 10
    strategy.experimental_local_results(loss)[0].numpy()  # the last step has finished
    elapsed = time.perf_counter() - start
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(
                {"rank": 0, "steps": steps, "seconds": elapsed, "samples_per_s": steps * GLOBAL_BATCH / elapsed}, f
            )


def _launch_two_workers() -> None:
    """Starts this command again as 2 MWMS workers on loopback, each with its TF_CONFIG."""
    import socket
    import subprocess
    import sys

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    workers = [f"127.0.0.1:{p}" for p in ports]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.tf_worker", *sys.argv[1:]],
            env={
                **os.environ,
                "TF_CONFIG": json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}),
            },
        )
        for i in range(2)
    ]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        raise SystemExit(f"a TensorFlow MWMS worker failed: exit codes {codes}")


if __name__ == "__main__":
    main()
