# Port of tensorflow/docs site/en/tutorials/distribute/multi_worker_with_ctl.ipynb
# ("Custom training loop with Keras and MultiWorkerMirroredStrategy": mnist.py + main.py).
# Run: one process per TF_CONFIG worker, e.g. 2 workers on this host (see tests/test_tutorials.py).
#
# About 25 lines changed beyond the rename (README "Porting from TensorFlow").
# Every tf.distribute call is kept, renamed to phalanx. Lines changed beyond the rename:
#   1. data: tf.keras.datasets.mnist -> scikit-learn's digits (8x8); tf.data from_tensor_slices /
#      shuffle / shard / batch -> TensorDataset / Subset(range(id, n, num)) / DataLoader(shuffle=True);
#      shapes 28 -> 8.
#   2. TF -> torch: GradientTape / tape.gradient -> model.zero_grad(); loss.backward();
#      [v.value.grad]; @tf.function dropped; Reduction.NONE -> reduction=None; reset_states ->
#      reset_state; tf.Variable(tf.constant(0, tf.int64)) ->
#      keras.Variable(0, dtype="int64", trainable=False) (Keras 3 on torch: integer variables cannot
#      be trainable);
#      tf.io.gfile.makedirs / rmtree -> os.makedirs(exist_ok=True) / shutil.rmtree;
#      tf.train.Checkpoint / CheckpointManager / latest_checkpoint -> phalanx.checkpoint's.
#   3. num_steps_per_epoch 70 -> 10 (a worker's shard of digits has 14 batches); the checkpoint
#      directory util.get_temp_dir() (a per-process temporary directory) -> the working directory,
#      which both workers share as the tutorial's two workers would share a file system.
#   4. Added at the end: a restart after a failure (fresh model and counters restored from the
#      latest checkpoint, training resumed for one more epoch; the resumed loop skips the loss of
#      the epoch that had ended, where the tutorial's loop would divide by zero), then the checks
#      that it trained correctly.
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


# ---- mnist.py
def mnist_dataset(batch_size):
    digits = load_digits()
    # The `x` arrays have values in the range [0, 16].
    # You need to convert them to float32 with values in the range [0, 1]
    x_train = digits.images / np.float32(16)
    y_train = digits.target.astype(np.int64)
    train_dataset = torch.utils.data.TensorDataset(torch.as_tensor(x_train), torch.as_tensor(y_train))
    return train_dataset


def dataset_fn(global_batch_size, input_context):
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    dataset = mnist_dataset(batch_size)
    dataset = torch.utils.data.Subset(
        dataset, range(input_context.input_pipeline_id, len(dataset), input_context.num_input_pipelines)
    )
    dataset = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True)
    return dataset


def build_cnn_model():
    return keras.Sequential(
        [
            keras.Input(shape=(8, 8)),
            keras.layers.Reshape(target_shape=(8, 8, 1)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


# ---- main.py
per_worker_batch_size = 64
tf_config = json.loads(os.environ["TF_CONFIG"])
num_workers = len(tf_config["cluster"]["worker"])
global_batch_size = per_worker_batch_size * num_workers

num_epochs = 3
num_steps_per_epoch = 10


# Checkpoint saving and restoring
def _is_chief(task_type, task_id, cluster_spec):
    return (
        task_type is None
        or task_type == "chief"
        or (task_type == "worker" and task_id == 0 and "chief" not in cluster_spec.as_dict())
    )


def _get_temp_dir(dirpath, task_id):
    base_dirpath = "workertemp_" + str(task_id)
    temp_dir = os.path.join(dirpath, base_dirpath)
    os.makedirs(temp_dir, exist_ok=True)
    return temp_dir


def write_filepath(filepath, task_type, task_id, cluster_spec):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief(task_type, task_id, cluster_spec):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


checkpoint_dir = os.path.join(os.getcwd(), "ckpt")

# Define Strategy
strategy = phalanx.MultiWorkerMirroredStrategy()

with strategy.scope():
    # Model building/compiling need to be within `strategy.scope()`.
    multi_worker_model = build_cnn_model()

    multi_worker_dataset = strategy.distribute_datasets_from_function(
        lambda input_context: dataset_fn(global_batch_size, input_context)
    )
    optimizer = keras.optimizers.RMSprop(learning_rate=0.001)
    train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")


def train_step(iterator):
    """Training step function."""

    def step_fn(inputs):
        """Per-Replica step function."""
        x, y = inputs
        predictions = multi_worker_model(x, training=True)
        per_batch_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)(y, predictions)
        loss = phalanx.nn.compute_average_loss(per_batch_loss, global_batch_size=global_batch_size)

        multi_worker_model.zero_grad()
        loss.backward()
        grads = [v.value.grad for v in multi_worker_model.trainable_variables]
        optimizer.apply_gradients(zip(grads, multi_worker_model.trainable_variables))
        train_accuracy.update_state(y, predictions)

        return loss

    per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
    return strategy.reduce(phalanx.ReduceOp.SUM, per_replica_losses, axis=None)


epoch = keras.Variable(initializer=0, dtype="int64", trainable=False, name="epoch")
step_in_epoch = keras.Variable(initializer=0, dtype="int64", trainable=False, name="step_in_epoch")

task_type, task_id, cluster_spec = (
    strategy.cluster_resolver.task_type,
    strategy.cluster_resolver.task_id,
    strategy.cluster_resolver.cluster_spec(),
)

checkpoint = phalanx.checkpoint.Checkpoint(model=multi_worker_model, epoch=epoch, step_in_epoch=step_in_epoch)

write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id, cluster_spec)
checkpoint_manager = phalanx.checkpoint.CheckpointManager(checkpoint, directory=write_checkpoint_dir, max_to_keep=1)

# Restoring the checkpoint
latest_checkpoint = phalanx.checkpoint.latest_checkpoint(checkpoint_dir)
if latest_checkpoint:
    checkpoint.restore(latest_checkpoint)

# Resume our CTL training
epoch_losses = []
while epoch.numpy() < num_epochs:
    iterator = iter(multi_worker_dataset)
    total_loss = 0.0
    num_batches = 0

    while step_in_epoch.numpy() < num_steps_per_epoch:
        total_loss += train_step(iterator)
        num_batches += 1
        step_in_epoch.assign_add(1)

    train_loss = total_loss / num_batches
    print("Epoch: %d, accuracy: %f, train_loss: %f." % (epoch.numpy(), train_accuracy.result(), train_loss))
    epoch_losses.append(float(train_loss))

    train_accuracy.reset_state()

    checkpoint_manager.save()
    if not _is_chief(task_type, task_id, cluster_spec):
        shutil.rmtree(write_checkpoint_dir)

    epoch.assign_add(1)
    step_in_epoch.assign(0)


# ---- Added (not in the tutorial): the worker restarts after a failure, as main.py does when it is
# run again: fresh model, optimizer and counters, restored from the latest checkpoint, then one
# more epoch.
def weights_of(model):
    return [np.array(w) for w in model.get_weights()]


trained_weights = weights_of(multi_worker_model)
with strategy.scope():
    multi_worker_model = build_cnn_model()
    optimizer = keras.optimizers.RMSprop(learning_rate=0.001)
epoch = keras.Variable(initializer=0, dtype="int64", trainable=False, name="epoch")
step_in_epoch = keras.Variable(initializer=0, dtype="int64", trainable=False, name="step_in_epoch")
checkpoint = phalanx.checkpoint.Checkpoint(model=multi_worker_model, epoch=epoch, step_in_epoch=step_in_epoch)
checkpoint_manager = phalanx.checkpoint.CheckpointManager(checkpoint, directory=write_checkpoint_dir, max_to_keep=1)
latest_checkpoint = phalanx.checkpoint.latest_checkpoint(checkpoint_dir)
if latest_checkpoint:
    checkpoint.restore(latest_checkpoint)
restored_epoch = (int(epoch.numpy()), int(step_in_epoch.numpy()))
restored_equal = all(np.array_equal(a, b) for a, b in zip(weights_of(multi_worker_model), trained_weights))

num_epochs += 1
while epoch.numpy() < num_epochs:
    iterator = iter(multi_worker_dataset)
    total_loss = 0.0
    num_batches = 0
    while step_in_epoch.numpy() < num_steps_per_epoch:
        total_loss += train_step(iterator)
        num_batches += 1
        step_in_epoch.assign_add(1)
    if num_batches:  # the restored epoch had ended (the save comes before epoch.assign_add(1))
        epoch_losses.append(float(total_loss / num_batches))
    checkpoint_manager.save()
    if not _is_chief(task_type, task_id, cluster_spec):
        shutil.rmtree(write_checkpoint_dir)
    epoch.assign_add(1)
    step_in_epoch.assign(0)

# ---- checks (not in the tutorial): it trained correctly
assert latest_checkpoint, f"no checkpoint in {checkpoint_dir}"
# The tutorial saves at the end of an epoch, before counting it: epoch 2 (the third), step 10.
assert restored_epoch == (2, num_steps_per_epoch), f"restored (epoch, step_in_epoch) {restored_epoch}"
assert restored_equal, "the restored model differs from the one saved"
assert len(epoch_losses) == 4, f"trained {len(epoch_losses)} epochs: {epoch_losses}"
assert epoch_losses[-1] < 0.8 * epoch_losses[0], f"the loss did not fall: {epoch_losses}"
checksum = float(sum(np.abs(w).sum() for w in weights_of(multi_worker_model)))
everyone = strategy.gather(strategy.run(lambda: torch.tensor([checksum], dtype=torch.float64)), axis=0)
assert len(set(everyone.tolist())) == 1, f"workers differ: {everyone.tolist()}"
# After the gather (a collective): worker 1 has deleted its temporary checkpoint by now.
assert not os.path.exists(os.path.join(os.getcwd(), "workertemp_1", "ckpt")), "worker 1's checkpoint remains"
print("TUTORIAL OK")
