"""``compute_average_loss`` and ``scale_regularization_loss`` as TF 2.21's ``tf.nn`` ones.

Each case is TF's behaviour, from tensorflow/python/ops/nn_impl_distribute.py and
nn_loss_scaling_utilities_test.py (values checked against TF 2.21 CPU): an empty batch and a
global batch of 0 give 0 (div_no_nan), a scalar per-example loss is refused (ValueError), a
non-integer global batch size is a TypeError, and the regularization loss is summed before it is
divided by the number of replicas.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import phalanx as px


def test_empty_batch_gives_zero_not_an_error():
    # An uneven last batch leaves a replica with no examples: TF returns 0.0 for it.
    loss = px.nn.compute_average_loss(torch.zeros(0))
    assert loss.item() == 0.0 and not torch.isnan(loss)


def test_global_batch_size_zero_gives_zero_and_keeps_the_graph():
    w = torch.ones(3, requires_grad=True)
    loss = px.nn.compute_average_loss(w * 2, global_batch_size=0)
    assert loss.item() == 0.0
    loss.backward()  # still differentiable: a zero gradient, as div_no_nan's
    assert w.grad.tolist() == [0.0, 0.0, 0.0]


def test_scalar_per_example_loss_is_a_value_error():
    with pytest.raises(ValueError, match="rank >= 1"):
        px.nn.compute_average_loss(torch.tensor(2.0))


@pytest.mark.parametrize("bad", [4.0, 4.5, torch.tensor(4.0), "4", True])
def test_non_integer_global_batch_size_is_a_type_error(bad):
    with pytest.raises(TypeError, match="integer"):
        px.nn.compute_average_loss(torch.ones(4), global_batch_size=bad)


@pytest.mark.parametrize("good", [np.int64(8), torch.tensor(8), torch.tensor(8, dtype=torch.int32)])
def test_integer_tensors_and_numpy_integers_are_integers(good):
    assert px.nn.compute_average_loss(torch.ones(4), global_batch_size=good).item() == 0.5


def test_negative_global_batch_size_is_a_value_error():
    with pytest.raises(ValueError, match="non-negative; received -2"):
        px.nn.compute_average_loss(torch.ones(4), global_batch_size=-2)


def test_sample_weight_and_extra_dimensions():
    # TF: nn_loss_scaling_utilities_test testComputeAverageLossSampleWeights: [1,2,3]*[4,5,6] / 3 = 32/3
    got = px.nn.compute_average_loss(torch.tensor([1.0, 2.0, 3.0]), sample_weight=torch.tensor([4.0, 5.0, 6.0]))
    assert got.item() == pytest.approx(32.0 / 3.0)
    # Rank-2 per-example losses are summed over every element (TF's reduce_sum).
    assert px.nn.compute_average_loss(torch.ones(2, 3), global_batch_size=2).item() == 3.0


def test_scale_regularization_loss_sums_first():
    # TF: reduce_sum(regularization_loss) / num_replicas. A vector [1, 2, 3] is 6, not [1, 2, 3].
    got = px.nn.scale_regularization_loss(torch.tensor([1.0, 2.0, 3.0]))
    assert got.dim() == 0 and got.item() == 6.0
    assert px.nn.scale_regularization_loss([torch.tensor(1.0), torch.tensor(2.5)]).item() == 3.5


def test_in_replica_context_the_divisor_is_the_number_of_replicas():
    strategy = px.OneDeviceStrategy("cpu")
    out = strategy.run(lambda: px.nn.scale_regularization_loss(torch.tensor([2.0, 2.0])))
    assert out.item() == 4.0
    out = strategy.run(lambda: px.nn.compute_average_loss(torch.zeros(0)))
    assert out.item() == 0.0
