"""TF's rules for values, checked on 2 real replica processes (issue 28).

Usage: python tf_values.py OUT_DIR KIND   (KIND: mirrored, self-launching its 2nd replica;
or mwms, one of two TF_CONFIG workers). Each check is independent: a failure is recorded (its
type and text) and the script goes on. Writes OUT_DIR/values_<rank>.json.
"""

import json
import sys
import traceback

import numpy as np
import torch

import phalanx as px

out, kind = sys.argv[1], sys.argv[2]
strategy = px.MirroredStrategy(["cpu:0", "cpu:1"]) if kind == "mirrored" else px.MultiWorkerMirroredStrategy()
rank = strategy.extended.process_index
res = {}


def check(name):
    def deco(fn):
        try:
            res[name] = fn()
        except Exception as e:  # noqa: BLE001 - recorded for the test to assert on
            res[name] = {
                "error": type(e).__name__,
                "text": str(e)[:600],
                "bases": [c.__name__ for c in type(e).__mro__],
            }
            res[name]["tb"] = traceback.format_exc()[-1500:]
        return fn

    return deco


def rows(t):
    return t.tolist() if isinstance(t, torch.Tensor) else t


# ------------------------------------------------------------------ host (non-distributed) tensors
@check("host_sum")
def _():
    return rows(strategy.reduce("SUM", torch.tensor(1.0), axis=None))


@check("host_mean")
def _():
    return rows(strategy.reduce("MEAN", torch.tensor([1.0, 2.0]), axis=None))


@check("host_reduce_to_sum")
def _():
    return rows(strategy.extended.reduce_to("SUM", torch.tensor(1.0), destinations=torch.zeros(())))


@check("host_zeros_sum")
def _():
    return rows(strategy.reduce("SUM", np.zeros(2), axis=None))


@check("host_gather")
def _():
    return rows(strategy.gather(torch.tensor([float(rank), 7.0]), axis=0))


@check("host_sum_axis")
def _():
    # TF reduces along the axis inside run first: the plain tensor is then one value per replica.
    return rows(strategy.reduce("SUM", torch.tensor([1.0, 2.0]), axis=0))


@check("mixed")
def _():
    per = strategy.run(lambda: torch.tensor(float(rank + 1)))
    got = strategy.reduce("MEAN", {"per": per, "host": torch.tensor(3.0)}, axis=None)
    return {k: rows(v) for k, v in got.items()}


# ------------------------------------------------------------------ dtypes
@check("int_mean")
def _():
    per = strategy.run(lambda: torch.tensor([rank + 1], dtype=torch.int32))
    got = strategy.reduce("MEAN", per, axis=None)
    got_axis = strategy.reduce("MEAN", strategy.run(lambda: torch.tensor([rank, rank + 2])), axis=0)
    return [str(got.dtype), rows(got), str(got_axis.dtype), rows(got_axis)]


@check("replica_int_mean")
def _():
    got = strategy.run(lambda: px.get_replica_context().all_reduce("MEAN", torch.tensor(rank + 1, dtype=torch.int64)))
    v = strategy.experimental_local_results(got)[0]
    return [str(v.dtype), rows(v)]


# ------------------------------------------------------------------ gradients through collectives
def grad_of(op):
    # TF strategy_test_lib _test_all_reduce_{sum,mean}_gradient_tape: y = all_reduce(x) * c, c = 1 and 3.
    def step(c):
        x = torch.tensor(42.0, requires_grad=True)
        y = px.get_replica_context().all_reduce(op, x) * c
        (g,) = torch.autograd.grad(y, [x])
        return g

    c = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor([1.0, 3.0])[ctx.replica_id_in_sync_group]
    )
    return [rows(v) for v in strategy.experimental_local_results(strategy.run(step, args=(c,)))]


@check("grad_sum")
def _():
    return grad_of("SUM")


@check("grad_mean")
def _():
    return grad_of("MEAN")


@check("grad_gather")
def _():
    # Each replica's x (lengths 1 and 2) is gathered; replica r's loss weights the gathered vector by w_r.
    def step():
        x = torch.ones(rank + 1, requires_grad=True)
        g = px.get_replica_context().all_gather(x * 1.0, axis=0)
        w = torch.arange(1.0, 4.0) * (rank + 1)
        (grad,) = torch.autograd.grad((g * w).sum(), [x])
        return grad

    return rows(strategy.run(step).values[0])


@check("global_statistic_trains")
def _():
    # A forward pass that all-reduces (a global mean) trains, and equals one device on the global batch.
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.arange(24.0).reshape(8, 3) / 10

    def step(x):
        h = model(x)
        ctx = px.get_replica_context()
        mean = ctx.all_reduce("SUM", h.sum()) / 8  # the mean of the global batch
        loss = px.nn.compute_average_loss((h * mean).reshape(-1))  # d/dh reaches every replica's h
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for batch in strategy.experimental_distribute_dataset([data, data]):
        strategy.run(step, args=(batch,))
    # The same two steps on one device, on the whole global batch, from the same initial weights.
    torch.manual_seed(0)
    ref = torch.nn.Linear(3, 1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        h = ref(data)
        loss = (h * h.mean()).sum() / 8
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return [rows(model.weight.detach().reshape(-1)), rows(ref.weight.detach().reshape(-1))]


# ------------------------------------------------------------------ regroup
@check("structure_reduce")
def _():
    per = strategy.run(lambda: (torch.tensor(1.0), torch.tensor(2.0)) if rank == 0 else (torch.tensor(1.0),))
    return rows(strategy.reduce("SUM", per[0], axis=None))


@check("structure_dict_gather")
def _():
    per = strategy.run(lambda: {"a": torch.ones(1)} if rank == 0 else {"b": torch.ones(1)})
    return rows(strategy.gather(next(iter(per.values())), axis=0))


@check("structure_none_local_results")
def _():
    per = strategy.run(lambda: torch.ones(1) if rank == 0 else None)
    return [rows(v) for v in strategy.experimental_local_results(per)]


@check("structure_same_shapes_differ")
def _():
    # Uneven batches are not a different structure: lengths may differ.
    per = strategy.run(lambda: {"x": torch.ones(rank + 1)})
    return rows(strategy.gather(per, axis=0)["x"])


@check("after_errors_the_replicas_are_in_step")
def _():
    return rows(strategy.reduce("SUM", strategy.run(lambda: torch.tensor(float(rank))), axis=None))


with open(f"{out}/values_{rank}.json", "w") as f:
    json.dump(res, f)
