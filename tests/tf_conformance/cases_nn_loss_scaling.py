"""Cases translated from TF's tensorflow/python/ops/nn_loss_scaling_utilities_test.py.

TF's ``tf.nn.compute_average_loss`` / ``scale_regularization_loss`` are ``phalanx.nn``'s. TF runs
most of these under Mirrored over 2 CPUs; here they run under every strategy, the expected value
written for ``n`` replicas.
"""

from __future__ import annotations

import numpy as np
import torch

import phalanx as px
from tf_conformance.registry import assert_close, assert_equal, case, local, raises

SRC = "nn_loss_scaling_utilities_test.py"


@case(f"{SRC} LossUtilitiesTest.testComputeAverageLossGlobalBatchSize")
def compute_average_loss_global_batch_size(strategy, ctx):
    # Outside any scope and any run: the default strategy's replica context.
    loss = px.nn.compute_average_loss(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), global_batch_size=10)
    assert_equal(loss, 1.5)


@case(f"{SRC} LossUtilitiesTest.testComputeAverageLossGlobalBatchSize (in run)")
def compute_average_loss_global_batch_size_in_run(strategy, ctx):
    out = strategy.run(
        lambda: px.nn.compute_average_loss(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), global_batch_size=10)
    )
    assert_equal(local(strategy, out), [1.5] * ctx.local_n)


@case(f"{SRC} LossUtilitiesTest.testComputeAverageLossDefaultGlobalBatchSize")
def compute_average_loss_default_no_strategy(strategy, ctx):
    loss = px.nn.compute_average_loss(torch.tensor([2.5, 6.2, 5.0]))
    assert_close(loss, (2.5 + 6.2 + 5.0) / 3)


@case(f"{SRC} LossUtilitiesTest.testComputeAverageLossDefaultGlobalBatchSize")
def compute_average_loss_default_global_batch_size(strategy, ctx):
    per_example_loss = torch.tensor([2.5, 6.2, 5.0])
    with strategy.scope():
        per_replica = strategy.run(px.nn.compute_average_loss, args=(per_example_loss,))
        loss = strategy.reduce("SUM", per_replica, axis=None)
    assert_close(loss, (2.5 + 6.2 + 5.0) / 3)


@case(f"{SRC} LossUtilitiesTest.testComputeAverageLossSampleWeights (scalar weight)")
def compute_average_loss_scalar_sample_weight(strategy, ctx):
    with strategy.scope():
        per_replica = strategy.run(
            px.nn.compute_average_loss, args=(torch.tensor([2.0, 4.0, 6.0]),), kwargs={"sample_weight": 2}
        )
        loss = strategy.reduce("SUM", per_replica, axis=None)
    assert_close(loss, (2.0 + 4.0 + 6.0) * 2.0 / 3)


@case(f"{SRC} LossUtilitiesTest.testComputeAverageLossSampleWeights (per-example weight)")
def compute_average_loss_per_example_sample_weight(strategy, ctx):
    with strategy.scope():
        per_replica = strategy.run(
            px.nn.compute_average_loss,
            args=(torch.tensor([2.0, 4.0, 6.0]),),
            kwargs={"sample_weight": torch.tensor([0.3, 0.5, 0.2])},
        )
        loss = strategy.reduce("SUM", per_replica, axis=None)
    assert_close(loss, (2.0 * 0.3 + 4.0 * 0.5 + 6.0 * 0.2) / 3)


@case(f"{SRC} LossUtilitiesTest.testComputeAverageLossSampleWeights (time-step weight)")
def compute_average_loss_time_step_sample_weight(strategy, ctx):
    with strategy.scope():
        per_replica = strategy.run(
            px.nn.compute_average_loss,
            args=(torch.tensor([[2.0, 0.5], [4.0, 1.0]]),),
            kwargs={"sample_weight": torch.tensor([[0.3, 0.7], [0.2, 0.8]])},
        )
        loss = strategy.reduce("SUM", per_replica, axis=None)
    assert_close(loss, (2.0 * 0.3 + 0.5 * 0.7 + 4.0 * 0.2 + 1.0 * 0.8) / 2)


@case(f"{SRC} LossUtilitiesTest.testComputeAverageLossInvalidSampleWeights")
def compute_average_loss_invalid_sample_weights(strategy, ctx):
    # TF: ValueError or InvalidArgumentError "Incompatible shapes: [3] vs. [2]"; torch's broadcast
    # error is a RuntimeError: either of the two classes TF's test accepts is taken.
    with raises(ValueError, RuntimeError):
        px.nn.compute_average_loss(
            torch.tensor([2.5, 6.2, 5.0]), sample_weight=torch.tensor([0.2, 0.8]), global_batch_size=10
        )


@case(f"{SRC} LossUtilitiesTest.testComputeAverageLossDtype")
def compute_average_loss_dtype(strategy, ctx):
    with strategy.scope():
        per_replica = strategy.run(
            px.nn.compute_average_loss,
            args=(torch.tensor([2.0, 4.0, 6.0], dtype=torch.float64),),
            kwargs={"sample_weight": 2},
        )
        loss = strategy.reduce("SUM", per_replica, axis=None)
    assert loss.dtype == torch.float64, loss.dtype


@case(f"{SRC} LossUtilitiesTest.testComputeAverageLossInvalidRank")
def compute_average_loss_invalid_rank(strategy, ctx):
    with raises(ValueError, match="rank"):
        px.nn.compute_average_loss(torch.tensor(2.0))


@case(f"{SRC} LossUtilitiesTest.testComputeAverageLossInvalidRank (in run)")
def compute_average_loss_invalid_rank_in_run(strategy, ctx):
    def step():
        with raises(ValueError):
            px.nn.compute_average_loss(torch.tensor(2.0))

    strategy.run(step)


@case(f"{SRC} LossUtilitiesTest.testComputeAverageLossInCrossReplicaContext")
def compute_average_loss_in_cross_replica_context(strategy, ctx):
    with strategy.scope(), raises(RuntimeError, match="compute_average_loss"):
        px.nn.compute_average_loss(torch.tensor([2.0, 3.0]))


@case(f"{SRC} LossUtilitiesTest.testComputeAverageLossInCrossReplicaContext (global_batch_size given)")
def compute_average_loss_cross_replica_with_global_batch_size(strategy, ctx):
    # TF 2.21 CPU returns 1.25: with global_batch_size given, cross-replica context is accepted.
    with strategy.scope():
        assert_equal(px.nn.compute_average_loss(torch.tensor([2.0, 3.0]), global_batch_size=4), 1.25)


@case(f"{SRC} LossUtilitiesTest.testScaleRegularizationLoss")
def scale_regularization_loss_no_strategy(strategy, ctx):
    assert_close(px.nn.scale_regularization_loss(torch.tensor([2.5, 6.2, 5.0])), 2.5 + 6.2 + 5.0)


@case(f"{SRC} LossUtilitiesTest.testScaleRegularizationLoss")
def scale_regularization_loss(strategy, ctx):
    reg_losses = torch.tensor([2.5, 6.2, 5.0])
    with strategy.scope():
        per_replica = strategy.run(px.nn.scale_regularization_loss, args=(reg_losses,))
        loss = strategy.reduce("SUM", per_replica, axis=None)
    assert_close(loss, 2.5 + 6.2 + 5.0)


@case(f"{SRC} LossUtilitiesTest.testScaleRegularizationLoss (per replica)")
def scale_regularization_loss_per_replica_value(strategy, ctx):
    # TF 2.21 CPU, Mirrored x2: scale_regularization_loss([2., 4.]) is 3.0 on each replica (sum / n).
    out = strategy.run(px.nn.scale_regularization_loss, args=(torch.tensor([2.0, 4.0]),))
    assert_equal(local(strategy, out), [6.0 / ctx.n] * ctx.local_n)


@case(f"{SRC} LossUtilitiesTest.testScaleRegularizationLoss (scalar)")
def scale_regularization_loss_scalar(strategy, ctx):
    # TF 2.21 CPU, Mirrored x2: a scalar 3.0 gives 1.5 per replica.
    out = strategy.run(px.nn.scale_regularization_loss, args=(torch.tensor(3.0),))
    assert_equal(local(strategy, out), [3.0 / ctx.n] * ctx.local_n)


@case(f"{SRC} LossUtilitiesTest.testScaleRegularizationLossInCrossReplicaContext")
def scale_regularization_loss_in_cross_replica_context(strategy, ctx):
    with strategy.scope(), raises(RuntimeError, match="scale_regularization_loss"):
        px.nn.scale_regularization_loss(torch.tensor([2.0, 3.0]))


@case(f"{SRC} (TF 2.21 behaviour) compute_average_loss of an empty batch")
def compute_average_loss_empty_batch(strategy, ctx):
    # TF 2.21 CPU returns 0.0 on every replica (div_no_nan): an uneven last batch gives a replica none.
    out = strategy.run(lambda: px.nn.compute_average_loss(torch.zeros([0])))
    assert_equal(local(strategy, out), [0.0] * ctx.local_n)


@case(f"{SRC} (TF 2.21 behaviour) compute_average_loss with global_batch_size=0")
def compute_average_loss_zero_global_batch_size(strategy, ctx):
    # TF 2.21 CPU returns 0.0.
    out = strategy.run(lambda: px.nn.compute_average_loss(torch.tensor([1.0, 2.0]), global_batch_size=0))
    assert_equal(local(strategy, out), [0.0] * ctx.local_n)


@case(f"{SRC} (TF 2.21 behaviour) compute_average_loss with a float global_batch_size")
def compute_average_loss_float_global_batch_size(strategy, ctx):
    # TF 2.21 CPU raises TypeError "global_batch_size must be an integer".
    def step():
        with raises(TypeError):
            px.nn.compute_average_loss(torch.tensor([1.0, 2.0]), global_batch_size=4.0)

    strategy.run(step)


@case(f"{SRC} (TF 2.21 behaviour) compute_average_loss with a global_batch_size that is not a scalar")
def compute_average_loss_non_scalar_global_batch_size(strategy, ctx):
    # TF 2.21 CPU raises ValueError "global_batch_size must be scalar. Expected scalar shape, saw
    # shape: (1,)" for [10], (10,), np.array([10]) and [[10]] (shape (1, 1)).
    def step():
        for bad in ([10], (10,), np.array([10]), [[10]]):
            with raises(ValueError, match="scalar"):
                px.nn.compute_average_loss(torch.tensor([1.0, 2.0]), global_batch_size=bad)

    strategy.run(step)


@case(f"{SRC} (TF 2.21 behaviour) compute_average_loss with a negative global_batch_size")
def compute_average_loss_negative_global_batch_size(strategy, ctx):
    # TF 2.21 CPU raises InvalidArgumentError (TF's own class); ValueError is its equivalent here.
    def step():
        with raises(ValueError):
            px.nn.compute_average_loss(torch.tensor([1.0, 2.0]), global_batch_size=-1)

    strategy.run(step)


@case(f"{SRC} (TF 2.21 behaviour) compute_average_loss of rank-2 losses")
def compute_average_loss_rank2(strategy, ctx):
    # TF 2.21 CPU returns 2.5: every element summed, divided by global_batch_size.
    out = strategy.run(lambda: px.nn.compute_average_loss(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), global_batch_size=4))
    assert_equal(local(strategy, out), [2.5] * ctx.local_n)


@case(f"{SRC} (TF 2.21 behaviour) compute_average_loss default global batch in run")
def compute_average_loss_default_in_run(strategy, ctx):
    # TF 2.21 CPU: [1, 2, 3] on each of 2 replicas gives 6 / (3 * 2) = 1.0 (2.0 on one replica).
    out = strategy.run(lambda: px.nn.compute_average_loss(torch.tensor([1.0, 2.0, 3.0])))
    assert_equal(local(strategy, out), [6.0 / (3 * ctx.n)] * ctx.local_n)


@case(f"{SRC} (TF 2.21 behaviour) compute_average_loss of integer losses")
def compute_average_loss_integer_losses(strategy, ctx):
    # TF 2.21 CPU returns float64 (1.0 on each of 2 replicas).
    out = strategy.run(lambda: px.nn.compute_average_loss(torch.tensor([1, 2, 3])))
    results = strategy.experimental_local_results(out)
    assert all(r.dtype == torch.float64 for r in results), [r.dtype for r in results]
    assert_equal(results, [6.0 / (3 * ctx.n)] * ctx.local_n)


@case(f"{SRC} (TF 2.21 behaviour) compute_average_loss with a tensor global_batch_size")
def compute_average_loss_tensor_global_batch_size(strategy, ctx):
    # TF 2.21 CPU returns 1.0.
    out = strategy.run(
        lambda: px.nn.compute_average_loss(torch.tensor([1.0, 2.0, 3.0]), global_batch_size=torch.tensor(6))
    )
    assert_equal(local(strategy, out), [1.0] * ctx.local_n)


@case(f"{SRC} (TF 2.21 behaviour) scale_regularization_loss outside a scope")
def scale_regularization_loss_outside_scope(strategy, ctx):
    # TF 2.21 CPU returns 5.0 for [2., 3.] with no strategy: the sum.
    assert_equal(px.nn.scale_regularization_loss(torch.tensor([2.0, 3.0])), 5.0)


@case(f"{SRC} (TF 2.21 behaviour) compute_average_loss outside a scope")
def compute_average_loss_outside_scope(strategy, ctx):
    # TF 2.21 CPU returns 2.5 for [2., 3.] with no strategy: the mean.
    assert_equal(px.nn.compute_average_loss(torch.tensor([2.0, 3.0])), 2.5)
