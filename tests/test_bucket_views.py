"""Gradients that live in the reducer's buckets (issue 33; DDP's ``gradient_as_bucket_view``).

From the first synchronised backward pass on, each synchronised parameter's ``.grad`` is a view of
one persistent flat bucket: later passes accumulate into it and the all-reduce works on it, with no
copy of the gradients into a fresh bucket each pass. The threaded tests run real strategies, real
autograd and the real reducer over an in-process communicator; the last test runs a 2-process
MirroredStrategy job over the shared-memory transport.
"""

from __future__ import annotations

import contextlib
import json
import sys

import pytest
import torch

# The threaded tests' model, data, initial weights and one-thread strategy (their collection-time
# warm-up of torch's compiler stack included): both files check the same reducer.
from test_consistency_threaded import GLOBAL, INITIAL, batches, model_fn, strategy_for  # noqa: E402

import phalanx as px
from phalanx.comm.threaded import run_threaded

from conftest import run_job


def one_device(data: list, *, micro: int = 1, frozen: str | None = None) -> dict:
    """SGD on one device over the same global batches; ``micro`` batches accumulate per step."""
    model = model_fn()
    model.load_state_dict(INITIAL)
    if frozen:
        model.get_parameter(frozen).requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    for i, (x, y) in enumerate(data):
        (((model(x) - y) ** 2).sum() / (GLOBAL * micro)).backward()
        if (i + 1) % micro == 0:
            opt.step()
            opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def train(comm, data: list, *, set_to_none: bool = True, micro: int = 1, no_sync: bool = False, frozen=None):
    """The same training under a strategy; records where each ``.grad`` lives after every step."""
    strategy = strategy_for(comm)
    with strategy.scope():
        model = model_fn()  # random, different on each rank: the scope's broadcast makes them equal
        if comm.rank == 0:
            model.load_state_dict(INITIAL)
    if frozen:
        model.get_parameter(frozen).requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    where, kept = [], []
    for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(data)):
        last = (i + 1) % micro == 0

        def step(x, y, last=last):
            per_example = ((model(x) - y) ** 2).sum(dim=1)
            px.nn.compute_average_loss(per_example, global_batch_size=GLOBAL * micro).backward()
            if last:
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                kept.append(grads)  # keeps every step's gradients alive: a fresh bucket would get a new address
                where.append(
                    ([g.data_ptr() for g in grads], [g.untyped_storage().data_ptr() for g in grads], len(grads))
                )
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)

        with strategy.extended.no_sync() if no_sync and not last else contextlib.nullcontext():
            strategy.run(step, args=(x, y))
    return {k: v.clone() for k, v in model.state_dict().items()}, where


def _assert_close(got: dict, want: dict) -> None:
    for k in want:
        assert (got[k] - want[k]).abs().max() < 1e-5, k


def _assert_in_one_persistent_bucket(where: list) -> None:
    first_ptrs, first_storages, _ = where[0]
    assert len(set(first_storages)) == 1, "every .grad is a view of one bucket (one storage)"
    for ptrs, storages, _ in where[1:]:
        assert storages == first_storages, "the bucket persists across steps"
        assert ptrs == first_ptrs, "each .grad keeps its place in the bucket"


@pytest.mark.parametrize("set_to_none", [True, False])
def test_grads_are_views_of_one_persistent_bucket(set_to_none):
    data = batches(4)
    want = one_device(data)
    for state, where in run_threaded(2, lambda comm: train(comm, data, set_to_none=set_to_none)):
        _assert_close(state, want)
        _assert_in_one_persistent_bucket(where)


@pytest.mark.parametrize("no_sync", [False, True])
def test_accumulation_without_zero_grad_stays_exact_in_the_bucket(no_sync):
    data = batches(6)
    want = one_device(data, micro=3)
    for state, where in run_threaded(2, lambda comm: train(comm, data, micro=3, no_sync=no_sync)):
        _assert_close(state, want)
        _assert_in_one_persistent_bucket(where)


def test_a_frozen_parameter_gets_no_gradient_and_the_others_stay_in_the_bucket():
    data = batches(3)
    want = one_device(data, frozen="0.bias")
    for state, where in run_threaded(2, lambda comm: train(comm, data, frozen="0.bias")):
        _assert_close(state, want)
        _assert_in_one_persistent_bucket(where)
        assert where[0][2] == 3  # three of four parameters have a gradient


def test_an_optimizer_that_replaces_grad_and_an_unused_parameter():
    # .grad replaced by a new tensor (gradient clipping by hand) and a parameter that one pass does not
    # use (it gets the others' gradient, and keeps an accumulated one): sums stay exact.
    data = batches(3)

    def run(comm):
        strategy = strategy_for(comm) if comm is not None else None
        scope = strategy.scope() if strategy else contextlib.nullcontext()
        with scope:
            model = model_fn()
            holder = torch.nn.Module()
            holder.extra = torch.nn.Parameter(torch.ones(3))
        extra = holder.extra
        model.load_state_dict(INITIAL)
        with torch.no_grad():
            extra.fill_(1.0)
        opt = torch.optim.SGD([*model.parameters(), extra], lr=0.1)
        seq = strategy.experimental_distribute_dataset(data) if strategy else data
        for i, (x, y) in enumerate(seq):

            def step(x, y, i=i):
                loss = ((model(x) - y) ** 2).sum() / GLOBAL
                if i != 1:  # unused in the second pass
                    loss = loss + (extra * extra).sum() * x.shape[0] / GLOBAL
                loss.backward()
                for p in model.parameters():
                    p.grad = p.grad * 0.5  # a new tensor, not a view of the bucket
                opt.step()
                if i != 0:  # the first step's gradients accumulate into the second
                    opt.zero_grad()

            strategy.run(step, args=(x, y)) if strategy else step(x, y)
        return {**{k: v.clone() for k, v in model.state_dict().items()}, "extra": extra.detach().clone()}

    want = run(None)
    for got in run_threaded(2, run):
        _assert_close(got, want)


def test_channels_last_parameters_keep_their_layout():
    def run(comm):
        strategy = strategy_for(comm)
        torch.manual_seed(0)
        with strategy.scope():
            conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        for _ in range(2):
            strategy.run(lambda: conv(torch.ones(2, 3, 5, 5).to(memory_format=torch.channels_last)).sum().backward())
            layout = conv.weight.grad.is_contiguous(memory_format=torch.channels_last)
            conv.zero_grad()
        return layout

    assert run_threaded(2, run) == [True, True]


def test_a_mirrored_job_over_shared_memory_keeps_grads_in_the_bucket(tmp_path, script):
    # Two processes, the shared-memory all-reduce, zero_grad(set_to_none=True) as torch's default.
    path = script(
        """
        import json, sys
        import torch
        import phalanx as px

        strategy = px.MirroredStrategy(["cpu:0", "cpu:1"])
        torch.manual_seed(0)
        with strategy.scope():
            model = torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g)) for _ in range(4)]
        where, kept = [], []

        def step(x, y):
            loss = px.nn.compute_average_loss(((model(x) - y) ** 2).sum(dim=1))
            opt.zero_grad()
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            kept.append(grads)
            where.append([[gr.data_ptr() for gr in grads], [gr.untyped_storage().data_ptr() for gr in grads]])
            opt.step()

        for x, y in strategy.experimental_distribute_dataset(data):
            strategy.run(step, args=(x, y))
        state = {k: v.tolist() for k, v in model.state_dict().items()}
        if strategy.extended.process_index == 0:
            json.dump({"where": where, "state": state}, open(sys.argv[1], "w"))
        """
    )
    out = tmp_path / "out.json"
    result = run_job([sys.executable, str(path), str(out)], timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.output
    found = json.loads(out.read_text())
    where = [(ptrs, storages, len(ptrs)) for ptrs, storages in found["where"]]
    _assert_in_one_persistent_bucket(where)
    # One device, the same data and Adam: the same parameters.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for x, y in [(torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g)) for _ in range(4)]:
        opt.zero_grad()
        (((model(x) - y) ** 2).sum() / 16).backward()
        opt.step()
    for k, v in model.state_dict().items():
        assert (torch.tensor(found["state"][k]) - v).abs().max() < 1e-5, k


def test_grad_stays_the_same_tensor_from_step_to_step():
    # The bucket's view is .grad itself, step after step: the end of a pass re-points nothing
    # (no new view objects per parameter per step), as DDP's gradient_as_bucket_view keeps .grad.
    data = batches(4)

    def run(comm):
        strategy = strategy_for(comm)
        with strategy.scope():
            model = model_fn()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ids = []

        def step(x, y):
            px.nn.compute_average_loss(((model(x) - y) ** 2).sum(dim=1), global_batch_size=GLOBAL).backward()
            ids.append([id(p.grad) for p in model.parameters()])
            opt.step()
            opt.zero_grad()

        for x, y in strategy.experimental_distribute_dataset(data):
            strategy.run(step, args=(x, y))
        return ids

    for ids in run_threaded(2, run):
        assert all(step == ids[0] for step in ids), ids


def test_a_sum_returned_in_another_tensor_is_what_grad_holds():
    # A collective whose handle returns the sum in a tensor of its own (a GPU bucket summed on the
    # host, as CentralStorage's copy mode does) rather than in the bucket: .grad must hold that sum,
    # not the bucket's unsummed local gradient.
    from phalanx.comm.reducer import GradientReducer

    class Summed:
        def __init__(self, flat):
            self.total = flat * 2  # as if a second replica had the same gradient

        def wait(self):
            return self.total

    torch.manual_seed(0)
    model = model_fn()
    GradientReducer(list(model.parameters()), Summed)
    x, y = batches(1)[0]
    local = torch.autograd.grad(((model(x) - y) ** 2).sum(), list(model.parameters()))
    for _ in range(2):  # the second pass with .grad already in the bucket
        model.zero_grad()
        ((model(x) - y) ** 2).sum().backward()
        for p, g in zip(model.parameters(), local):
            assert torch.equal(p.grad, 2 * g)
