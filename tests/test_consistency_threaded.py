"""Replicas that cannot drift apart, checked in one process: one thread per rank (ThreadedCommunicator).

Each test reproduces a case of issue 13 with real strategies, real autograd and the real reducer
over an in-process communicator; tests/test_consistency.py runs the same cases in processes.
"""

from __future__ import annotations

import contextlib
import time
import warnings

import pytest
import torch

import phalanx as px
from phalanx.comm.threaded import per_rank_errors, run_threaded
from phalanx.core import losses
from phalanx.core.extended import StrategyExtended
from phalanx.core.strategy import Strategy
from phalanx.devices import LogicalDevice
from phalanx.errors import ReplicaDivergenceError, UnsynchronizedParameterError
from phalanx.input import global_batch
from phalanx.input.global_batch import BatchInfo, tag

GLOBAL, FEATURES = 12, 6

# The first optimizer step imports torch's compiler stack (seconds; it sets TORCHINDUCTOR_CACHE_DIR):
# done here, at collection, so no test's time bound or environment check pays for it.
_warm = torch.nn.Parameter(torch.ones(1))
_warm.grad = torch.ones(1)
torch.optim.SGD([_warm], lr=0.1).step()


def strategy_for(comm) -> Strategy:
    names = (f"/job:localhost/replica:0/task:0/device:CPU:{comm.rank}",)
    return Strategy(StrategyExtended(comm, LogicalDevice("cpu", 0), names, names))


def model_fn() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(GLOBAL, FEATURES, generator=g), torch.randn(GLOBAL, 1, generator=g)) for _ in range(n)]


torch.manual_seed(0)
INITIAL = model_fn().state_dict()  # the RNG is process-wide: threads must not draw from it concurrently


def one_device_grads(micro: list) -> list[torch.Tensor]:
    model = model_fn()
    model.load_state_dict(INITIAL)
    for x, y in micro:
        (((model(x) - y) ** 2).sum() / GLOBAL).backward()  # accumulate, no zero_grad
    return [p.grad.clone() for p in model.parameters()]


def distributed_grads(comm, micro: list, use_no_sync: bool) -> list[torch.Tensor]:
    strategy = strategy_for(comm)
    with strategy.scope():
        model = model_fn()  # random, different on each rank: the scope's broadcast makes them equal
        if comm.rank == 0:
            model.load_state_dict(INITIAL)
    data = strategy.experimental_distribute_dataset(micro)
    for i, (x, y) in enumerate(data):

        def step(x, y):
            per_example = ((model(x) - y) ** 2).sum(dim=1)
            px.nn.compute_average_loss(per_example).backward()

        last = i == len(micro) - 1
        with strategy.extended.no_sync() if use_no_sync and not last else contextlib.nullcontext():
            strategy.run(step, args=(x, y))
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("micro_batches", [2, 4])
@pytest.mark.parametrize("use_no_sync", [False, True])
def test_accumulating_gradients_equals_one_device(n, micro_batches, use_no_sync):
    micro = batches(micro_batches)
    expected = one_device_grads(micro)
    results = run_threaded(n, lambda comm: distributed_grads(comm, micro, use_no_sync))
    for grads in results:
        for got, want in zip(grads, expected):
            assert (got - want).abs().max() < 1e-5


def test_no_sync_skips_the_communication():
    micro = batches(4)

    def count(comm):
        distributed_grads(comm, micro, use_no_sync=True)
        return comm.collectives

    def count_sync(comm):
        distributed_grads(comm, micro, use_no_sync=False)
        return comm.collectives

    assert run_threaded(2, count)[0] < run_threaded(2, count_sync)[0] - 2


def _train(comm, *, skip_on=None, batch_size=None, outside_scope=False, steps=4):
    """A custom loop; ``skip_on`` = (rank, step): that rank's step raises before backward and is caught."""
    strategy = strategy_for(comm)
    if outside_scope:
        model = model_fn()
    with strategy.scope():
        if not outside_scope:
            model = model_fn()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    size = batch_size(comm.rank) if batch_size else GLOBAL
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(size, FEATURES, generator=g), torch.randn(size, 1, generator=g)) for _ in range(steps)]
    for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(data)):

        def step(x, y, i=i):
            if skip_on == (comm.rank, i):
                raise ValueError("bad record")
            loss = px.nn.compute_average_loss(((model(x) - y) ** 2).sum(dim=1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss

        try:
            strategy.run(step, args=(x, y))
        except ValueError:
            continue  # the user's loop skips a bad batch on this replica only


def _all_divergence(errors, field):
    assert all(isinstance(e, ReplicaDivergenceError) for e in errors), errors
    assert {e.field for e in errors} == {field}, [str(e) for e in errors]
    assert len({str(e) for e in errors}) == 1, "every replica reports the same pair and values"


def test_a_step_skipped_on_one_replica_is_caught_at_the_next_collective():
    start = time.monotonic()
    errors = per_rank_errors(2, lambda comm: _train(comm, skip_on=(1, 1)))
    _all_divergence(errors, "step")
    assert errors[0].values == (2, 3) and errors[0].replicas == ("replica:0 (rank 0)", "replica:1 (rank 1)")
    assert time.monotonic() - start < 2


def test_different_global_batch_sizes_are_caught_at_the_first_step():
    errors = per_rank_errors(2, lambda comm: _train(comm, batch_size=lambda r: GLOBAL * (r + 1)))
    _all_divergence(errors, "global batch size")
    assert errors[0].values == (GLOBAL, 2 * GLOBAL) and errors[0].step == 1


def test_model_created_outside_scope_is_caught_at_the_first_step():
    errors = per_rank_errors(2, lambda comm: _train(comm, outside_scope=True))
    assert all(isinstance(e, UnsynchronizedParameterError) for e in errors), errors
    assert "Linear.weight" in str(errors[0]) and "scope()" in str(errors[0]) and errors[0].step == 1


def test_parameters_changed_differently_after_a_restore_are_caught_with_the_parameter():
    def body(comm):
        strategy = strategy_for(comm)
        with strategy.scope():
            model = model_fn()
        x = torch.randn(GLOBAL // 2, FEATURES)
        strategy.run(lambda: px.nn.compute_average_loss(model(x).sum(dim=1), global_batch_size=GLOBAL).backward())
        with torch.no_grad():  # a "restore" that gave replica 1 other values for the second layer
            if comm.rank == 1:
                model[2].bias.add_(1.0)
        strategy.extended.mark_parameters_changed()
        strategy.run(lambda: px.nn.compute_average_loss(model(x).sum(dim=1), global_batch_size=GLOBAL).backward())

    errors = per_rank_errors(2, body)
    _all_divergence(errors, "parameters")
    assert errors[0].parameter == "Linear.bias (shape (1,))"


def test_strategy_reduce_carries_the_guard_too():
    def body(comm):
        strategy = strategy_for(comm)
        if comm.rank == 1:
            strategy.run(lambda: None)  # one extra step on replica 1
        value = strategy.run(lambda: torch.tensor(1.0))
        strategy.reduce("SUM", value, axis=None)

    _all_divergence(per_rank_errors(2, body), "step")


def test_agreeing_replicas_pass_the_guard_every_step():
    def body(comm):
        _train(comm, steps=5)
        return comm.collectives

    assert run_threaded(2, body)[0] > 0


def test_global_batch_size_travels_with_the_batch_not_one_ahead():
    def body(comm):
        strategy = strategy_for(comm)
        first = list(strategy.experimental_distribute_dataset([torch.ones(4, 1), torch.ones(6, 1)]))
        # Materialised: the old side channel held the last batch's size (6) for both.
        return [strategy.run(lambda x: px.nn.compute_average_loss(x[:, 0]), args=(x,)).values[0].item() for x in first]

    assert run_threaded(2, body) == [[0.5, 0.5], [0.5, 0.5]]


def test_mean_loss_warns_once_naming_the_fix():
    def body(comm):
        strategy = strategy_for(comm)
        with strategy.scope():
            model = model_fn()
        x = torch.randn(4, FEATURES)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                strategy.run(lambda: model(x).mean().backward())
        # Where the warning points: the user's line that called strategy.run, not phalanx's.
        return [(str(w.message), w.filename) for w in caught if w.category is px.nn.LossScaleWarning]

    losses._warned.clear()
    messages = [m for ms in run_threaded(2, body) for m in ms]
    assert len(messages) == 1 and "compute_average_loss" in messages[0][0] and "2 times" in messages[0][0]
    assert messages[0][1] == __file__, messages[0][1]


def test_per_replica_batch_as_global_batch_size_warns():
    def body(comm):
        strategy = strategy_for(comm)
        with strategy.scope():
            model = model_fn()
        # Every process reads the same global batch (phalanx checks that it does).
        data = strategy.experimental_distribute_dataset(
            [torch.randn(8, FEATURES, generator=torch.Generator().manual_seed(0))]
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x in data:
                strategy.run(
                    lambda x: px.nn.compute_average_loss(model(x).sum(dim=1), global_batch_size=4).backward(), args=(x,)
                )
        return [str(w.message) for w in caught if w.category is px.nn.LossScaleWarning]

    losses._warned.clear()
    messages = [m for ms in run_threaded(2, body) for m in ms]
    assert len(messages) == 1 and "this replica's own batch" in messages[0] and "global batch of 8" in messages[0]


def test_tags_do_not_leak_between_batches():
    a, b = torch.ones(2), torch.ones(2)
    tag(a, BatchInfo(4, 1))
    assert global_batch.find((b,), {}) is None


def test_dividing_by_the_whole_accumulated_batch_does_not_warn():
    def body(comm):
        strategy = strategy_for(comm)
        with strategy.scope():
            model = model_fn()
        # Every process reads the same global batches (phalanx checks that it does).
        data = strategy.experimental_distribute_dataset(
            [torch.randn(8, FEATURES, generator=torch.Generator().manual_seed(0))] * 2
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x in data:  # two micro-batches of 8: each loss divided by 16
                strategy.run(
                    lambda x: px.nn.compute_average_loss(model(x).sum(dim=1), global_batch_size=16).backward(),
                    args=(x,),
                )
        return [w for w in caught if w.category is px.nn.LossScaleWarning]

    losses._warned.clear()
    assert run_threaded(2, body) == [[], []]


def test_a_guard_in_its_own_collective_ends_the_backward_pass_and_leaves_the_reducer_ready():
    # CentralStorage's design (its gradients reach replica 0 only): the guard runs in a small
    # all-reduce of its own just before the first bucket, from inside backward's gradient hook.
    from phalanx.comm.guard import ReplicaGuard
    from phalanx.comm.reducer import GradientReducer

    def body(comm):
        step = [1]
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        guard = ReplicaGuard(comm, lambda: (step[0], GLOBAL, 0), lambda: [])

        def exchange(g):
            g.verify(comm.all_reduce(g.encode(torch.int64, "cpu").clone(), "sum").wait())

        reducer = GradientReducer(
            list(model.parameters()), lambda t: comm.all_reduce(t, "sum"), guard=guard, guard_collective=exchange
        )
        model(torch.ones(2, 3)).sum().backward()  # accumulated before: must survive the failed pass
        before = [p.grad.clone() for p in model.parameters()]
        step[0] = 2 + comm.rank  # replica 1 is one step ahead
        with pytest.raises(ReplicaDivergenceError) as caught:
            model(torch.ones(2, 3)).sum().backward()
        after_failure = [p.grad.clone() for p in model.parameters()]
        step[0] = 5  # agree again: the next pass syncs
        model.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        return caught.value, before, after_failure, [p.grad.clone() for p in model.parameters()], reducer

    results = run_threaded(2, body)
    _all_divergence([r[0] for r in results], "step")
    for error, before, after_failure, synced, reducer in results:
        assert error.values == (2, 3)
        # The failed pass summed nothing: .grad is the synchronised sum from before plus this
        # replica's own gradient of the failed pass (half that sum, 2 equal replicas), as autograd left it.
        assert all(torch.equal(1.5 * b, a) for b, a in zip(before, after_failure))
        assert all(torch.equal(b, s) for b, s in zip(before, synced)), "the next pass is summed again"
        assert reducer.reductions == 2
