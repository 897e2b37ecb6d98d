# Port of tensorflow/docs site/en/tutorials/distribute/input.ipynb ("Distributed input").
# Run: phalanx run -n 2 examples/tutorials/input.py   (MirroredStrategy, 2 CPU replicas)
#
# About 25 lines changed beyond the rename (README "Porting from TensorFlow").
# Every tf.distribute call is kept, renamed to phalanx (the tutorial creates a MirroredStrategy in
# each section). Lines changed beyond the rename:
#   1. tf.data -> lists of batches and generators: from_tensors(([1.], [1.])).repeat(n).batch(b) ->
#      a list of (features, labels) batches; range(n).batch(b) -> torch.arange batches;
#      from_generator -> a generator of 4-row batches; dataset.shard(n, i) -> slicing by pipeline.
#   2. tf.data.Options().experimental_distribute.auto_shard_policy -> phalanx.InputOptions(...).
#   3. @tf.function (with input_signature=dist_dataset.element_spec) dropped; tf.range/tf.print ->
#      range/print; OutOfRangeError -> StopIteration; .numpy() on torch tensors.
#   4. The Keras preprocessing-layer section (StringLookup needs TensorFlow for strings) is left out.
#   5. num_epochs 10 -> 2 (few steps). Added at the end: the checks that every row was seen.
import os

os.environ.setdefault("KERAS_BACKEND", "torch")
import numpy as np  # noqa: E402
import torch  # noqa: E402

import phalanx  # noqa: E402


def from_tensors_repeat_batch(n, batch):
    rows = [([1.0], [1.0])] * n
    return [
        (torch.tensor([r[0] for r in rows[i : i + batch]]), torch.tensor([r[1] for r in rows[i : i + batch]]))
        for i in range(0, n, batch)
    ]


global_batch_size = 16
# Create a dataset object.
dataset = from_tensors_repeat_batch(100, global_batch_size)


def train_step(inputs):
    features, labels = inputs
    return labels - 0.3 * features


# Iterate over the dataset using the for..in construct.
for inputs in dataset:
    print(train_step(inputs))

global_batch_size = 16
mirrored_strategy = phalanx.MirroredStrategy()

dataset = from_tensors_repeat_batch(100, global_batch_size)
# Distribute input using the `experimental_distribute_dataset`.
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
# 1 global batch of data fed to the model in 1 step.
print(next(iter(dist_dataset)))

dataset = from_tensors_repeat_batch(64, 16)
options = phalanx.InputOptions(auto_shard_policy=phalanx.AutoShardPolicy.DATA)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset, options)

mirrored_strategy = phalanx.MirroredStrategy()


def dataset_fn(input_context):
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    rows = [([1.0], [1.0])] * 64
    rows = rows[input_context.input_pipeline_id :: input_context.num_input_pipelines]  # shard
    return [
        (torch.tensor([r[0] for r in rows[i : i + batch_size]]), torch.tensor([r[1] for r in rows[i : i + batch_size]]))
        for i in range(0, len(rows), batch_size)
    ]


dist_dataset = mirrored_strategy.distribute_datasets_from_function(dataset_fn)

global_batch_size = 16
mirrored_strategy = phalanx.MirroredStrategy()

dataset = from_tensors_repeat_batch(100, global_batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)

for x in dist_dataset:
    # train_step trains the model using the dataset elements
    loss = mirrored_strategy.run(train_step, args=(x,))
    print("Loss is ", loss)

num_epochs = 2
steps_per_epoch = 5
for epoch in range(num_epochs):
    dist_iterator = iter(dist_dataset)
    for step in range(steps_per_epoch):
        # train_step trains the model using the dataset elements
        loss = mirrored_strategy.run(train_step, args=(next(dist_iterator),))
        # which is the same as
        # loss = mirrored_strategy.run(train_step, args=(dist_iterator.get_next(),))
        print("Loss is ", loss)

# This throws an error because we reach end of data.
iterator = iter(dist_dataset)
try:
    for _ in range(8):
        mirrored_strategy.run(train_step, args=(next(iterator),))
    reached_end = False
except StopIteration:
    reached_end = True

# You can break the loop with `get_next_as_optional` by checking if the Optional contains a value
global_batch_size = 4
steps_per_loop = 5
strategy = phalanx.MirroredStrategy()

dataset = [torch.arange(i, min(i + global_batch_size, 9)) for i in range(0, 9, global_batch_size)]
distributed_iterator = iter(strategy.experimental_distribute_dataset(dataset))

seen_by_optional = []


def train_fn(distributed_iterator):
    for _ in range(steps_per_loop):
        optional_data = distributed_iterator.get_next_as_optional()
        if not optional_data.has_value():
            break
        per_replica_results = strategy.run(lambda x: x, args=(optional_data.get_value(),))
        print(strategy.experimental_local_results(per_replica_results))
        seen_by_optional.extend(int(v) for t in strategy.experimental_local_results(per_replica_results) for v in t)


train_fn(distributed_iterator)

global_batch_size = 16
epochs = 2
steps_per_epoch = 5
mirrored_strategy = phalanx.MirroredStrategy()

dataset = from_tensors_repeat_batch(100, global_batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
print(dist_dataset.element_spec)


def train_step(per_replica_inputs):
    def step_fn(inputs):
        return 2 * inputs

    return mirrored_strategy.run(step_fn, args=(per_replica_inputs,))


for _ in range(epochs):
    iterator = iter(dist_dataset)
    for _ in range(steps_per_epoch):
        output = train_step(next(iterator))
        print(output)

# Fetching results in order.
mirrored_strategy = phalanx.MirroredStrategy()
dataset_size = 24
batch_size = 6
dataset = [
    (torch.arange(i, i + batch_size), torch.arange(i, i + batch_size)) for i in range(0, dataset_size, batch_size)
]  # range(24).enumerate().batch(6)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)


def predict(index, inputs):
    outputs = 2 * inputs
    return index, outputs


result = {}
for index, inputs in dist_dataset:
    output_index, outputs = mirrored_strategy.run(predict, args=(index, inputs))
    indices = list(mirrored_strategy.experimental_local_results(output_index))
    rindices = []
    for a in indices:
        rindices.extend(a.numpy())
    outputs = list(mirrored_strategy.experimental_local_results(outputs))
    routputs = []
    for a in outputs:
        routputs.extend(a.numpy())
    for i, value in zip(rindices, routputs):
        result[i] = value

print(result)

# Use experimental_distribute_values_from_function for arbitrary tensor inputs
mirrored_strategy = phalanx.MirroredStrategy()


def value_fn(ctx):
    return torch.tensor(ctx.replica_id_in_sync_group)


distributed_values = mirrored_strategy.experimental_distribute_values_from_function(value_fn)
for _ in range(4):
    result_values = mirrored_strategy.run(lambda x: x, args=(distributed_values,))
    print(result_values)

# Use a generator
mirrored_strategy = phalanx.MirroredStrategy()


def input_gen():
    while True:
        yield np.random.rand(4)


dataset = input_gen()
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
iterator = iter(dist_dataset)
for _ in range(4):
    result_gen = mirrored_strategy.run(lambda x: x, args=(next(iterator),))
    print(result_gen)

# ---- checks (not in the tutorial): every row was seen, in order
assert reached_end
assert sorted(seen_by_optional) == list(range(9)), seen_by_optional
assert {int(k): int(v) for k, v in result.items()} == {i: 2 * i for i in range(24)}, result
ids = mirrored_strategy.experimental_local_results(mirrored_strategy.run(lambda x: x, args=(distributed_values,)))
assert [int(i) for i in ids] == list(range(mirrored_strategy.num_replicas_in_sync))
print("TUTORIAL OK")
