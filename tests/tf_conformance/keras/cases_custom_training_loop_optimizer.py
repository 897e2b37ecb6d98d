"""Cases translated from tf_keras/distribute/custom_training_loop_optimizer_test.py.

A Keras optimizer's ``apply_gradients`` inside ``strategy.run`` sums the gradients the replicas
give it (TF's default, ``experimental_aggregate_gradients=True``): replica 0 gives [1, 1], replica 1
[2, 2], and SGD(0.1) leaves [-0.3, -0.3] on every replica. Keras 3's optimizers have no
``experimental_aggregate_gradients`` argument, so TF's ``False`` variants (each replica applying its
own gradient; NotImplementedError under CentralStorage) have no translation.
"""

from __future__ import annotations

import keras
import torch

from tf_conformance.keras.common import replica_id
from tf_conformance.registry import CENTRAL_STORAGE, MIRRORED, MULTI_WORKER, ONE_DEVICE, case, local

SRC = "custom_training_loop_optimizer_test.py"


def _optimize(strategy, grads_of_replica, read_after=False, optimizer_fn=lambda: keras.optimizers.SGD(0.1)):
    with strategy.scope():
        v = keras.Variable([0.0, 0.0])
        optimizer = optimizer_fn()

    def step_fn():
        optimizer.apply_gradients([(grads_of_replica(replica_id()), v)])
        return torch.as_tensor(v.value).detach().clone()

    got = local(strategy, strategy.run(step_fn))
    if read_after:
        got = local(strategy, strategy.run(lambda: torch.as_tensor(v.value).detach().clone()))
    return got


@case(
    f"{SRC} OptimizerTest.test_custom_aggregation (experimental_aggregate_gradients=True; TF: its "
    "multidevice_strategies, MultiWorkerMirrored standing in for the GPU pair's second worker)",
    (MIRRORED, MULTI_WORKER),
)
def custom_aggregation(strategy, ctx):
    got = _optimize(strategy, lambda r: torch.full((2,), float(r + 1)))
    assert all(abs(x + 0.3) < 1e-6 for row in got for x in row), (
        f"expected [-0.3, -0.3] on every replica (the gradients summed), got {got}"
    )


@case(
    f"{SRC} OptimizerTest.test_custom_aggregation under CentralStorage (TF tests CentralStorage only with "
    "experimental_aggregate_gradients=False, which Keras 3 lacks; the chief updates the one copy, read at the next step)",
    (CENTRAL_STORAGE,),
)
def custom_aggregation_central_storage(strategy, ctx):
    # Adam's first step moves by its learning rate whatever the gradient's size: the summed
    # gradients applied once give -0.1; each replica's applied to the one copy would give -0.2.
    got = _optimize(
        strategy,
        lambda r: torch.full((2,), float(r + 1)),
        read_after=True,
        optimizer_fn=lambda: keras.optimizers.Adam(0.1),
    )
    assert all(abs(x + 0.1) < 1e-5 for row in got for x in row), (
        f"expected [-0.1, -0.1] on every replica (the gradients summed, applied once by the chief), got {got}"
    )


@case(f"{SRC} OptimizerTest.test_custom_aggregation_one_device", (ONE_DEVICE,))
def custom_aggregation_one_device(strategy, ctx):
    got = _optimize(strategy, lambda r: torch.ones(2))
    assert all(abs(x + 0.1) < 1e-6 for row in got for x in row), got
