"""Variables with TF's aggregation and synchronization, checked on 2 real replica processes.

Usage: python variables_aggregation.py OUT_DIR STRATEGY   (a name of tests/strategies.py)
Each check is independent: a failure is recorded (the exception's type and text) and the script
goes on, so one run reports every check. Writes OUT_DIR/var_<rank>.json. Expected values are TF
2.21's (MirroredStrategy on 2 CPU devices), given beside each check in tests/test_variables_aggregation.py.
"""

import json
import os
import sys
import traceback

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)
os.environ.setdefault("KERAS_BACKEND", "torch")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import phalanx as px  # noqa: E402
from phalanx.checkpoint import Checkpoint, load_state  # noqa: E402

import strategies  # noqa: E402

out, name = sys.argv[1], sys.argv[2]
strategy = strategies.make(name)
rank = strategy.extended.process_index
torch.manual_seed(100 + rank)  # each process's own random state differs: initial values must be broadcast
A, S = px.VariableAggregation, px.VariableSynchronization
res = {}


def check(label):
    def deco(fn):
        try:
            res[label] = fn()
        except Exception as e:  # noqa: BLE001 - recorded for the test to assert on
            res[label] = {"error": type(e).__name__, "text": str(e)[:500], "tb": traceback.format_exc()[-1500:]}
        return fn

    return deco


def mine():
    """This replica's value in a step: 1.0 on replica 0, 2.0 on replica 1 (TF's tests' values)."""
    return torch.tensor(float(px.get_replica_context().replica_id_in_sync_group + 1))


def caught(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type is the result
        return {"raised": type(e).__name__, "is_value_error": isinstance(e, ValueError)}
    return {"raised": None}


@check("on_write")
def _():
    got = {}
    for agg in ("SUM", "MEAN", "ONLY_FIRST_REPLICA"):
        for method in ("assign_add", "assign_sub", "assign"):
            with strategy.scope():
                v = px.Variable(0.0, aggregation=A[agg])
            returned = strategy.run(lambda v=v, method=method: getattr(v, method)(mine()))
            got[f"{agg}/{method}"] = [float(v), float(px.values.local_results(returned)[0])]
    return got


@check("none_aggregation")
def _():
    with strategy.scope():
        same = px.Variable(0.0)
        differ = px.Variable(0.0)
    strategy.run(lambda: same.assign_add(torch.tensor(1.0)))
    error = caught(lambda: strategy.run(lambda: differ.assign_add(mine())))
    # The replicas are still in step: a collective after the error pairs up.
    after = float(strategy.reduce("SUM", strategy.run(lambda: torch.tensor(1.0)), axis=None))
    return {"same": float(same), "differ": error, "differ_value": float(differ), "after": after}


@check("python_numbers")
def _():
    with strategy.scope():
        summed = px.Variable(0.0, aggregation=A.SUM)
        mean = px.Variable(0.0, aggregation=A.MEAN)
    error = caught(lambda: strategy.run(lambda: summed.assign_add(1.0)))
    strategy.run(lambda: mean.assign_add(1.0))
    # A number each replica's own Python computed differently (its rank) is averaged too, never
    # applied as it is: the copies would differ silently.
    with strategy.scope():
        per_replica = px.Variable(0.0, aggregation=A.MEAN)
    rid = strategy.extended.process_index
    strategy.run(lambda: per_replica.assign_add(float(rid)))
    return {"sum": error, "mean": float(mean), "per_replica_numbers": float(per_replica)}


@check("creation")
def _():
    with strategy.scope():
        random = px.Variable(torch.randn(3))  # differs per process before the broadcast
        int_mean = caught(lambda: px.Variable(0, aggregation=A.MEAN))
        sync_none = caught(lambda: px.Variable(0.0, synchronization=S.NONE))
    return {"random": random.tolist(), "int_mean": int_mean, "sync_none": sync_none}


@check("on_read")
def _():
    got = {}
    for agg in ("SUM", "MEAN", "ONLY_FIRST_REPLICA", "NONE"):
        with strategy.scope():
            v = px.Variable(0.0, synchronization=S.ON_READ, aggregation=A[agg])
        strategy.run(lambda v=v: v.assign_add(mine()))
        entry = {
            "num_workers": strategy.extended.input_sharding.num_workers,
            "trainable": v.trainable,
            "in_run": float(px.values.local_results(strategy.run(lambda v=v: v.read_value()))[0]),
            "local_results": [float(t) for t in strategy.experimental_local_results(v)],
            "reduce_sum": float(strategy.reduce("SUM", v, axis=None)),
        }
        if agg == "NONE":
            entry["read"] = caught(v.read_value)
        else:
            entry["read"] = float(v.read_value())
            entry["float"] = float(v)
            entry["numpy"] = float(v.numpy())
            entry["plus_one"] = float(v + 1.0)
        got[agg] = entry
    return got


@check("on_read_cross_replica_updates")
def _():
    with strategy.scope():
        total = px.Variable(0.0, synchronization=S.ON_READ, aggregation=A.SUM)
        mean = px.Variable(0.0, synchronization=S.ON_READ, aggregation=A.MEAN)
    total.assign(10.0)
    strategy.run(lambda: mean.assign(mine()))
    mean.assign_add(1.0)
    return {
        "sum_local": float(torch.Tensor.clone(total)),
        "sum_read": float(total),
        "sum_assign_add": caught(lambda: total.assign_add(1.0)),
        "mean_local": float(torch.Tensor.clone(mean)),
        "mean_read": float(mean),
    }


@check("checkpoint")
def _():
    with strategy.scope():
        total = px.Variable(0.0, synchronization=S.ON_READ, aggregation=A.SUM)
    strategy.run(lambda: total.assign_add(mine()))
    directory = os.path.join(out, "ckpt")
    ckpt = Checkpoint(total=total)
    path = ckpt.save(directory)
    strategy.run(lambda: total.assign(torch.tensor(7.0)))
    ckpt.restore(path)
    return {
        "saved": float(load_state(path)["total"]),
        "local_after_restore": float(torch.Tensor.clone(total)),
        "read_after_restore": float(total),
    }


@check("counter")
def _():
    # TF's testDatasetOutOfRange: a SUM variable counts every replica's inputs.
    with strategy.scope():
        a = px.Variable(0.0, aggregation=A.SUM)
    data = [torch.tensor([5.0, 6.0]), torch.tensor([7.0, 8.0])]
    for batch in strategy.experimental_distribute_dataset(data):
        strategy.run(lambda val: a.assign_add(val.sum()), args=(batch,))
    return float(a)


def _reference(w0, b0, x, y, steps, lr):
    """The same training on one device, on the global batch."""
    w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    opt = torch.optim.SGD([w, b], lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        ((x @ w + b - y) ** 2).mean().backward()
        opt.step()
    return w.detach(), b.detach()


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1


@check("trainable")
def _():
    x, y = _data()
    with strategy.scope():
        w = px.Variable(torch.randn(4, 1), name="w")
        b = px.Variable(torch.zeros(1), name="b")
        opt = torch.optim.SGD([w, b], lr=0.1)
    w0, b0 = w.detach().clone(), b.detach().clone()

    def step(xb, yb):
        loss = px.nn.compute_average_loss(((xb @ w + b - yb) ** 2).reshape(-1), global_batch_size=8)
        opt.zero_grad()
        loss.backward()
        opt.step()

    batches = [(x, y)] * 3
    for xb, yb in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=(xb, yb))
    ref_w, ref_b = _reference(w0, b0, x, y, 3, 0.1)
    return {
        "w0": w0.reshape(-1).tolist(),
        "diff": max(float((w.detach() - ref_w).abs().max()), float((b.detach() - ref_b).abs().max())),
        "moved": float((w.detach() - w0).abs().max()),
        "checksum": float(w.detach().double().sum() + b.detach().double().sum()),
    }


@check("keras_variables")
def _():
    x, y = _data()
    with strategy.scope():
        w = keras.Variable(keras.initializers.RandomNormal(seed=rank)((4, 1)), name="w")
        b = keras.Variable(np.zeros(1, dtype="float32"), name="b")
        opt = keras.optimizers.SGD(learning_rate=0.1)
        seen = keras.Variable(0.0, aggregation="sum", trainable=False, name="seen")
        first = keras.Variable(0.0, aggregation="only_first_replica", trainable=False, name="first")
    # A Keras variable joins the strategy at the first step that names it (its value broadcast from
    # replica 0): read it from a step.
    w0, b0 = (
        px.values.local_results(t)[0]
        for t in strategy.run(lambda: (w.value.detach().clone(), b.value.detach().clone()))
    )

    def step(xb, yb):
        loss = px.nn.compute_average_loss(((xb @ w.value + b.value - yb) ** 2).reshape(-1), global_batch_size=8)
        w.value.grad, b.value.grad = None, None
        loss.backward()
        opt.apply([w.value.grad, b.value.grad], [w, b])
        seen.assign_add(torch.tensor(float(xb.shape[0])))
        first.assign(mine())

    for xb, yb in strategy.experimental_distribute_dataset([(x, y)] * 3):
        strategy.run(step, args=(xb, yb))
    ref_w, ref_b = _reference(w0, b0, x, y, 3, 0.1)
    return {
        "w0": w0.reshape(-1).tolist(),
        "diff": max(float((w.value.detach() - ref_w).abs().max()), float((b.value.detach() - ref_b).abs().max())),
        "seen": float(seen.value),
        "first": float(first.value),
        "iterations": int(opt.iterations.value),
    }


@check("keras_on_read")
def _():
    if not hasattr(keras.Variable(0.0), "synchronization"):
        return "keras without synchronization"  # Keras < 3.7 has no ON_READ variables
    with strategy.scope():
        count = keras.Variable(0.0, aggregation="sum", synchronization="on_read", trainable=False, name="count")

    def step():
        count.assign_add(mine())
        return count.value

    in_run = float(px.values.local_results(strategy.run(step))[0])
    return {"in_run": in_run, "read": float(count.value), "numpy": float(count.numpy())}


with open(os.path.join(out, f"var_{rank}.json"), "w") as f:
    json.dump(res, f)
