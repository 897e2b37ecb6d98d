"""Context guards and argument checks of TF's tensorflow/python/distribute/distribute_lib.py, as
exercised by distribute_lib_test.py, strategy_test_lib.py and mirrored_strategy_test.py; values
where those tests state none are TF 2.21 CPU's (Mirrored over 2 logical CPUs, OneDevice).
"""

from __future__ import annotations

import torch

import phalanx as px
from tf_conformance.registry import assert_equal, case, local, raises

SRC = "distribute_lib_test.py"


@case(f"{SRC} (guard) strategy.run inside strategy.run raises RuntimeError")
def run_inside_run(strategy, ctx):
    # TF 2.21 CPU: RuntimeError "Method requires being in cross-replica context".
    def step():
        with raises(RuntimeError):
            strategy.run(lambda: 1.0)

    strategy.run(step)


@case(f"{SRC} (guard) run inside run does not advance the step")
def run_inside_run_keeps_step(strategy, ctx):
    before = strategy.extended.step

    def step():
        try:
            strategy.run(lambda: 1.0)
        except RuntimeError:
            pass

    strategy.run(step)
    assert strategy.extended.step == before + 1, (before, strategy.extended.step)


@case(f"{SRC} (guard) strategy.reduce in replica context raises RuntimeError")
def reduce_in_replica_context(strategy, ctx):
    def step():
        with raises(RuntimeError):
            strategy.reduce("SUM", torch.tensor(1.0), axis=None)

    strategy.run(step)


@case(f"{SRC} (guard) strategy.gather in replica context raises RuntimeError")
def gather_in_replica_context(strategy, ctx):
    def step():
        with raises(RuntimeError):
            strategy.gather(torch.tensor([1.0]), axis=0)

    strategy.run(step)


@case(f"{SRC} (guard) reduce_to in replica context raises RuntimeError")
def reduce_to_in_replica_context(strategy, ctx):
    def step():
        with raises(RuntimeError):
            strategy.extended.reduce_to("SUM", torch.tensor(1.0), "/cpu:0")

    strategy.run(step)


@case(f"{SRC} (guard) ReplicaContext.all_reduce in cross-replica context raises RuntimeError")
def all_reduce_in_cross_replica(strategy, ctx):
    # Inside merge_call's function the replica context captured earlier is not usable.
    captured = {}

    def step():
        captured["ctx"] = px.get_replica_context()

        def merge_fn(_):
            with raises(RuntimeError):
                captured["ctx"].all_reduce("SUM", torch.tensor(1.0))

        captured["ctx"].merge_call(merge_fn)

    strategy.run(step)


@case(f"{SRC} (guard) merge_call inside merge_call's function raises RuntimeError")
def merge_call_in_merge_call(strategy, ctx):
    def step():
        replica_ctx = px.get_replica_context()

        def merge_fn(_):
            with raises(RuntimeError):
                replica_ctx.merge_call(lambda _: None)

        replica_ctx.merge_call(merge_fn)

    strategy.run(step)


@case(f"{SRC} (guard) get_replica_context() is None in scope")
def replica_context_none_in_scope(strategy, ctx):
    with strategy.scope():
        assert px.get_replica_context() is None


@case(f"{SRC} (merge_call) run inside merge_call's function is allowed")
def run_in_merge_call(strategy, ctx):
    # TF 2.21 CPU: merge_call(lambda st: st.run(lambda: 1.0)) returns 1.0.
    out = strategy.run(lambda: px.get_replica_context().merge_call(lambda st: st.run(lambda: 1.0)))
    assert list(strategy.experimental_local_results(out)) in ([1.0], [1.0] * ctx.local_n), out


@case(
    f"{SRC} (merge_call) arguments arrive as per-replica values",
    ("mirrored_cpu_2", "central_storage_cpu_2", "multi_worker_2"),
)
def merge_call_args_are_per_replica(strategy, ctx):
    # TF 2.21 CPU, Mirrored x2: merge_fn's argument is a PerReplica.
    out = strategy.run(
        lambda: px.get_replica_context().merge_call(
            lambda st, x: isinstance(x, px.DistributedValues), args=(torch.tensor(1.0),)
        )
    )
    assert all(strategy.experimental_local_results(out)), out


@case(f"{SRC} (merge_call) merge_fn reduces the replicas' arguments")
def merge_call_reduces(strategy, ctx):
    def step():
        r = px.get_replica_context().replica_id_in_sync_group
        return px.get_replica_context().merge_call(
            lambda st, x: st.reduce("SUM", x, axis=None), args=(torch.tensor(r + 1.0),)
        )

    out = strategy.run(step)
    assert_equal(local(strategy, out), [float(sum(r + 1 for r in range(ctx.n)))] * ctx.local_n)


@case(f"{SRC} (merge_call) kwargs reach merge_fn")
def merge_call_kwargs(strategy, ctx):
    out = strategy.run(lambda: px.get_replica_context().merge_call(lambda st, *, k: k, kwargs={"k": "v"}))
    assert list(strategy.experimental_local_results(out)) in (["v"], ["v"] * ctx.local_n), out


@case(f"{SRC} (merge_call) in-scope contexts inside merge_fn")
def merge_call_contexts(strategy, ctx):
    seen = {}

    def merge_fn(st):
        seen["replica"] = px.get_replica_context()
        seen["cross"] = px.get_cross_replica_context() is strategy
        seen["in_cross"] = px.in_cross_replica_context()
        seen["strategy"] = px.get_strategy() is strategy and st is strategy

    strategy.run(lambda: px.get_replica_context().merge_call(merge_fn))
    assert seen == {"replica": None, "cross": True, "in_cross": True, "strategy": True}, seen


@case(f"{SRC} (reduce) unknown reduce op raises ValueError")
def reduce_unknown_op(strategy, ctx):
    # TF 2.21 CPU: ValueError "'MAX' is not a valid ReduceOp".
    with raises(ValueError):
        strategy.reduce("MAX", strategy.run(lambda: torch.tensor(1.0)), axis=None)


@case(f"{SRC} (reduce) ReduceOp members")
def reduce_op_members(strategy, ctx):
    assert {op.name for op in px.ReduceOp} == {"SUM", "MEAN"}, list(px.ReduceOp)
    assert px.ReduceOp("SUM") is px.ReduceOp.SUM and px.ReduceOp("MEAN") is px.ReduceOp.MEAN


@case(f"{SRC} (reduce) nested structures")
def reduce_nested(strategy, ctx):
    # TF 2.21 CPU, Mirrored x2: {'a': 2.0, 'b': (4.0, [2., 2.])}.
    out = strategy.run(lambda: {"a": torch.tensor(1.0), "b": (torch.tensor(2.0), torch.tensor([1.0, 1.0]))})
    got = strategy.reduce("SUM", out, axis=None)
    assert isinstance(got, dict) and isinstance(got["b"], tuple), got
    assert_equal(got, {"a": 1.0 * ctx.n, "b": [2.0 * ctx.n, [1.0 * ctx.n, 1.0 * ctx.n]]})


@case(f"{SRC} (reduce) MEAN of a list")
def reduce_mean_list(strategy, ctx):
    # TF 2.21 CPU, Mirrored x2: [0.5, 4.0].
    out = strategy.run(
        lambda: [torch.tensor(float(px.get_replica_context().replica_id_in_sync_group)), torch.tensor(4.0)]
    )
    got = strategy.reduce("MEAN", out, axis=None)
    assert isinstance(got, list), type(got)
    assert_equal(got, [sum(range(ctx.n)) / ctx.n, 4.0])


@case(f"{SRC} (reduce) float64 keeps its dtype")
def reduce_float64(strategy, ctx):
    got = strategy.reduce("MEAN", strategy.run(lambda: torch.tensor(1.0, dtype=torch.float64)), axis=None)
    assert got.dtype == torch.float64, got.dtype


@case(f"{SRC} (reduce) MEAN along axis 0 of uneven per-replica values")
def reduce_mean_axis0_uneven(strategy, ctx):
    # TF 2.21 CPU, Mirrored x2: [1.] and [2., 2.] give 5/3.
    values = strategy.experimental_distribute_values_from_function(
        lambda c: torch.ones([c.replica_id_in_sync_group + 1]) * (c.replica_id_in_sync_group + 1)
    )
    expected = sum((r + 1) ** 2 for r in range(ctx.n)) / sum(r + 1 for r in range(ctx.n))
    assert abs(float(strategy.reduce("MEAN", values, axis=0)) - expected) < 1e-6


@case(f"{SRC} (reduce) SUM and MEAN along axis 0 of a host tensor")
def reduce_host_tensor_axis0(strategy, ctx):
    # TF 2.21 CPU: SUM of [1., 2.] along axis 0 is 6.0 under Mirrored x2 and MultiWorkerMirrored
    # 2x1 (3.0 on OneDevice), MEAN 1.5.
    assert_equal(strategy.reduce("SUM", torch.tensor([1.0, 2.0]), axis=0), 3.0 * ctx.n)
    assert_equal(strategy.reduce("MEAN", torch.tensor([1.0, 2.0]), axis=0), 1.5)


@case(f"{SRC} (reduce) a Python float with MEAN")
def reduce_python_float_mean(strategy, ctx):
    # TF 2.21 CPU returns 1.0.
    assert float(strategy.reduce("MEAN", 1.0, axis=None)) == 1.0


@case(f"{SRC} (reduce) a Python float with SUM on one worker", ("mirrored_cpu_2", "central_storage_cpu_2"))
def reduce_python_float_sum(strategy, ctx):
    # TF 2.21 CPU, Mirrored x2: ValueError "A non-DistributedValues value 1.0 cannot be reduced".
    with raises(ValueError):
        strategy.reduce("SUM", 1.0, axis=None)


@case(f"{SRC} (reduce) a Python float with SUM under 2x1", ("multi_worker_2",))
def reduce_python_float_sum_multi_worker(strategy, ctx):
    # TF 2.21 CPU, MultiWorkerMirrored 2x1: 2.0 (the workers' values summed).
    assert float(strategy.reduce("SUM", 1.0, axis=None)) == 2.0


@case(f"{SRC} (batch_reduce_to) host tensors with SUM under 2x1", ("multi_worker_2",))
def batch_reduce_to_host_sum_multi_worker(strategy, ctx):
    # TF 2.21 CPU, MultiWorkerMirrored 2x1 returns [2.0, 4.0].
    got = strategy.extended.batch_reduce_to("SUM", [(torch.tensor(1.0), "/cpu:0"), (torch.tensor(2.0), "/cpu:0")])
    assert_equal(got, [2.0, 4.0])


@case(f"{SRC} (batch_reduce_to) host tensors with SUM on one worker", ("mirrored_cpu_2", "central_storage_cpu_2"))
def batch_reduce_to_host_sum_single_worker(strategy, ctx):
    # TF 2.21 CPU, Mirrored x2 returns [1.0, 2.0]: the values themselves.
    got = strategy.extended.batch_reduce_to("SUM", [(torch.tensor(1.0), "/cpu:0"), (torch.tensor(2.0), "/cpu:0")])
    assert_equal(got, [1.0, 2.0])


@case(f"{SRC} (extended) worker_devices and parameter_devices")
def worker_devices(strategy, ctx):
    assert len(strategy.extended.worker_devices) == ctx.local_n, strategy.extended.worker_devices


@case(f"{SRC} (extended) experimental_between_graph")
def between_graph(strategy, ctx):
    # TF 2.21 CPU: False for OneDevice and Mirrored, True for MultiWorkerMirrored 2x1.
    assert strategy.extended.experimental_between_graph is ctx.multi_worker, (
        strategy.extended.experimental_between_graph
    )


@case(f"{SRC} (extended) should_checkpoint / should_save_summary on the chief")
def should_checkpoint(strategy, ctx):
    # TF 2.21 CPU: True on a single worker (one process holds every replica); under 2x1 True on
    # worker 0 and False on worker 1.
    expected = not ctx.multi_worker or ctx.worker == 0
    got = (strategy.extended.should_checkpoint, strategy.extended.should_save_summary)
    assert got == (expected, expected), got


@case(f"{SRC} (run) a non-callable fn raises TypeError")
def run_not_callable(strategy, ctx):
    with raises(TypeError):
        strategy.run(3)


@case(f"{SRC} (run) experimental_run_v2 is run")
def experimental_run_v2(strategy, ctx):
    out = strategy.experimental_run_v2(lambda: torch.tensor(2.0))
    assert_equal(local(strategy, out), [2.0] * ctx.local_n)


@case(f"{SRC} (process identity) helper OneDeviceStrategy does not change the chief")
def helper_strategy_keeps_identity(strategy, ctx):
    before = (px.process_index(), px.is_chief())
    px.OneDeviceStrategy("cpu")
    assert (px.process_index(), px.is_chief()) == before, (before, (px.process_index(), px.is_chief()))
