"""Cases translated from TF's tensorflow/python/distribute/input_lib_test.py and the input parts of
strategy_test_lib.py / mirrored_strategy_test.py (``_input_fn_to_test_input_context``,
``testReplicateDataset``): distributed datasets, their iterators and the InputContext TF gives.
"""

from __future__ import annotations

import torch

import phalanx as px
from tf_conformance.registry import ALL, SINGLE_WORKER, assert_equal, case, flat_local, local, raises

SRC = "input_lib_test.py"


def _loader(n, batch_size, drop_last=False):
    return torch.utils.data.DataLoader(torch.arange(n), batch_size=batch_size, drop_last=drop_last)


def _expected_local(ctx, batch):
    """This worker's part of a global batch, flattened, as TF splits it among the replicas."""
    if ctx.n == 1:
        return batch
    half = (len(batch) + 1) // 2
    parts = [batch[:half], batch[half:]]
    return parts[ctx.worker] if ctx.multi_worker else parts[0] + parts[1]


@case("mirrored_strategy_test.py MirroredTwoDeviceDistributionTest.testReplicateDataset (InputContext)")
def input_context_fields(strategy, ctx):
    # TF: one input pipeline per worker: Mirrored (one worker) num_input_pipelines=1, id 0; 2x1: 2, worker index.
    seen = []

    def dataset_fn(input_context):
        seen.append(
            (input_context.num_replicas_in_sync, input_context.num_input_pipelines, input_context.input_pipeline_id)
        )
        return _loader(10, 2)

    iter(strategy.distribute_datasets_from_function(dataset_fn)).get_next()
    expected = (ctx.n, 2, ctx.worker) if ctx.multi_worker else (ctx.n, 1, 0)
    assert seen and all(s == expected for s in seen), seen


@case("strategy_test_lib.py DistributionTestBase._input_fn_to_test_input_context (called once per worker)")
def dataset_fn_called_once_per_worker(strategy, ctx):
    # TF calls dataset_fn once per worker (the counter of _input_fn_to_test_input_context).
    calls = []

    def dataset_fn(input_context):
        calls.append(input_context.input_pipeline_id)
        return _loader(10, 2)

    iter(strategy.distribute_datasets_from_function(dataset_fn)).get_next()
    assert len(calls) == 1, calls
    total = strategy.reduce("SUM", strategy.run(lambda: torch.tensor(float(len(calls)))), axis=None)
    # Summed over the replicas: each replica process saw its worker's single call.
    assert_equal(total, float(ctx.n))


@case("strategy_common_test.py DistributedCollectiveAllReduceStrategyTest.testDatasetFromFunction (batch size)")
def get_per_replica_batch_size_in_dataset_fn(strategy, ctx):
    sizes = []

    def dataset_fn(input_context):
        sizes.append(input_context.get_per_replica_batch_size(10))
        return _loader(100, sizes[-1])

    iter(strategy.distribute_datasets_from_function(dataset_fn)).get_next()
    assert sizes == [10 // ctx.n], sizes


@case("mirrored_strategy_test.py MirroredTwoDeviceDistributionTest.testReplicateDataset (values)", SINGLE_WORKER)
def replicate_dataset_values(strategy, ctx):
    # TF: Dataset.range(10) through one pipeline, elements dealt to the replicas: [[0, 1], [2, 3], ...]
    # on two replicas, [[0], [1], ...] on one.
    iterator = iter(strategy.distribute_datasets_from_function(lambda _: [torch.tensor(i) for i in range(10)]))
    got = [local(strategy, iterator.get_next()) for _ in range(10 // ctx.n)]
    assert_equal(got, [list(range(i, i + ctx.n)) for i in range(0, 10, ctx.n)])


@case(f"{SRC} DistributedIteratorTest.testOutOfRange (StopIteration at the end)")
def iterator_stops(strategy, ctx):
    iterator = iter(strategy.experimental_distribute_dataset(_loader(4, 2)))
    next(iterator)
    next(iterator)
    with raises(StopIteration):
        next(iterator)


@case(f"{SRC} DistributedIteratorTest.testGetNextAsOptional (end of data)")
def get_next_as_optional_at_end(strategy, ctx):
    iterator = iter(strategy.experimental_distribute_dataset(_loader(4, 2)))
    assert iterator.get_next_as_optional().has_value()
    assert iterator.get_next_as_optional().has_value()
    assert not iterator.get_next_as_optional().has_value()


@case(f"{SRC} DistributedIteratorTest.testMultipleIteration (a dataset iterates anew)")
def dataset_iterates_twice(strategy, ctx):
    dataset = strategy.experimental_distribute_dataset(_loader(6, 2))
    first = [flat_local(strategy, x) for x in dataset]
    second = [flat_local(strategy, x) for x in dataset]
    assert first == second and len(first) == 3, (first, second)


@case(f"{SRC} DistributedIteratorTest.testIterator (iter of an iterator is itself)")
def iter_of_iterator(strategy, ctx):
    iterator = iter(strategy.experimental_distribute_dataset(_loader(4, 2)))
    assert iter(iterator) is iterator


@case(f"{SRC} DistributedIteratorTest.testUnevenDatasetBatches")
def uneven_dataset_batches(strategy, ctx):
    # range(9) in global batches of 4: [0..3], [4..7], [8]; the last one split unevenly.
    batches = [flat_local(strategy, x) for x in strategy.experimental_distribute_dataset(_loader(9, 4))]
    expected = [_expected_local(ctx, b) for b in ([0, 1, 2, 3], [4, 5, 6, 7])]
    if ctx.n == 1 or not ctx.multi_worker or ctx.worker == 0:
        expected.append([8])
    else:
        expected.append([])
    assert batches == expected, batches


@case(f"{SRC} DistributedIteratorTest.testUnevenDatasetBatches (global MEAN of the last batch)")
def uneven_last_batch_global_mean(strategy, ctx):
    batches = list(strategy.experimental_distribute_dataset(_loader(9, 4)))
    means = [float(strategy.reduce("MEAN", b.float() if hasattr(b, "float") else b, axis=0)) for b in batches]
    assert means == [1.5, 5.5, 8.0], means


@case(f"{SRC} DistributedIteratorTest (nested elements keep their structure)")
def nested_elements(strategy, ctx):
    data = torch.utils.data.TensorDataset(torch.arange(4), torch.arange(4) * 10)
    x, y = next(iter(strategy.experimental_distribute_dataset(torch.utils.data.DataLoader(data, batch_size=4))))
    assert_equal(flat_local(strategy, x), _expected_local(ctx, [0, 1, 2, 3]))
    assert_equal(flat_local(strategy, y), _expected_local(ctx, [0, 10, 20, 30]))


@case(f"{SRC} DistributedIteratorTest (dict elements)")
def dict_elements(strategy, ctx):
    batches = [{"a": torch.arange(4), "b": torch.ones(4)}]
    element = next(iter(strategy.experimental_distribute_dataset(batches)))
    assert isinstance(element, dict) and sorted(element) == ["a", "b"], element
    assert_equal(flat_local(strategy, element["a"]), _expected_local(ctx, [0, 1, 2, 3]))


@case(f"{SRC} DistributedDatasetTest (distribute_datasets_from_function, InputOptions accepted)", ALL)
def input_options_accepted(strategy, ctx):
    options = px.InputOptions(experimental_fetch_to_device=False)
    iterator = iter(strategy.experimental_distribute_dataset(_loader(4, 2), options=options))
    assert_equal(flat_local(strategy, next(iterator)), _expected_local(ctx, [0, 1]))
