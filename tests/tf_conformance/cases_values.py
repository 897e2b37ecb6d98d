"""Cases translated from TF's tensorflow/python/distribute/values_test.py and distribute_utils_test.py
(DistributedValues, PerReplica, regroup), with the run/reduce guards of distribute_lib.py they rely on.
"""

from __future__ import annotations

import torch

import phalanx as px
from tf_conformance.registry import MULTI, assert_equal, case, local, raises

SRC = "values_test.py"


def _rid() -> int:
    return px.get_replica_context().replica_id_in_sync_group


@case(f"{SRC} DistributedValuesTest.testGetEager (experimental_local_results of a run result)")
def local_results_of_run(strategy, ctx):
    out = strategy.run(lambda: torch.tensor(float(_rid())))
    expected = [float(ctx.rank)] if ctx.multi_worker else [float(r) for r in range(ctx.n)]
    assert_equal(local(strategy, out), expected)


@case(f"{SRC} DistributedValuesTest.testIsTensorLike (local results of a plain value)")
def local_results_of_plain_values(strategy, ctx):
    # TF 2.21 CPU: experimental_local_results(t) == (t,), of a Python int (3,).
    t = torch.tensor(1.0)
    results = strategy.experimental_local_results(t)
    assert isinstance(results, tuple) and len(results) == 1 and results[0] is t, results
    assert strategy.experimental_local_results(3) == (3,)


@case(f"{SRC} DistributedValuesTest (run returning a Python number)")
def run_returns_python_number(strategy, ctx):
    # TF 2.21 CPU, Mirrored x2: run(lambda: 3) gives local results (3,): a constant is not per-replica.
    assert tuple(strategy.experimental_local_results(strategy.run(lambda: 3))) in ((3,), (3,) * ctx.local_n)


@case(f"{SRC} DistributedValuesTest (run returning None)")
def run_returns_none(strategy, ctx):
    assert strategy.run(lambda: None) is None


@case(f"{SRC} DistributedValuesTest (run returning a tuple keeps the tuple)")
def run_returns_tuple(strategy, ctx):
    out = strategy.run(lambda: (torch.tensor(1.0), torch.tensor(2.0)))
    assert isinstance(out, tuple) and len(out) == 2, type(out)
    assert_equal(strategy.reduce("SUM", out, axis=None), [1.0 * ctx.n, 2.0 * ctx.n])


@case(f"{SRC} DistributedValuesTest (run returning a dict keeps the dict)")
def run_returns_dict(strategy, ctx):
    out = strategy.run(lambda: {"a": torch.tensor(1.0)})
    assert isinstance(out, dict) and list(out) == ["a"], out
    assert_equal(local(strategy, out["a"]), [1.0] * ctx.local_n)


@case(f"{SRC} DistributedValuesTest (per-replica values are PerReplica)", MULTI)
def run_result_is_per_replica(strategy, ctx):
    out = strategy.run(lambda: torch.tensor(1.0))
    assert isinstance(out, px.DistributedValues), type(out)


@case(f"{SRC} DistributedValuesTest (one replica: plain values)", ("one_device",))
def run_result_is_plain_on_one_device(strategy, ctx):
    # TF 2.21 CPU, OneDevice: run returns the tensor itself.
    out = strategy.run(lambda: torch.tensor(1.0))
    assert isinstance(out, torch.Tensor), type(out)


@case(f"{SRC} PerReplicaTest (iterating a distributed value is refused)", MULTI)
def per_replica_not_iterable(strategy, ctx):
    out = strategy.run(lambda: torch.tensor([1.0, 2.0]))
    with raises(TypeError):
        iter(out)


@case(f"{SRC} (run args) PerReplica arguments reach each replica as its own component")
def per_replica_args(strategy, ctx):
    values = strategy.experimental_distribute_values_from_function(
        lambda c: torch.tensor(float(c.replica_id_in_sync_group))
    )
    out = strategy.run(lambda x: x * 10, args=(values,))
    expected = [10.0 * ctx.rank] if ctx.multi_worker else [10.0 * r for r in range(ctx.n)]
    assert_equal(local(strategy, out), expected)


@case(f"{SRC} (run args) nested structures of PerReplica and plain arguments")
def nested_per_replica_args(strategy, ctx):
    values = strategy.experimental_distribute_values_from_function(
        lambda c: torch.tensor(float(c.replica_id_in_sync_group))
    )

    def fn(pair, scale, mapping):
        a, b = pair
        return a + b * scale + mapping["k"]

    out = strategy.run(fn, args=((values, torch.tensor(1.0)), 2.0), kwargs={"mapping": {"k": values}})
    expected = [2.0 * r + 2.0 for r in range(ctx.n)]
    assert_equal(local(strategy, out), [expected[ctx.rank]] if ctx.multi_worker else expected)


@case(f"{SRC} (run args) kwargs from a previous run's dict")
def kwargs_from_previous_run(strategy, ctx):
    out = strategy.run(lambda: {"a": torch.tensor(2.0), "b": torch.tensor(3.0)})
    got = strategy.run(lambda a, b: a * b, kwargs=out)
    assert_equal(local(strategy, got), [6.0] * ctx.local_n)


@case(f"{SRC} (run args) a single non-tuple argument")
def run_single_non_tuple_arg(strategy, ctx):
    # TF: args that is not a list or tuple is wrapped as (args,) (with a warning).
    out = strategy.run(lambda x: x + 1, args=torch.tensor(1.0))
    assert_equal(local(strategy, out), [2.0] * ctx.local_n)


@case(f"{SRC} (distribute_values_from_function) ValueContext fields")
def distribute_values_from_function_context(strategy, ctx):
    values = strategy.experimental_distribute_values_from_function(
        lambda c: torch.tensor([c.replica_id_in_sync_group, c.num_replicas_in_sync])
    )
    expected = [[r, ctx.n] for r in range(ctx.n)]
    assert_equal(local(strategy, values), [expected[ctx.rank]] if ctx.multi_worker else expected)


@case(f"{SRC} (distribute_values_from_function) Python values")
def distribute_values_from_function_python(strategy, ctx):
    # TF 2.21 CPU, Mirrored x2: local results (0, 1).
    values = strategy.experimental_distribute_values_from_function(lambda c: c.replica_id_in_sync_group)
    expected = list(range(ctx.n))
    assert list(strategy.experimental_local_results(values)) == ([ctx.rank] if ctx.multi_worker else expected)


@case(f"{SRC} (distribute_values_from_function) ValueContext str")
def value_context_str(strategy, ctx):
    # TF 2.21 CPU: "tf.distribute.ValueContext(replica id 0,  total replicas in sync: 2)".
    values = strategy.experimental_distribute_values_from_function(lambda c: str(c))
    texts = list(strategy.experimental_local_results(values))
    for text, r in zip(texts, [ctx.rank] if ctx.multi_worker else range(ctx.n)):
        assert f"replica id {r}," in text and f"total replicas in sync: {ctx.n}" in text, text


@case(f"{SRC} (distribute_values_from_function) not callable")
def distribute_values_from_function_not_callable(strategy, ctx):
    with raises(TypeError):
        strategy.experimental_distribute_values_from_function(3)
