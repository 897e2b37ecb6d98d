"""Cases translated from TF's tensorflow/python/distribute/strategy_test_lib.py (the shared
DistributionTestBase / OneDeviceDistributionTestBase / TwoDeviceDistributionTestBase checks, which
mirrored_strategy_test.py, one_device_strategy_test.py and others run).

TF's inputs come from ``make_input_fn_iterator(Dataset.from_tensor_slices(inputs))``: replica r's
element is ``inputs[r]``; here replica r computes its element itself.
"""

from __future__ import annotations

import torch

import phalanx as px
from tf_conformance.registry import MULTI, ONE_DEVICE, assert_close, assert_equal, case, local, raises

SRC = "strategy_test_lib.py"


class _TestException(Exception):
    pass


def _raise_exception_fn(_=None):
    raise _TestException()


def _merge_raises_fn():
    px.get_replica_context().merge_call(_raise_exception_fn)


def _call_raises_fn(dist):
    dist.run(_raise_exception_fn)


def _merge_call_raises_fn():
    px.get_replica_context().merge_call(_call_raises_fn)


def _call_merge_raises_fn(dist):
    dist.run(_merge_raises_fn)


def _merge_call_merge_raises_fn():
    px.get_replica_context().merge_call(_call_merge_raises_fn)


def _rid() -> int:
    return px.get_replica_context().replica_id_in_sync_group


def _mine(strategy, ctx, values):
    """This worker's part of a per-replica list (every replica's on single-host strategies)."""
    return [values[ctx.rank]] if ctx.multi_worker else values


@case(f"{SRC} DistributionTestBase._test_replica_id")
def replica_id(strategy, ctx):
    seen = []

    def mark():
        seen.append(_rid())

    with strategy.scope():
        strategy.run(mark)
    assert seen == [ctx.rank], seen  # this process's replica: each replica once over the job
    ids = strategy.gather(strategy.run(lambda: torch.tensor([_rid()])), axis=0)
    assert_equal(ids, list(range(ctx.n)))


@case(f"{SRC} DistributionTestBase._test_call_and_merge_exceptions (raise in fn)")
def call_raises(strategy, ctx):
    with strategy.scope(), raises(_TestException):
        strategy.run(_raise_exception_fn)


@case(f"{SRC} DistributionTestBase._test_call_and_merge_exceptions (raise in merge_fn)")
def merge_raises(strategy, ctx):
    with strategy.scope(), raises(_TestException):
        strategy.run(_merge_raises_fn)


@case(f"{SRC} DistributionTestBase._test_call_and_merge_exceptions (run in merge_fn raises)")
def merge_call_raises(strategy, ctx):
    with strategy.scope(), raises(_TestException):
        strategy.run(_merge_call_raises_fn)


@case(f"{SRC} DistributionTestBase._test_call_and_merge_exceptions (merge in run in merge raises)")
def merge_call_merge_raises(strategy, ctx):
    with strategy.scope(), raises(_TestException):
        strategy.run(_merge_call_merge_raises_fn)


@case(f"{SRC} DistributionTestBase._test_global_step_update")
def global_step_update(strategy, ctx):
    with strategy.scope():
        global_step = px.Variable(
            torch.tensor(0, dtype=torch.int64),
            trainable=False,
            aggregation=px.VariableAggregation.ONLY_FIRST_REPLICA,
        )

    def model_fn():
        global_step.assign_add(1)
        return global_step.read_value()

    value = strategy.run(model_fn)
    assert_equal(local(strategy, value), [1] * ctx.local_n)


@case(f"{SRC} DistributionTestBase._test_trainable_variable")
def trainable_variable(strategy, ctx):
    on_read = px.VariableSynchronization.ON_READ
    with strategy.scope():
        v1 = px.Variable(1.0)
        v2 = px.Variable(1.0, synchronization=on_read)
        v3 = px.Variable(1.0, synchronization=on_read, trainable=True)
        v4 = px.Variable(1.0, synchronization=on_read, trainable=False)
    assert [v1.trainable, v2.trainable, v3.trainable, v4.trainable] == [True, False, True, False]


@case(f"{SRC} OneDeviceDistributionTestBase._test_run", (ONE_DEVICE,))
def run_one_device(strategy, ctx):
    out1 = strategy.run(lambda: torch.tensor(4.0))
    assert_equal(local(strategy, out1), [4.0])
    out2 = strategy.run(lambda x: {"a": x * 2, "b": x * x}, args=(out1,))
    assert_equal(local(strategy, out2["a"]), [8.0])
    assert_equal(local(strategy, out2["b"]), [16.0])
    out3 = strategy.run(lambda b, a: a + 2 * b + 2, kwargs=out2)
    assert_equal(local(strategy, out3), [42.0])


@case(f"{SRC} TwoDeviceDistributionTestBase._test_run", MULTI)
def run_two_device(strategy, ctx):
    out1 = strategy.run(lambda: torch.tensor(_rid() + 1))
    assert_equal(local(strategy, out1), _mine(strategy, ctx, [1, 2]))
    out2 = strategy.run(lambda x: {"a": x * 2, "b": x * x}, args=(out1,))
    assert_equal(local(strategy, out2["a"]), _mine(strategy, ctx, [2, 4]))
    assert_equal(local(strategy, out2["b"]), _mine(strategy, ctx, [1, 4]))
    out3 = strategy.run(lambda b, a: a + 2 * b + 2, kwargs=out2)
    assert_equal(local(strategy, out3), _mine(strategy, ctx, [6, 14]))


def _all_sum(value):
    return px.get_replica_context().all_reduce(px.ReduceOp.SUM, value)


def _all_mean(value):
    return px.get_replica_context().all_reduce(px.ReduceOp.MEAN, value)


def _inputs(ctx, one, two):
    """TF's per-replica element: ``one`` on one replica, ``two[r]`` on replica r of two."""
    return one if ctx.n == 1 else two


@case(f"{SRC} OneDevice/TwoDeviceDistributionTestBase._test_all_reduce_sum")
def all_reduce_sum(strategy, ctx):
    inputs = _inputs(ctx, (4.0, [42.0, 43.0]), None)
    if inputs is None:
        inputs = ([1.0, 3.0][ctx.rank], [[39.0, 2.0], [3.0, 41.0]][ctx.rank])
    outputs = strategy.run(lambda a, b: (_all_sum(torch.tensor(a)), _all_sum(torch.tensor(b))), args=inputs)
    assert_equal(local(strategy, outputs[0]), [4.0] * ctx.local_n)
    assert_equal(local(strategy, outputs[1]), [[42.0, 43.0]] * ctx.local_n)


@case(f"{SRC} OneDevice/TwoDeviceDistributionTestBase._test_all_reduce_mean")
def all_reduce_mean(strategy, ctx):
    inputs = _inputs(ctx, (2.0, [21.0, 22.0]), None)
    if inputs is None:
        inputs = ([1.0, 3.0][ctx.rank], [[39.0, 2.0], [3.0, 41.0]][ctx.rank])
    outputs = strategy.run(lambda a, b: (_all_mean(torch.tensor(a)), _all_mean(torch.tensor(b))), args=inputs)
    assert_equal(local(strategy, outputs[0]), [2.0] * ctx.local_n)
    assert_equal(local(strategy, outputs[1]), [[21.0, 21.5] if ctx.n == 2 else [21.0, 22.0]] * ctx.local_n)


def _gradient_tape(strategy, ctx, comm_fn, one, two):
    c = one if ctx.n == 1 else two[ctx.rank]

    def step(c):
        x = torch.tensor(42.0, requires_grad=True)
        y = comm_fn(x) * c
        (grad,) = torch.autograd.grad(y, [x])
        return grad

    return local(strategy, strategy.run(step, args=(torch.tensor(c),)))


@case(f"{SRC} OneDevice/TwoDeviceDistributionTestBase._test_all_reduce_sum_gradient_tape")
def all_reduce_sum_gradient_tape(strategy, ctx):
    got = _gradient_tape(strategy, ctx, _all_sum, 4.0, [1.0, 3.0])
    assert_equal(got, [4.0] * ctx.local_n)


@case(f"{SRC} OneDevice/TwoDeviceDistributionTestBase._test_all_reduce_mean_gradient_tape")
def all_reduce_mean_gradient_tape(strategy, ctx):
    got = _gradient_tape(strategy, ctx, _all_mean, 5.0, [1.0, 3.0])
    assert_equal(got, [5.0 if ctx.n == 1 else 2.0] * ctx.local_n)


@case(f"{SRC} OneDevice/TwoDeviceDistributionTestBase._test_all_reduce_sum_gradients (backward)")
def all_reduce_sum_gradients_backward(strategy, ctx):
    # TF's tf.gradients variant; torch's counterpart is .backward() into a leaf's .grad.
    c = 4.0 if ctx.n == 1 else [1.0, 3.0][ctx.rank]

    def step():
        x = torch.tensor(42.0, requires_grad=True)
        (_all_sum(x) * c).backward()
        return x.grad

    assert_equal(local(strategy, strategy.run(step)), [4.0] * ctx.local_n)


@case(f"{SRC} OneDevice/TwoDeviceDistributionTestBase._test_all_reduce_mean_gradients (backward)")
def all_reduce_mean_gradients_backward(strategy, ctx):
    c = 5.0 if ctx.n == 1 else [1.0, 3.0][ctx.rank]

    def step():
        x = torch.tensor(42.0, requires_grad=True)
        (_all_mean(x) * c).backward()
        return x.grad

    assert_equal(local(strategy, strategy.run(step)), [5.0 if ctx.n == 1 else 2.0] * ctx.local_n)


@case(f"{SRC} DistributionTestBase._test_minimize_loss_eager (one step equals one device)")
def minimize_loss_eager(strategy, ctx):
    # TF's test trains y = x * w toward 0 with SGD until the loss falls; here one step of the
    # replicas' mean gradient must equal the one-device step on the global batch.
    with strategy.scope():
        layer = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(2.0)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    global_x = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    per = global_x.shape[0] // ctx.n
    mine = global_x[ctx.rank * per : (ctx.rank + 1) * per]

    def step(x):
        loss = px.nn.compute_average_loss((layer(x) ** 2).sum(dim=1), global_batch_size=4)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    strategy.run(step, args=(mine,))
    # one device: d/dw mean((w x)^2) = 2 w mean(x^2) = 2 * 2 * 7.5 = 30; w = 2 - 0.1 * 30 = -1
    assert_close(layer.weight.detach().reshape(()), -1.0)
