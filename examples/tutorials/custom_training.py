# Port of tensorflow/docs site/en/tutorials/distribute/custom_training.ipynb
# ("Custom training with tf.distribute.Strategy").
# Run: phalanx run -n 2 examples/tutorials/custom_training.py   (MirroredStrategy, 2 CPU replicas)
#
# About 30 lines changed beyond the rename (README "Porting from TensorFlow").
# Every tf.distribute call is kept, renamed to phalanx. Lines changed beyond the rename:
#   1. data: fashion_mnist -> scikit-learn's digits (8x8x1); tf.data from_tensor_slices / shuffle /
#      batch -> TensorDataset + DataLoader(shuffle=True); the model's second Conv2D/MaxPooling2D pair
#      is dropped (8x8 images are too small for it).
#   2. TF -> torch: GradientTape / tape.gradient -> model.zero_grad(); loss.backward(); [v.value.grad];
#      @tf.function dropped; Reduction.NONE -> reduction=None; reset_states -> reset_state;
#      tf.train.Checkpoint / latest_checkpoint -> phalanx.checkpoint's; tf.cast -> float.
#   3. EPOCHS 10 -> 3; the "iterating inside a tf.function" section runs 1 epoch.
#   4. Added at the end: the checks that it trained correctly.
import os

os.environ.setdefault("KERAS_BACKEND", "torch")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import phalanx  # noqa: E402
import phalanx.checkpoint  # noqa: E402

digits = load_digits()
images = (digits.images[..., None] / np.float32(16)).astype(np.float32)
labels = digits.target.astype(np.int64)
train_images, train_labels = images[:1500], labels[:1500]
test_images, test_labels = images[1500:], labels[1500:]

# If the list of devices is not specified in the
# `phalanx.MirroredStrategy` constructor, it will be auto-detected.
strategy = phalanx.MirroredStrategy()
print(f"Number of devices: {strategy.num_replicas_in_sync}")

BUFFER_SIZE = len(train_images)
BATCH_SIZE_PER_REPLICA = 64
GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
EPOCHS = 3

train_dataset = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.as_tensor(train_images), torch.as_tensor(train_labels)),
    batch_size=GLOBAL_BATCH_SIZE,
    shuffle=True,
)
test_dataset = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.as_tensor(test_images), torch.as_tensor(test_labels)),
    batch_size=GLOBAL_BATCH_SIZE,
)

train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)


def create_model():
    model = keras.Sequential(
        [
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )

    return model


# Create a checkpoint directory to store the checkpoints.
checkpoint_dir = "./training_checkpoints"
checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt")

with strategy.scope():
    # Set reduction to `none` so we can do the reduction afterwards and divide by
    # global batch size.
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def compute_loss(labels, predictions):
        per_example_loss = loss_object(labels, predictions)
        return phalanx.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)


with strategy.scope():
    test_loss = keras.metrics.Mean(name="test_loss")

    train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
    test_accuracy = keras.metrics.SparseCategoricalAccuracy(name="test_accuracy")

# model, optimizer, and checkpoint must be created under `strategy.scope`.
with strategy.scope():
    model = create_model()

    optimizer = keras.optimizers.Adam()

    checkpoint = phalanx.checkpoint.Checkpoint(optimizer=optimizer, model=model)


def train_step(inputs):
    images, labels = inputs

    predictions = model(images, training=True)
    loss = compute_loss(labels, predictions)

    model.zero_grad()
    loss.backward()
    gradients = [v.value.grad for v in model.trainable_variables]
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))

    train_accuracy.update_state(labels, predictions)
    return loss


def test_step(inputs):
    images, labels = inputs

    predictions = model(images, training=False)
    t_loss = loss_object(labels, predictions)

    test_loss.update_state(t_loss)
    test_accuracy.update_state(labels, predictions)


# `run` replicates the provided computation and runs it
# with the distributed input.
def distributed_train_step(dataset_inputs):
    per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
    return strategy.reduce(phalanx.ReduceOp.SUM, per_replica_losses, axis=None)


def distributed_test_step(dataset_inputs):
    return strategy.run(test_step, args=(dataset_inputs,))


train_losses = []
for epoch in range(EPOCHS):
    # TRAIN LOOP
    total_loss = 0.0
    num_batches = 0
    for x in train_dist_dataset:
        total_loss += distributed_train_step(x)
        num_batches += 1
    train_loss = total_loss / num_batches

    # TEST LOOP
    for x in test_dist_dataset:
        distributed_test_step(x)

    if epoch % 2 == 0:
        checkpoint.save(checkpoint_prefix)

    template = "Epoch {}, Loss: {}, Accuracy: {}, Test Loss: {}, Test Accuracy: {}"
    print(
        template.format(
            epoch + 1, train_loss, train_accuracy.result() * 100, test_loss.result(), test_accuracy.result() * 100
        )
    )
    train_losses.append(float(train_loss))
    final_test_accuracy = float(test_accuracy.result())

    test_loss.reset_state()
    train_accuracy.reset_state()
    test_accuracy.reset_state()

# ---- Restore the latest checkpoint and test
eval_accuracy = keras.metrics.SparseCategoricalAccuracy(name="eval_accuracy")

new_model = create_model()
new_optimizer = keras.optimizers.Adam()

test_dataset = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.as_tensor(test_images), torch.as_tensor(test_labels)),
    batch_size=GLOBAL_BATCH_SIZE,
)


def eval_step(images, labels):
    predictions = new_model(images, training=False)
    eval_accuracy(labels, predictions)


checkpoint = phalanx.checkpoint.Checkpoint(optimizer=new_optimizer, model=new_model)
checkpoint.restore(phalanx.checkpoint.latest_checkpoint(checkpoint_dir))

for images, labels in test_dataset:
    eval_step(images, labels)

print(f"Accuracy after restoring the saved model without strategy: {eval_accuracy.result() * 100}")
restored_accuracy = float(eval_accuracy.result())

# ---- Alternate ways of iterating over a dataset: using iterators
for _ in range(EPOCHS):
    total_loss = 0.0
    num_batches = 0
    train_iter = iter(train_dist_dataset)

    for _ in range(10):
        total_loss += distributed_train_step(next(train_iter))
        num_batches += 1
    average_train_loss = total_loss / num_batches

    template = "Epoch {}, Loss: {}, Accuracy: {}"
    print(template.format(epoch + 1, average_train_loss, train_accuracy.result() * 100))
    train_accuracy.reset_state()


# ---- Iterating inside a function
def distributed_train_epoch(dataset):
    total_loss = 0.0
    num_batches = 0
    for x in dataset:
        per_replica_losses = strategy.run(train_step, args=(x,))
        total_loss += strategy.reduce(phalanx.ReduceOp.SUM, per_replica_losses, axis=None)
        num_batches += 1
    return total_loss / float(num_batches)


for epoch in range(1):
    train_loss = distributed_train_epoch(train_dist_dataset)

    template = "Epoch {}, Loss: {}, Accuracy: {}"
    print(template.format(epoch + 1, train_loss, train_accuracy.result() * 100))

    train_accuracy.reset_state()

# ---- checks (not in the tutorial): it trained correctly
assert train_losses[-1] < 0.9 * train_losses[0], f"the loss did not fall: {train_losses}"
assert final_test_accuracy > 0.4, f"test accuracy {final_test_accuracy}"
# The last checkpoint was saved after the last epoch: the restored model is the trained one.
assert abs(restored_accuracy - final_test_accuracy) < 1e-6, (
    f"the restored model evaluates to {restored_accuracy}, the saved one to {final_test_accuracy}"
)
checksum = float(sum(np.abs(w).sum() for w in model.get_weights()))
everyone = strategy.gather(strategy.run(lambda: torch.tensor([checksum], dtype=torch.float64)), axis=0)
assert len(set(everyone.tolist())) == 1, f"replicas differ: {everyone.tolist()}"
print("TUTORIAL OK")
