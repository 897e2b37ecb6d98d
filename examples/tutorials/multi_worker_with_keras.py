# Port of tensorflow/docs site/en/tutorials/distribute/multi_worker_with_keras.ipynb
# ("Multi-worker training with Keras": mnist_setup.py + main.py, then saving and checkpointing).
# Run: one process per TF_CONFIG worker, e.g. 2 workers on this host (see tests/test_tutorials.py).
#
# About 25 lines changed beyond the rename (README "Porting from TensorFlow").
# Every tf.distribute call is kept, renamed to phalanx. Lines changed beyond the rename:
#   1. data: tf.keras.datasets.mnist -> scikit-learn's digits (8x8); the tf.data pipeline
#      shuffle(60000).repeat().batch(b) -> a generator doing the same; shapes 28 -> 8.
#   2. Keras 3: model paths need ".keras"; Reshape after keras.Input; tf.io.gfile.makedirs /
#      rmtree -> os.makedirs(exist_ok=True) / shutil.rmtree; tf.data.Options' auto_shard_policy ->
#      phalanx.InputOptions(auto_shard_policy=...) (the section on sharding options).
#   3. steps_per_epoch 70 -> 20 and 20 -> 5 (few steps); /tmp paths -> the working directory.
#   4. tf.train.Checkpoint / CheckpointManager / latest_checkpoint -> phalanx.checkpoint's.
#   5. Added at the end: the checks that it trained correctly.
import json
import os
import shutil

os.environ.setdefault("KERAS_BACKEND", "torch")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import phalanx  # noqa: E402
import phalanx.checkpoint  # noqa: E402


# ---- mnist_setup.py
def mnist_dataset(batch_size):
    digits = load_digits()
    x_train, y_train = digits.images / np.float32(16), digits.target.astype(np.int64)
    x_train = x_train.astype(np.float32)

    def shuffle_repeat_batch():
        while True:
            order = np.random.permutation(len(x_train))
            for i in range(0, len(order) - batch_size + 1, batch_size):
                yield x_train[order[i : i + batch_size]], y_train[order[i : i + batch_size]]

    train_dataset = shuffle_repeat_batch()
    return train_dataset


def build_and_compile_cnn_model():
    model = keras.Sequential(
        [
            keras.Input(shape=(8, 8)),
            keras.layers.Reshape(target_shape=(8, 8, 1)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=keras.optimizers.SGD(learning_rate=0.05),
        metrics=["accuracy"],
    )
    return model


# ---- main.py
per_worker_batch_size = 64
tf_config = json.loads(os.environ["TF_CONFIG"])
num_workers = len(tf_config["cluster"]["worker"])

strategy = phalanx.MultiWorkerMirroredStrategy()

global_batch_size = per_worker_batch_size * num_workers
multi_worker_dataset = mnist_dataset(global_batch_size)

with strategy.scope():
    # Model building/compiling need to be within `strategy.scope()`.
    multi_worker_model = build_and_compile_cnn_model()

history = multi_worker_model.fit(multi_worker_dataset, epochs=3, steps_per_epoch=20)

# ---- Dataset sharding (the options object; here it only documents the policy)
options = phalanx.InputOptions(auto_shard_policy=phalanx.AutoShardPolicy.OFF)

# ---- Model saving and loading
model_path = "keras-model.keras"


def _is_chief(task_type, task_id):
    # Note: there are two possible `task_type` values, 'chief' and 'worker'; a
    # cluster without a 'chief' makes worker 0 the chief.
    return (task_type == "worker" and task_id == 0) or task_type == "chief" or task_type is None


def _get_temp_dir(dirpath, task_id):
    base_dirpath = "workertemp_" + str(task_id)
    temp_dir = os.path.join(dirpath, base_dirpath)
    os.makedirs(temp_dir, exist_ok=True)
    return temp_dir


def write_filepath(filepath, task_type, task_id):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief(task_type, task_id):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


task_type, task_id = (strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id)
write_model_path = write_filepath(model_path, task_type, task_id)

multi_worker_model.save(write_model_path)
if not _is_chief(task_type, task_id):
    shutil.rmtree(os.path.dirname(write_model_path))

loaded_model = keras.models.load_model(model_path)
restored_equal = all(np.array_equal(a, b) for a, b in zip(loaded_model.get_weights(), multi_worker_model.get_weights()))

# Now that the model is restored, and can continue with the training.
single_worker_dataset = mnist_dataset(per_worker_batch_size)
loaded_model.fit(single_worker_dataset, epochs=2, steps_per_epoch=5)

# ---- Checkpoint saving and restoring
checkpoint_dir = "ckpt"
checkpoint = phalanx.checkpoint.Checkpoint(model=multi_worker_model)

write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id)
checkpoint_manager = phalanx.checkpoint.CheckpointManager(checkpoint, directory=write_checkpoint_dir, max_to_keep=1)
checkpoint_manager.save()
if not _is_chief(task_type, task_id):
    shutil.rmtree(write_checkpoint_dir, ignore_errors=True)

latest_checkpoint = phalanx.checkpoint.latest_checkpoint(checkpoint_dir)
checkpoint.restore(latest_checkpoint)
multi_worker_model.fit(multi_worker_dataset, epochs=2, steps_per_epoch=5)

# ---- BackupAndRestore callback
callbacks = [keras.callbacks.BackupAndRestore(backup_dir="backup")]
with strategy.scope():
    multi_worker_model = build_and_compile_cnn_model()
multi_worker_model.fit(multi_worker_dataset, epochs=3, steps_per_epoch=5, callbacks=callbacks)

# ---- checks (not in the tutorial): it trained correctly
losses = history.history["loss"]
assert losses[-1] < 0.9 * losses[0], f"the loss did not fall: {losses}"
assert restored_equal, "the loaded model differs from the saved one"
checksum = float(sum(np.abs(w).sum() for w in multi_worker_model.get_weights()))
everyone = strategy.gather(strategy.run(lambda: torch.tensor([checksum], dtype=torch.float64)), axis=0)
assert len(set(everyone.tolist())) == 1, f"workers differ: {everyone.tolist()}"
print("TUTORIAL OK")
