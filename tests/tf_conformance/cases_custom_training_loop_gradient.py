"""Cases translated from TF's tensorflow/python/distribute/custom_training_loop_gradient_test.py,
and TF's behaviour for a variable without a gradient (issue 50).

TF's ``tape.gradient`` is ``torch.autograd.grad`` on tensors and ``backward()`` on parameters; TF's
``tf.function`` variants are the eager ones.
"""

from __future__ import annotations

import torch

from tf_conformance.registry import assert_close, assert_equal, case, flat_local

SRC = "custom_training_loop_gradient_test.py"


def _loader(data, batch_size):
    return torch.utils.data.DataLoader(torch.tensor(data), batch_size=batch_size)


def _square_grads(strategy, ctx):
    def train_step(x):
        x = x.detach().requires_grad_(True)  # TF: tape.watch(x)
        (grads,) = torch.autograd.grad(torch.square(x).sum(), x)
        return grads

    results = []
    for x in strategy.experimental_distribute_dataset(_loader([5.0, 6.0, 7.0, 8.0], 2)):
        results.append(flat_local(strategy, strategy.run(train_step, args=(x,))))
    # TF: [[10, 12], [14, 16]], flattened over this worker's replicas.
    expected = [[10.0, 12.0], [14.0, 16.0]]
    if ctx.multi_worker:
        expected = [[row[ctx.worker]] for row in expected]
    assert_equal(results, expected)


@case(f"{SRC} GradientTapeTest.testStepInFunctionGradient")
def step_in_function_gradient(strategy, ctx):
    _square_grads(strategy, ctx)


@case(f"{SRC} GradientTapeTest.testRunInFunctionGradient")
def run_in_function_gradient(strategy, ctx):
    _square_grads(strategy, ctx)


@case(f"{SRC} GradientTapeTest.testNestedFunction (model_in_tf_function False / True)")
def nested_function(strategy, ctx):
    with strategy.scope():
        x = torch.nn.Parameter(torch.tensor(1.0))

    def model(v):
        return v * v

    def replica_step():
        (grad,) = torch.autograd.grad(model(x), x)
        return grad

    grads = strategy.experimental_local_results(strategy.run(replica_step))
    assert len(grads) == ctx.local_n and all(g is not None for g in grads), grads


class _TwoVariables(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Parameter(torch.tensor(1.0))
        self.unused = torch.nn.Parameter(torch.tensor(2.0))


@case(
    f"{SRC} GradientTapeTest (a variable the loss does not use: TF's tape.gradient gives None on every replica "
    "and apply_gradients skips it; TF 2.21 CPU with SGD(0.1, momentum=0.9), 3 steps of loss used**2 per replica: "
    "used 0.062 on one replica, -0.54 on two (the gradients summed), unused 2.0)"
)
def variable_without_gradient(strategy, ctx):
    with strategy.scope():
        model = _TwoVariables()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen = []

    def replica_step():
        optimizer.zero_grad(set_to_none=True)
        (model.used * model.used).backward()
        seen.append((model.used.grad is None, model.unused.grad is None))
        optimizer.step()

    for _ in range(3):
        strategy.run(replica_step)
    central_replica = getattr(strategy.extended, "updates_on_chief_only", False) and ctx.rank != 0
    # CentralStorage's other replicas hand their gradients to the chief: none is left there.
    assert all(unused for _, unused in seen), f"the unused variable got a gradient: {seen}"
    assert all(used == central_replica for used, _ in seen), seen
    assert_close(float(model.unused.detach()), 2.0, "unused")
    assert_close(float(model.used.detach()), {1: 0.062, 2: -0.54}[ctx.n], "used", tol=1e-5)
