"""The Strategy API in one process: contexts, values, default strategy, bad input (no peers needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import phalanx as px
from phalanx.devices import canonicalize
from phalanx.errors import (
    ContextError,
    InvalidDeviceError,
    NotCallableError,
    ReduceOpError,
    StrategyScopeError,
)


def test_default_strategy_and_contexts():
    assert not px.has_strategy()
    assert not px.in_cross_replica_context()
    default = px.get_strategy()
    assert default.num_replicas_in_sync == 1
    ctx = px.get_replica_context()
    assert ctx is not None and ctx.replica_id_in_sync_group == 0 and ctx.strategy is default
    strategy = px.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        assert px.has_strategy() and px.in_cross_replica_context()
        assert px.get_strategy() is strategy and px.get_replica_context() is None
        assert px.get_cross_replica_context() is strategy

        def fn():
            assert not px.in_cross_replica_context()
            rc = px.get_replica_context()
            assert rc.num_replicas_in_sync == 1 and rc.replica_id_in_sync_group == 0
            return rc.replica_id_in_sync_group

        assert strategy.run(fn) == 0
    assert not px.has_strategy()


def test_run_in_replica_context_outside_scope():
    strategy = px.OneDeviceStrategy("cpu")
    seen = strategy.run(lambda: (px.get_strategy() is strategy, px.in_cross_replica_context()))
    assert seen == (True, False)


def test_merge_call_runs_in_cross_replica_context():
    strategy = px.OneDeviceStrategy("cpu")

    def merge_fn(s, value):
        assert s is strategy and px.in_cross_replica_context()
        return s.reduce(px.ReduceOp.SUM, value, axis=None) + 1

    out = strategy.run(lambda: px.get_replica_context().merge_call(merge_fn, args=(torch.tensor(2.0),)))
    assert out.item() == 3.0


def test_all_reduce_and_all_gather_single_replica():
    strategy = px.OneDeviceStrategy("cpu")

    def fn():
        ctx = px.get_replica_context()
        s = ctx.all_reduce("sum", {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor(3)})
        g = ctx.all_gather(torch.arange(3), axis=0)
        return s, g

    s, g = strategy.run(fn)
    assert torch.equal(s["a"], torch.tensor([1.0, 2.0])) and s["b"].item() == 3
    assert torch.equal(g, torch.arange(3))


def test_reduce_with_axis_and_gather_single_replica():
    strategy = px.OneDeviceStrategy("cpu")
    value = strategy.run(lambda: torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert torch.equal(strategy.reduce("SUM", value, axis=0), torch.tensor([4.0, 6.0]))
    assert torch.equal(strategy.reduce("MEAN", value, axis=0), torch.tensor([2.0, 3.0]))
    assert torch.equal(strategy.reduce("MEAN", value, axis=None), value)
    assert torch.equal(strategy.gather(value, axis=0), value)


def test_values_and_local_results():
    v = px.PerReplica((torch.tensor(1.0), torch.tensor(2.0)))
    assert len(v) == 2 and "PerReplica" in repr(v)
    with pytest.raises(TypeError):
        iter(v)
    strategy = px.OneDeviceStrategy("cpu")
    assert strategy.experimental_local_results(v) == v.values
    assert strategy.experimental_local_results(torch.tensor(5.0)) == (torch.tensor(5.0),)
    m = px.Mirrored((torch.tensor(3.0),))
    assert strategy.experimental_local_results({"m": m})[0]["m"].item() == 3.0
    with pytest.raises(TypeError):
        px.PerReplica(())


def test_distribute_values_from_function():
    strategy = px.OneDeviceStrategy("cpu")
    v = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor(ctx.replica_id_in_sync_group * 10 + ctx.num_replicas_in_sync)
    )
    assert v.item() == 1


def test_experimental_run_v2_alias():
    strategy = px.OneDeviceStrategy("cpu")
    assert strategy.experimental_run_v2(lambda a, b=0: a + b, args=(1,), kwargs={"b": 2}) == 3


@pytest.mark.parametrize(
    "name,expected",
    [
        ("cpu", "cpu:0"),
        ("/cpu:0", "cpu:0"),
        ("CPU:1", "cpu:1"),
        ("cpu:3", "cpu:3"),
        ("/job:localhost/replica:0/task:0/device:CPU:0", "cpu:0"),
        (torch.device("cpu"), "cpu:0"),
    ],
)
def test_device_names(name, expected):
    assert str(canonicalize(name)) == expected


@pytest.mark.parametrize("bad", ["tpu:0", "gpu:x", "", "/job:w/device:FOO:0", 7, None, "cuda:99", "/gpu:0"])
def test_unknown_device_raises_typed_error_naming_it(bad):
    if bad in ("/gpu:0",) and torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    with pytest.raises(InvalidDeviceError) as e:
        px.OneDeviceStrategy(bad)
    assert repr(bad) in str(e.value)


def test_mirrored_duplicate_device_is_refused():
    with pytest.raises(InvalidDeviceError, match="cpu:0"):
        px.MirroredStrategy(["cpu:0", "cpu:0"])


def test_mirrored_single_cpu_replica_in_process():
    strategy = px.MirroredStrategy(["cpu:0"])
    assert strategy.num_replicas_in_sync == 1
    assert strategy.extended.worker_devices == ("/job:localhost/replica:0/task:0/device:CPU:0",)
    assert strategy.extended.parameter_devices == strategy.extended.worker_devices
    assert strategy.extended.should_checkpoint and strategy.cluster_resolver is None


def test_mirrored_multi_replica_refuses_to_self_launch_inside_pytest():
    from phalanx.errors import LaunchError

    with pytest.raises(LaunchError, match="phalanx run"):
        px.MirroredStrategy(["cpu:0", "cpu:1"])


def test_run_rejects_non_callable():
    with pytest.raises(NotCallableError, match="42"):
        px.OneDeviceStrategy("cpu").run(42)


@pytest.mark.parametrize("op", ["MAX", "average", 3, None])
def test_reduce_rejects_unknown_op(op):
    strategy = px.OneDeviceStrategy("cpu")
    with pytest.raises(ReduceOpError) as e:
        strategy.reduce(op, torch.tensor(1.0), axis=None)
    assert repr(op) in str(e.value)


def test_nested_scopes_of_two_strategies_are_refused():
    a, b = px.OneDeviceStrategy("cpu"), px.OneDeviceStrategy("cpu")
    with a.scope():
        with a.scope():  # re-entering the same strategy is fine
            pass
        with pytest.raises(StrategyScopeError, match="OneDeviceStrategy"):
            with b.scope():
                pass


def test_reduce_in_replica_context_is_refused():
    strategy = px.OneDeviceStrategy("cpu")
    with pytest.raises(ContextError, match="all_reduce"):
        strategy.run(lambda: strategy.reduce("SUM", torch.tensor(1.0), axis=None))


def test_scope_places_parameters_and_records_them():
    strategy = px.OneDeviceStrategy("cpu")
    with strategy.scope():
        model = torch.nn.Linear(3, 2)
        bn = torch.nn.BatchNorm1d(2)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert len(strategy.extended.mirrored_buffers) == 2  # bn running mean/var (num_batches_tracked is int)
    assert bn.running_mean.device.type == "cpu"


def test_compute_average_loss_and_regularization():
    per_example = torch.tensor([1.0, 2.0, 3.0, 6.0])
    assert px.nn.compute_average_loss(per_example, global_batch_size=8).item() == 1.5
    assert px.nn.compute_average_loss(per_example, sample_weight=0.5, global_batch_size=4).item() == 1.5
    assert px.nn.compute_average_loss(per_example).item() == 3.0  # default strategy: batch * 1 replica
    with pytest.raises(ValueError, match="-2"):
        px.nn.compute_average_loss(per_example, global_batch_size=-2)
    assert px.nn.scale_regularization_loss(torch.tensor(4.0)).item() == 4.0


def test_distribute_dataset_one_device_numpy_and_dicts():
    strategy = px.OneDeviceStrategy("cpu")
    batches = [
        {"x": np.ones((4, 2), np.float32), "y": np.arange(4)},
        {"x": np.zeros((2, 2), np.float32), "y": np.arange(2)},
    ]
    seen = [(b["x"].shape[0], type(b["x"]).__name__) for b in strategy.experimental_distribute_dataset(batches)]
    assert seen == [(4, "Tensor"), (2, "Tensor")]


def test_distribute_dataset_rejects_inconsistent_batch():
    strategy = px.OneDeviceStrategy("cpu")
    with pytest.raises(ValueError, match=r"\[2, 3\]"):
        list(strategy.experimental_distribute_dataset([(torch.ones(2, 1), torch.ones(3))]))


def test_a_first_batch_smaller_than_the_replicas_is_split_as_tf_splits_it_with_a_warning():
    from phalanx.input import SmallBatchWarning
    from phalanx.input.distributed_dataset import DistributedDataset
    from phalanx.values import local_results

    class TwoReplicas:  # only the number of replicas matters to the splitting logic (the real
        num_replicas_in_sync = 2  # 2-process case: test_mirrored_api)
        extended = px.OneDeviceStrategy("cpu").extended

        def _wrap_local(self, value):
            return value

    # TF custom_training_loop_input_test testDatasetDistributeNotDivisibleDrop: a global batch of 1
    # gives replica 0 the example and replica 1 an empty batch.
    with pytest.warns(SmallBatchWarning, match="1 example.*2 replicas"):
        (batch,) = list(DistributedDataset(TwoReplicas(), [torch.ones(1, 3)]))
    assert tuple(local_results(batch)[0].shape) == (1, 3)


def test_slice_bounds_cover_the_batch_exactly():
    from phalanx.input.distributed_dataset import slice_bounds

    for batch in range(0, 40):
        for n in range(1, 6):
            bounds = [slice_bounds(batch, n, r) for r in range(n)]
            assert bounds[0][0] == 0 and bounds[-1][1] == batch
            assert all(bounds[i][1] == bounds[i + 1][0] for i in range(n - 1))
            assert max(e - s for s, e in bounds) - min(e - s for s, e in bounds) <= 1


def test_input_context():
    ctx = px.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    assert ctx.get_per_replica_batch_size(64) == 16
    with pytest.raises(ValueError, match="63"):
        ctx.get_per_replica_batch_size(63)


def test_distribute_datasets_from_function_single_replica():
    strategy = px.OneDeviceStrategy("cpu")
    seen = []

    def dataset_fn(ctx):
        seen.append(ctx)
        return [torch.ones(ctx.get_per_replica_batch_size(4), 2)] * 3

    batches = list(strategy.distribute_datasets_from_function(dataset_fn))
    assert len(batches) == 3 and batches[0].shape == (4, 2)
    assert seen[0] == px.InputContext(1, 0, 1)


# TF's context guards (tensorflow/python/distribute: distribute_lib's _require_cross_replica_or_default_context
# and require_replica_context, nn_impl's compute_average_loss/scale_regularization_loss): each raises
# RuntimeError in TF; ContextError is a RuntimeError, so a ported `except RuntimeError` still catches it.
def test_run_inside_run_is_refused_as_in_tf():
    strategy = px.OneDeviceStrategy("cpu")
    with pytest.raises(ContextError, match="inside strategy.run") as raised:
        strategy.run(lambda: strategy.run(lambda: torch.ones(1)))
    assert isinstance(raised.value, RuntimeError)
    assert strategy.extended.step == 1  # the nested call started no step
    # merge_call's function is cross-replica context: run may be called there (TF allows it too).
    out = strategy.run(lambda: px.get_replica_context().merge_call(lambda s: s.run(lambda: torch.ones(1) * 2)))
    assert out.item() == 2.0


def test_replica_context_collectives_are_refused_in_cross_replica_context_as_in_tf():
    strategy = px.OneDeviceStrategy("cpu")
    captured = []
    strategy.run(lambda: captured.append(px.get_replica_context()))
    (ctx,) = captured
    with strategy.scope():
        for call in (
            lambda: ctx.all_reduce("sum", torch.ones(1)),
            lambda: ctx.all_gather(torch.ones(1), axis=0),
            lambda: ctx.merge_call(lambda s: 1),
        ):
            with pytest.raises(ContextError, match="replica context"):
                call()
    # Outside any strategy the default replica context works, as TF's does.
    assert px.get_replica_context().all_reduce("sum", torch.ones(1)).item() == 1.0


def test_loss_scaling_helpers_are_refused_in_cross_replica_context_as_in_tf():
    strategy = px.OneDeviceStrategy("cpu")
    with strategy.scope():
        with pytest.raises(ContextError, match="compute_average_loss"):
            px.nn.compute_average_loss(torch.ones(4))
        # With global_batch_size there is no replica batch to count: TF computes it there too.
        assert px.nn.compute_average_loss(torch.ones(4), global_batch_size=8).item() == 0.5
        with pytest.raises(ContextError, match="scale_regularization_loss"):
            px.nn.scale_regularization_loss(torch.ones(()))
    # In replica context, and with the default strategy, they compute.
    assert strategy.run(lambda: px.nn.compute_average_loss(torch.ones(4), global_batch_size=8)).item() == 0.5
    assert px.nn.compute_average_loss(torch.ones(4), global_batch_size=8).item() == 0.5
