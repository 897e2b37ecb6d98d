"""Cases translated from TF's tensorflow/python/distribute/custom_training_loop_input_test.py.

TF's ``Dataset.from_tensor_slices(data).batch(b)`` is a ``DataLoader(tensor, batch_size=b)`` here;
``tf.function`` variants are the eager ones (phalanx runs eagerly).
"""

from __future__ import annotations

import torch

import phalanx as px
from tf_conformance.registry import (
    MULTI,
    SINGLE_WORKER,
    assert_close,
    assert_equal,
    case,
    flat_local,
    local,
    raises,
)

SRC = "custom_training_loop_input_test.py"


def _loader(data, batch_size, drop_last=False):
    return torch.utils.data.DataLoader(torch.tensor(data), batch_size=batch_size, drop_last=drop_last)


def _worker_part(ctx, replicas_values):
    """TF's flattened local results: every replica's on a single worker, this worker's on 2x1."""
    if ctx.multi_worker:
        return replicas_values[ctx.worker]
    return [v for part in replicas_values for v in part]


def _split(ctx, batch):
    """How TF splits one global batch among the replicas: [[replica 0's], [replica 1's]]."""
    if ctx.n == 1:
        return [batch]
    half = (len(batch) + 1) // 2
    return [batch[:half], batch[half:]]


@case(f"{SRC} InputIterationTest.testConstantNumpyInput")
def constant_numpy_input(strategy, ctx):
    outputs = strategy.experimental_local_results(strategy.run(lambda x: torch.square(torch.as_tensor(x)), args=(2.0,)))
    assert_equal(outputs, [4.0] * ctx.local_n)


@case(f"{SRC} InputIterationTest.testStatefulExperimentalRunAlwaysExecute")
def stateful_run_always_executes(strategy, ctx):
    with strategy.scope():
        v = px.Variable(0.0, aggregation=px.VariableAggregation.MEAN)

    def assign_add():
        v.assign_add(1.0)

    strategy.run(assign_add)
    assert_equal(v, 1.0)


@case(f"{SRC} InputIterationTest.testFullEager")
def full_eager(strategy, ctx):
    results = []
    for x in strategy.experimental_distribute_dataset(_loader([5.0, 6.0, 7.0, 8.0], 2)):
        results.append(flat_local(strategy, strategy.run(torch.square, args=(x,))))
    expected = [_worker_part(ctx, _split(ctx, b)) for b in ([25.0, 36.0], [49.0, 64.0])]
    assert_equal(results, expected)


@case(f"{SRC} InputIterationTest.testGetNextAsOptional")
def get_next_as_optional(strategy, ctx):
    iterator = iter(strategy.experimental_distribute_dataset(_loader([5.0, 6.0, 7.0, 8.0], 2)))
    value = iterator.get_next_as_optional().get_value()
    got = flat_local(strategy, strategy.run(torch.square, args=(value,)))
    assert_equal(got, _worker_part(ctx, _split(ctx, [25.0, 36.0])))


@case(f"{SRC} InputIterationTest.testGetNextAsOptionalExampleUsage")
def get_next_as_optional_example_usage(strategy, ctx):
    iterator = iter(
        strategy.experimental_distribute_dataset(torch.utils.data.DataLoader(torch.arange(8), batch_size=2))
    )
    steps = 0
    for _ in range(6):
        optional = iterator.get_next_as_optional()
        if not optional.has_value():
            break
        strategy.run(lambda x: x, args=(optional.get_value(),))
        steps += 1
    assert steps == 4, steps


@case(f"{SRC} InputIterationTest.testStepInFunction / testRunInFunction / testIterationOutsideFunction")
def iteration_outside_function(strategy, ctx):
    iterator = iter(strategy.experimental_distribute_dataset(_loader([5.0, 6.0, 7.0, 8.0], 2)))
    results = [flat_local(strategy, strategy.run(torch.square, args=(next(iterator),))) for _ in range(2)]
    expected = [_worker_part(ctx, _split(ctx, b)) for b in ([25.0, 36.0], [49.0, 64.0])]
    assert_equal(results, expected)


@case(f"{SRC} InputIterationTest.testNestedOutput", MULTI)
def nested_output(strategy, ctx):
    iterator = iter(strategy.experimental_distribute_dataset(_loader([0, 1, 2, 3], 2)))

    def computation(x):
        return [{"a": x - 1, "b": x + 1}]

    outputs = strategy.run(computation, args=(next(iterator),))
    a, b = local(strategy, outputs[0]["a"]), local(strategy, outputs[0]["b"])
    replicas = [ctx.rank] if ctx.multi_worker else list(range(ctx.n))
    assert_equal(a, [[r - 1] for r in replicas])
    assert_equal(b, [[r + 1] for r in replicas])


@case(f"{SRC} InputIterationTest.testDatasetIterationInFunction")
def dataset_iteration(strategy, ctx):
    with strategy.scope():
        a = px.Variable(1.0, aggregation=px.VariableAggregation.ONLY_FIRST_REPLICA)
    dist_dataset = strategy.experimental_distribute_dataset(_loader([5.0, 6.0, 7.0, 8.0], 2))
    number_of_steps, product_of_means = 0, 2.0
    for x in dist_dataset:
        number_of_steps += 1
        product_of_means *= float(strategy.reduce("MEAN", x, axis=0))
    for y in dist_dataset:
        strategy.run(lambda _: a.assign_add(1.0), args=(y,))
    assert number_of_steps == 2
    assert abs(product_of_means - 2 * (5 + 6) / 2 * (7 + 8) / 2) < 1e-3, product_of_means
    assert_equal(a, 3.0)


@case(f"{SRC} InputIterationTest.testDatasetAssertWithDynamicBatch")
def dataset_dynamic_batch(strategy, ctx):
    iterator = iter(strategy.experimental_distribute_dataset(_loader([5.0, 6.0, 7.0], 2)))
    results = [flat_local(strategy, strategy.run(torch.square, args=(next(iterator),))) for _ in range(2)]
    expected = [_worker_part(ctx, _split(ctx, b)) for b in ([25.0, 36.0], [49.0])]
    assert_equal(results, expected)


@case(f"{SRC} InputIterationTest.testDistributeDatasetIteratorWithoutFunction")
def distribute_datasets_from_function_unbatched(strategy, ctx):
    # Elements are scalars (TF's dataset_fn returns an unbatched dataset); each replica takes one.
    data = [5.0, 6.0, 7.0, 8.0]
    iterator = iter(strategy.distribute_datasets_from_function(lambda _: [torch.tensor(d) for d in data]))
    assert_equal(local(strategy, iterator.get_next()), data[0 : ctx.local_n])


@case(f"{SRC} InputIterationTest.testDistributeDatasetIteratorWithFunction", MULTI)
def distribute_datasets_from_function_values(strategy, ctx):
    data = [5.0, 6.0, 7.0, 8.0]
    iterator = iter(strategy.distribute_datasets_from_function(lambda _: [torch.tensor(d) for d in data]))
    local_results = strategy.experimental_local_results(iterator.get_next())
    assert_equal(local_results, data[0 : ctx.local_n])


@case(f"{SRC} InputIterationTest.testDynamicShapes", MULTI)
def dynamic_shapes(strategy, ctx):
    iterator = iter(strategy.experimental_distribute_dataset(_loader([5.0, 6.0, 7.0], 4)))
    outputs = strategy.run(lambda x: torch.mean(x), args=(next(iterator),))
    assert_equal(local(strategy, outputs), _worker_part(ctx, [[5.5], [7.0]]))


@case(f"{SRC} InputIterationTest.testDynamicShapesWithRunOptions", MULTI)
def dynamic_shapes_with_run_options(strategy, ctx):
    iterator = iter(strategy.experimental_distribute_dataset(_loader([5.0, 6.0, 7.0], 4)))
    options = px.RunOptions(experimental_bucketizing_dynamic_shape=True)
    outputs = strategy.run(lambda x: torch.mean(x), args=(next(iterator),), options=options)
    assert_equal(local(strategy, outputs), _worker_part(ctx, [[5.5], [7.0]]))


@case(f"{SRC} InputIterationTest.testStrategyReduceWithDynamicShapes", MULTI)
def reduce_with_dynamic_shapes(strategy, ctx):
    iterator = iter(strategy.experimental_distribute_dataset(_loader([5.0, 6.0, 7.0], 4)))
    assert_equal(strategy.reduce(px.ReduceOp.MEAN, next(iterator), axis=0), 6.0)


@case(f"{SRC} InputIterationTest.testStrategyReduceWithDynamicShapesRank2", MULTI)
def reduce_with_dynamic_shapes_rank2(strategy, ctx):
    iterator = iter(strategy.experimental_distribute_dataset(_loader([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]], 4)))
    assert_equal(strategy.reduce(px.ReduceOp.MEAN, next(iterator), axis=0), [1.0, 1.0])


@case(f"{SRC} InputIterationTest.testDynamicShapesWithSizeOp", MULTI)
def dynamic_shapes_with_size_op(strategy, ctx):
    iterator = iter(strategy.experimental_distribute_dataset(_loader([5.0, 6.0, 7.0], 4)))
    outputs = strategy.run(lambda x: torch.tensor(x.numel()), args=(next(iterator),))
    assert_equal(local(strategy, outputs), _worker_part(ctx, [[2], [1]]))


@case(f"{SRC} InputIterationTest.testDynamicShapesWithFirstReplicaNotMaximumShape", MULTI)
def dynamic_shapes_first_replica_not_maximum(strategy, ctx):
    # TF's dataset_fn yields batches of 2 rows: [[1, 2], [1, 2]] then [[1, 2, 3], [1, 2, 3]]; with
    # one pipeline per worker, replica 0 gets the first and replica 1 the second (means 1.5, 2.0);
    # under 2x1 each worker's pipeline gives its replica the first batch (1.5 on both).
    def dataset_fn(_):
        return [torch.tensor([[1.0, 2.0], [1.0, 2.0]]), torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])]

    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    outputs = strategy.run(lambda x: torch.mean(x), args=(next(iterator),))
    assert_equal(local(strategy, outputs), [1.5] if ctx.multi_worker else [1.5, 2.0])


@case(f"{SRC} InputIterationTest.testDatasetDistributeEvenlyDivisibleDrop")
def distribute_evenly_divisible_drop(strategy, ctx):
    data = next(iter(strategy.experimental_distribute_dataset(_loader([5.0, 6.0], 2, drop_last=True))))
    assert_equal(flat_local(strategy, data), _worker_part(ctx, _split(ctx, [5.0, 6.0])))


@case(f"{SRC} InputIterationTest.testDatasetDistributeNotDivisibleDrop")
def distribute_not_divisible_drop(strategy, ctx):
    # A global batch of 1 among 2 replicas: replica 0 gets [5.], replica 1 an empty batch.
    data = next(iter(strategy.experimental_distribute_dataset(_loader([5.0, 6.0], 1, drop_last=True))))
    assert_equal(flat_local(strategy, data), _worker_part(ctx, _split(ctx, [5.0])))


@case(f"{SRC} InputIterationTest.testDatasetDistributeEvenlyDivisibleNoDrop")
def distribute_evenly_divisible_no_drop(strategy, ctx):
    data = next(iter(strategy.experimental_distribute_dataset(_loader([5.0, 6.0], 2))))
    assert_equal(flat_local(strategy, data), _worker_part(ctx, _split(ctx, [5.0, 6.0])))


@case(f"{SRC} InputIterationTest.testDatasetPartialBatchWithMixedOutputs")
def partial_batch_with_mixed_outputs(strategy, ctx):
    iterator = iter(strategy.experimental_distribute_dataset(_loader([5.0], 2)))
    results = strategy.run(lambda x: (torch.zeros([3]), torch.square(x)), args=(next(iterator),))
    assert_equal(local(strategy, results[0]), [[0.0, 0.0, 0.0]] * ctx.local_n)
    squares = local(strategy, results[1])
    expected = [[25.0], []][: ctx.n] if not ctx.multi_worker else [[[25.0], []][ctx.worker]]
    assert_equal(squares, expected)


# TF's all_strategies: single-worker ones (its dataset_fn does not shard, so 2x1 workers would read alike).
@case(f"{SRC} InputIterationTest.testMultiDeviceDataCapturedFunction", SINGLE_WORKER)
def multi_device_data_captured(strategy, ctx):
    inputs = torch.tensor([2.0, 3.0])
    iterator = iter(strategy.distribute_datasets_from_function(lambda _: [inputs[i % 2] for i in range(10)]))
    with strategy.scope():
        var = px.Variable(1.0)

    def func(x):
        return torch.square(x) + var

    mean = None
    for _ in range(2):
        mean = strategy.reduce(px.ReduceOp.MEAN, strategy.run(func, (next(iterator),)), axis=None)
    # TF: 10.0 on one replica (3^2 + 1), 7.5 on two ((2^2 + 1 + 3^2 + 1) / 2).
    assert_close(mean, 10.0 if ctx.n == 1 else 7.5)


@case(f"{SRC} InputIterationTest.testDatasetOutOfRange")
def dataset_out_of_range(strategy, ctx):
    with strategy.scope():
        a = px.Variable(0.0, aggregation=px.VariableAggregation.SUM)

    def train_step(val):
        a.assign_add(torch.sum(val))

    iterator = iter(strategy.experimental_distribute_dataset(_loader([5.0, 6.0, 7.0, 8.0], 2)))
    # TF raises OutOfRangeError; phalanx's iterator ends as a Python iterator does.
    with raises(StopIteration):
        for _ in range(100):
            strategy.run(train_step, args=(next(iterator),))
    assert_close(a, 26.0)
