"""Cases translated from TF's tensorflow/python/distribute/strategy_gather_test.py (GatherTest)."""

from __future__ import annotations

import torch

import phalanx as px
from tf_conformance.registry import MULTI, MULTI_WORKER, SINGLE_WORKER, assert_equal, case, raises

SRC = "strategy_gather_test.py"


def _gather_same_shape(strategy, ctx, value, axis):
    distributed = strategy.experimental_distribute_values_from_function(lambda _: value.clone())
    expected = torch.cat([value] * ctx.n, dim=axis)
    assert_equal(strategy.gather(distributed, axis=axis), expected)


def _all_gather_same_shape(strategy, ctx, value, axis):
    per_replica = strategy.experimental_distribute_values_from_function(lambda _: value.clone())

    def replica_fn(v):
        return px.get_replica_context().all_gather(v.clone(), axis=axis)

    result = strategy.experimental_local_results(strategy.run(replica_fn, args=(per_replica,)))
    expected = torch.cat([value] * ctx.n, dim=axis)
    assert_equal(list(result), [expected] * ctx.local_n)


_VALUES = {
    "1D0Axis": (torch.tensor([1, 2, 3]), 0),
    "2D0Axis": (torch.tensor([[1, 2, 3]]), 0),
    "2D1Axis": (torch.tensor([[1, 2, 3]]), 1),
    "3D0Axis": (torch.tensor([[[1, 2], [1, 2]]]), 0),
    "3D1Axis": (torch.tensor([[[1, 2], [1, 2]]]), 1),
    "3D2Axis": (torch.tensor([[[1, 2], [1, 2]]]), 2),
}


def _make_gather_case(suffix):
    def fn(strategy, ctx):
        value, axis = _VALUES[suffix]
        _gather_same_shape(strategy, ctx, value, axis)

    fn.__name__ = f"gather_per_replica_dense_{suffix.lower()}"
    return case(f"{SRC} GatherTest.testGatherPerReplicaDense{suffix}")(fn)


def _make_all_gather_case(suffix):
    def fn(strategy, ctx):
        value, axis = _VALUES[suffix]
        if suffix == "1D0Axis":
            value = value.float()  # TF's all_gather 1D case uses float32
        _all_gather_same_shape(strategy, ctx, value, axis)

    fn.__name__ = f"all_gather_per_replica_dense_{suffix.lower()}"
    return case(f"{SRC} GatherTest.testAllGatherPerReplicaDense{suffix}")(fn)


for _suffix in _VALUES:
    _make_gather_case(_suffix)
for _suffix in _VALUES:
    _make_all_gather_case(_suffix)


def _diff_shape(strategy, shape_fn):
    return strategy.experimental_distribute_values_from_function(
        lambda c: torch.ones(shape_fn(c.replica_id_in_sync_group), dtype=torch.int32)
    )


def _triangle(n):
    return sum(range(n + 1))


@case(f"{SRC} GatherTest.testGatherDiffShapeAtAxis0")
def gather_diff_shape_at_axis0(strategy, ctx):
    values = _diff_shape(strategy, lambda r: (r + 1, 1))
    assert_equal(strategy.gather(values, axis=0), torch.ones((_triangle(ctx.n), 1), dtype=torch.int32))


@case(f"{SRC} GatherTest.testGatherDiffShapeAtAxis1")
def gather_diff_shape_at_axis1(strategy, ctx):
    values = _diff_shape(strategy, lambda r: (1, r + 1))
    assert_equal(strategy.gather(values, axis=1), torch.ones((1, _triangle(ctx.n)), dtype=torch.int32))


@case(f"{SRC} GatherTest.testGatherRaiseDiffShapeAtNonAxis", MULTI)
def gather_raise_diff_shape_at_non_axis(strategy, ctx):
    # TF: InvalidArgumentError / ValueError ("Dimension 1 in both shapes must be equal" / "Shape mismatch").
    values = _diff_shape(strategy, lambda r: (1, r + 1))
    with raises(ValueError):
        strategy.gather(values, axis=0)


@case(f"{SRC} GatherTest.testGatherRaiseDifferentRank", MULTI)
def gather_raise_different_rank(strategy, ctx):
    values = strategy.experimental_distribute_values_from_function(
        lambda c: torch.ones(tuple(range(1, c.replica_id_in_sync_group + 2)))
    )
    with raises(ValueError):
        strategy.gather(values, axis=0)


@case(f"{SRC} GatherTest.testAllGatherDiffShapeAtAxis0")
def all_gather_diff_shape_at_axis0(strategy, ctx):
    values = _diff_shape(strategy, lambda r: (r + 1, 1))
    result = strategy.run(lambda v: px.get_replica_context().all_gather(v.clone(), axis=0), args=(values,))
    expect = torch.ones((_triangle(ctx.n), 1), dtype=torch.int32)
    assert_equal(list(strategy.experimental_local_results(result)), [expect] * ctx.local_n)


@case(f"{SRC} GatherTest.testAllGatherDiffShapeAtAxis1")
def all_gather_diff_shape_at_axis1(strategy, ctx):
    values = _diff_shape(strategy, lambda r: (1, r + 1))
    result = strategy.run(lambda v: px.get_replica_context().all_gather(v.clone(), axis=1), args=(values,))
    expect = torch.ones((1, _triangle(ctx.n)), dtype=torch.int32)
    assert_equal(list(strategy.experimental_local_results(result)), [expect] * ctx.local_n)


@case(f"{SRC} GatherTest.testAllGatherNest")
def all_gather_nest(strategy, ctx):
    values = _diff_shape(strategy, lambda r: (1, r + 1))
    value_2 = torch.tensor([[[1, 2], [1, 2]]])

    def run(v):
        return px.get_replica_context().all_gather([v.clone(), value_2.clone()], axis=1)

    result = strategy.run(run, args=(values,))
    expect_1 = torch.ones((1, _triangle(ctx.n)), dtype=torch.int32)
    expect_2 = torch.cat([value_2] * ctx.n, dim=1)
    assert_equal(list(strategy.experimental_local_results(result[0])), [expect_1] * ctx.local_n)
    assert_equal(list(strategy.experimental_local_results(result[1])), [expect_2] * ctx.local_n)


@case(f"{SRC} GatherTest.testAllGatherNest1D0Axis")
def all_gather_nest_1d_axis0(strategy, ctx):
    single = torch.tensor([1, 2, 3])
    result = strategy.run(lambda: px.get_replica_context().all_gather([single.clone(), single.clone()], axis=0))
    expect = torch.cat([single] * ctx.n, dim=0)
    for gathered in result:
        assert_equal(list(strategy.experimental_local_results(gathered)), [expect] * ctx.local_n)


@case(f"{SRC} GatherTest.testAllGatherRaiseDiffShapeAtNonAxis", MULTI)
def all_gather_raise_diff_shape_at_non_axis(strategy, ctx):
    values = _diff_shape(strategy, lambda r: (1, r + 1))

    def run(v):
        with raises(ValueError):
            px.get_replica_context().all_gather(v.clone(), axis=0)

    strategy.run(run, args=(values,))


@case(f"{SRC} GatherTest.testAllGatherRaiseDifferentRank", MULTI)
def all_gather_raise_different_rank(strategy, ctx):
    values = strategy.experimental_distribute_values_from_function(
        lambda c: torch.ones(tuple(range(1, c.replica_id_in_sync_group + 2)))
    )

    def run(v):
        with raises(ValueError):
            px.get_replica_context().all_gather(v.clone(), axis=0)

    strategy.run(run, args=(values,))


def _all_gather_gradient(strategy, ctx, nested):
    gradient_comp = float(sum(range(1, ctx.n + 1)))

    def step(c):
        x = torch.tensor([[3.0], [5.0]], requires_grad=True)
        y = torch.tensor([[2.0], [4.0]], requires_grad=True)
        gathered = px.get_replica_context().all_gather([x, y] if nested else x, axis=1)
        mid = gathered[0] if nested else gathered
        (grad,) = torch.autograd.grad((mid * c).sum(), [x])
        return grad

    per_replica = strategy.experimental_distribute_values_from_function(
        lambda c: torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0][c.replica_id_in_sync_group]])
    )
    result = strategy.experimental_local_results(strategy.run(step, args=(per_replica,)))
    assert_equal(list(result), [[[gradient_comp], [gradient_comp]]] * ctx.local_n)


@case(f"{SRC} GatherTest.testAllGatherGradient")
def all_gather_gradient(strategy, ctx):
    _all_gather_gradient(strategy, ctx, nested=False)


@case(f"{SRC} GatherTest.testAllGatherGradientNest")
def all_gather_gradient_nest(strategy, ctx):
    _all_gather_gradient(strategy, ctx, nested=True)


@case(f"{SRC} GatherTest.testGatherPerReplicaDense (host tensor)", SINGLE_WORKER)
def gather_host_tensor(strategy, ctx):
    # TF 2.21 CPU (OneDevice and Mirrored): gather of a non-distributed tensor returns it unchanged.
    assert_equal(strategy.gather(torch.tensor([1.0, 2.0]), axis=0), [1.0, 2.0])


@case(f"{SRC} GatherTest.testGatherPerReplicaDense (host tensor, 2x1)", (MULTI_WORKER,))
def gather_host_tensor_multi_worker(strategy, ctx):
    # TF 2.21 CPU, MultiWorkerMirrored 2x1 (two processes, TF_CONFIG): each worker's tensor is its
    # replica's value, so gather concatenates them: [1., 2., 1., 2.] (as testReduceHostTensor sums them).
    assert_equal(strategy.gather(torch.tensor([1.0, 2.0]), axis=0), [1.0, 2.0, 1.0, 2.0])


@case(f"{SRC} GatherTest.testGatherPerReplicaDense (nested)")
def gather_nested_structure(strategy, ctx):
    a = strategy.experimental_distribute_values_from_function(lambda c: torch.tensor([c.replica_id_in_sync_group]))
    b = strategy.experimental_distribute_values_from_function(lambda c: torch.tensor([[1.0, 2.0]]))
    got = strategy.gather({"a": a, "b": b}, axis=0)
    assert_equal(got, {"a": list(range(ctx.n)), "b": [[1.0, 2.0]] * ctx.n})
