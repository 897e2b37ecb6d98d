# Port of tensorflow/docs site/en/guide/distributed_training.ipynb ("Distributed training with
# TensorFlow"): every strategy's snippet, Keras fit with a strategy, and a custom training loop.
# Run: phalanx run -n 2 examples/tutorials/distributed_training_guide.py   (2 CPU replicas)
#
# About 25 lines changed beyond the rename (README "Porting from TensorFlow").
# Every tf.distribute call is kept, renamed to phalanx. Lines changed beyond the rename:
#   1. data: tf.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(b) -> a DataLoader over
#      TensorDataset(ones(100, 1), ones(100, 1)) with batch_size=b.
#   2. TF -> torch / Keras 3: tf.Variable(1.) -> keras.Variable(1.0);
#      tf.config.list_physical_devices('GPU') -> torch.cuda.device_count(); GradientTape ->
#      model.zero_grad(); loss.backward(); [v.value.grad]; @tf.function dropped;
#      Reduction.NONE -> reduction=None; input_shape=(1,) -> keras.Input((1,)).
#   3. Snippets that need hardware this host may not have run guarded, and their typed error is
#      printed: MirroredStrategy(devices=["/gpu:0", "/gpu:1"]) raises DeviceNotFoundError without
#      two GPUs; CommunicationOptions(implementation=NCCL) raises InvalidDeviceError on CPUs (TF
#      would fail too); TPUClusterResolver / TPUStrategy raise InvalidDeviceError (phalanx has no
#      TPU support; tf.config.experimental_connect_to_cluster and
#      tf.tpu.experimental.initialize_tpu_system are dropped). OneDeviceStrategy(device="/gpu:0")
#      (a text block in the guide) runs on "/cpu:0" when there is no GPU.
#   4. Not run, as in the guide (a text block there): ParameterServerStrategy with
#      TFConfigClusterResolver (needs a TF_CONFIG with "ps" tasks; see
#      parameter_server_training.py, which runs it on an in-process cluster).
#   5. Added at the end: the checks that it trained correctly (loss fell, replicas identical).
import os

os.environ.setdefault("KERAS_BACKEND", "torch")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import phalanx  # noqa: E402
import phalanx.errors  # noqa: E402

# ---- Types of strategies: MirroredStrategy
mirrored_strategy = phalanx.MirroredStrategy()

try:
    mirrored_strategy = phalanx.MirroredStrategy(devices=["/gpu:0", "/gpu:1"])
except phalanx.errors.DeviceNotFoundError as e:  # (added) no two GPUs here
    print(f"MirroredStrategy(devices=['/gpu:0', '/gpu:1']): {type(e).__name__}: {e}")

mirrored_strategy = phalanx.MirroredStrategy(cross_device_ops=phalanx.HierarchicalCopyAllReduce())

# ---- TPUStrategy (a text block in the guide)
tpu_address = "grpc://10.0.0.2:8470"  # (added) the guide leaves it to the reader
try:
    cluster_resolver = phalanx.cluster_resolver.TPUClusterResolver(tpu=tpu_address)
    tpu_strategy = phalanx.TPUStrategy(cluster_resolver)
except phalanx.errors.InvalidDeviceError as e:  # (added) phalanx has no TPU support
    print(f"TPUStrategy: {type(e).__name__}: {e}")
    tpu_error = e

# ---- MultiWorkerMirroredStrategy
strategy = phalanx.MultiWorkerMirroredStrategy()

try:
    communication_options = phalanx.experimental.CommunicationOptions(
        implementation=phalanx.experimental.CommunicationImplementation.NCCL
    )
    strategy = phalanx.MultiWorkerMirroredStrategy(communication_options=communication_options)
except phalanx.errors.InvalidDeviceError as e:  # (added) NCCL needs GPUs
    print(f"MultiWorkerMirroredStrategy(NCCL): {type(e).__name__}: {e}")

# ---- ParameterServerStrategy (a text block in the guide; needs a TF_CONFIG with "ps" tasks):
# strategy = phalanx.experimental.ParameterServerStrategy(
#     phalanx.cluster_resolver.TFConfigClusterResolver(),
#     variable_partitioner=variable_partitioner)
# coordinator = phalanx.experimental.coordinator.ClusterCoordinator(
#     strategy)

# ---- CentralStorageStrategy
central_storage_strategy = phalanx.experimental.CentralStorageStrategy()

# ---- Other strategies: Default Strategy
default_strategy = phalanx.get_strategy()

# In optimizer or other library code
# Get currently active strategy
strategy = phalanx.get_strategy()
reduced = strategy.reduce("SUM", 1.0, axis=None)  # reduce some values

if torch.cuda.device_count():
    strategy = phalanx.MirroredStrategy()
else:  # use default strategy
    strategy = phalanx.get_strategy()

with strategy.scope():
    # do something interesting
    print(keras.Variable(1.0))

# ---- OneDeviceStrategy (a text block in the guide)
strategy = phalanx.OneDeviceStrategy(device="/gpu:0" if torch.cuda.is_available() else "/cpu:0")

# ---- Using phalanx.Strategy with keras Model.fit
mirrored_strategy = phalanx.MirroredStrategy()

with mirrored_strategy.scope():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])

model.compile(loss="mse", optimizer="sgd")

dataset = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.ones(100, 1), torch.ones(100, 1)), batch_size=10
)
history = model.fit(dataset, epochs=2)
model.evaluate(dataset)

inputs, targets = np.ones((100, 1)), np.ones((100, 1))
numpy_history = model.fit(inputs, targets, epochs=2, batch_size=10)

# Compute global batch size using number of replicas.
BATCH_SIZE_PER_REPLICA = 5
global_batch_size = BATCH_SIZE_PER_REPLICA * mirrored_strategy.num_replicas_in_sync
dataset = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.ones(100, 1), torch.ones(100, 1)), batch_size=global_batch_size
)

LEARNING_RATES_BY_BATCH_SIZE = {5: 0.1, 10: 0.15}
learning_rate = LEARNING_RATES_BY_BATCH_SIZE[global_batch_size]

# ---- Using phalanx.Strategy with custom training loops
with mirrored_strategy.scope():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD()

dataset = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.ones(100, 1), torch.ones(100, 1)), batch_size=global_batch_size
)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)

loss_object = keras.losses.BinaryCrossentropy(from_logits=True, reduction=None)


def compute_loss(labels, predictions):
    per_example_loss = loss_object(labels, predictions)
    return phalanx.nn.compute_average_loss(per_example_loss, global_batch_size=global_batch_size)


def train_step(inputs):
    features, labels = inputs

    predictions = model(features, training=True)
    loss = compute_loss(labels, predictions)

    model.zero_grad()
    loss.backward()
    gradients = [v.value.grad for v in model.trainable_variables]
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return loss


def distributed_train_step(dist_inputs):
    per_replica_losses = mirrored_strategy.run(train_step, args=(dist_inputs,))
    return mirrored_strategy.reduce(phalanx.ReduceOp.SUM, per_replica_losses, axis=None)


step_losses = []  # (added) checked at the end
for dist_inputs in dist_dataset:
    step_losses.append(float(distributed_train_step(dist_inputs)))
    print(step_losses[-1])

iterator = iter(dist_dataset)
for _ in range(10):
    step_losses.append(float(distributed_train_step(next(iterator))))
    print(step_losses[-1])

# ---- checks (not in the guide): every strategy worked and it trained correctly
assert tpu_error.device == "TPU", tpu_error
assert float(reduced) == 1.0, f"the default strategy's reduce gave {reduced}"
assert default_strategy is phalanx.get_strategy(), "the default strategy is not a singleton"
fit_losses = history.history["loss"] + numpy_history.history["loss"]
assert fit_losses[-1] < fit_losses[0], f"Keras fit's loss did not fall: {fit_losses}"
assert step_losses[-1] < step_losses[0], f"the custom loop's loss did not fall: {step_losses}"
assert len(step_losses) == 100 // global_batch_size + 10, f"{len(step_losses)} steps"
checksum = float(sum(np.abs(w).sum() for w in model.get_weights()))
everyone = mirrored_strategy.gather(
    mirrored_strategy.run(lambda: torch.tensor([checksum], dtype=torch.float64)), axis=0
)
assert len(set(everyone.tolist())) == 1, f"replicas differ: {everyone.tolist()}"
print("TUTORIAL OK")
