"""An in-process, multi-rank communicator: one thread per rank, for fast tests of the synchronous side.

Like torch's ``MultiThreadedTestCase`` (and phalanx's ``ps.testing.InProcessTransport`` for the
parameter-server side), it lets the reducer's bucketing, the strategy's all-reduce of structures,
the consistency guard and the loss-scale checks run with several ranks in milliseconds, without
processes. Processes remain the test for what only processes show: deaths, signals, shared
memory, launchers.

Every collective is a rendezvous of all ranks on a :class:`threading.Barrier`: each rank deposits
its tensor, the ranks meet, each computes the result from all deposits in rank order (so every
rank gets the same bits), and they meet again before the slots are reused. A rank that does not
arrive within ``timeout`` breaks the barrier: every waiting rank raises
:class:`~phalanx.errors.CollectiveTimeoutError`.

Example:
    >>> import torch
    >>> from phalanx.comm.threaded import run_threaded
    >>> run_threaded(2, lambda comm: comm.all_reduce(torch.tensor([comm.rank + 1.0])).wait().item())
    [3.0, 3.0]
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from phalanx.comm.communicator import Handle
from phalanx.comm.memory_store import InMemoryStore
from phalanx.errors import CollectiveTimeoutError, DistributedRuntimeError

_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sum": torch.add,
    "mean": torch.add,
    "max": torch.maximum,
    "min": torch.minimum,
    "product": torch.mul,
}


class ThreadedWorld:
    """What the ranks of one in-process job share: the barrier, the deposit slots, the store.

    Args:
        world_size: the number of ranks (threads).
        timeout: seconds a collective waits for every rank.
    """

    def __init__(self, world_size: int, timeout: float = 10.0) -> None:
        self.world_size, self.timeout = world_size, timeout
        self.barrier = threading.Barrier(world_size)
        self.slots: list[Any] = [None] * world_size
        self.store = InMemoryStore(timeout)

    def communicator(self, rank: int) -> ThreadedCommunicator:
        return ThreadedCommunicator(self, rank)


class ThreadedCommunicator:
    """One rank of a :class:`ThreadedWorld`; implements the :class:`~phalanx.comm.communicator.Communicator` protocol."""

    def __init__(self, world: ThreadedWorld, rank: int) -> None:
        self._world = world
        self.rank, self.world_size = rank, world.world_size
        self.step: int | None = None
        self.collectives = 0  # calls made, for tests

    # ------------------------------------------------------------------ the exchange
    def _exchange(self, item: Any, operation: str) -> list[Any]:
        """Deposits ``item`` and returns every rank's, in rank order (a full rendezvous)."""
        world = self._world
        self.collectives += 1
        world.slots[self.rank] = item
        self._meet(operation)
        items = list(world.slots)
        self._meet(operation)  # nobody overwrites a slot before everyone has read them all
        return items

    def _meet(self, operation: str) -> None:
        try:
            self._world.barrier.wait(self._world.timeout)
        except threading.BrokenBarrierError:
            raise CollectiveTimeoutError(
                [],
                step=self.step,
                operation=f"{operation} on {self.name(self.rank)}",
                cause=f"not every rank arrived within {self._world.timeout:g}s",
            ) from None

    def _same_shape(self, tensors: list[torch.Tensor], operation: str) -> None:
        shapes = {(tuple(t.shape), t.dtype) for t in tensors}
        if len(shapes) > 1:
            raise DistributedRuntimeError(
                f"{operation}: ranks passed different shapes/dtypes {sorted(map(str, shapes))}.",
                hint="every rank must call the same collectives with the same tensors",
            )

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> Handle:
        parts = self._exchange(tensor.detach().clone(), "all-reduce")
        self._same_shape(parts, "all-reduce")
        fn = _OPS[op]
        out = parts[0].clone()
        for p in parts[1:]:
            out = fn(out, p)
        if op == "mean":
            out = out / self.world_size if out.is_floating_point() else out.div(self.world_size, rounding_mode="trunc")
        tensor.copy_(out)
        return Handle(tensor)

    def reduce(self, tensor: torch.Tensor, dst: int = 0) -> torch.Tensor:
        parts = self._exchange(tensor.detach().clone(), "reduce")
        self._same_shape(parts, "reduce")
        if self.rank == dst:
            out = parts[0].clone()
            for p in parts[1:]:
                out = out + p
            tensor.copy_(out)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        parts = self._exchange(tensor.detach().clone(), "broadcast")
        self._same_shape(parts, "broadcast")
        tensor.copy_(parts[src])
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = self._exchange(tensor.detach().clone(), "all-gather")
        self._same_shape(parts, "all-gather")
        return parts

    def barrier(self) -> None:
        self._exchange(None, "barrier")

    # ------------------------------------------------------------------ identity
    def name(self, rank: int) -> str:
        return f"replica:{rank} (rank {rank})"

    def host_of(self, rank: int) -> str:
        return "localhost"

    @property
    def store(self) -> InMemoryStore:
        return self._world.store

    def subgroup(self, ranks: list[int], tag: str, *, cuda: bool = False) -> Any:
        raise NotImplementedError("ThreadedCommunicator has no subgroups; use a process-level test")

    def errors_for(self, operation: str) -> contextlib.AbstractContextManager[None]:
        """Collectives here raise typed errors themselves: nothing to translate."""
        return contextlib.nullcontext()

    def close(self) -> None:
        return None


def run_threaded(
    world_size: int, fn: Callable[[ThreadedCommunicator], Any], timeout: float = 30.0, collective_timeout: float = 10.0
) -> list[Any]:
    """Runs ``fn(comm)`` on ``world_size`` threads, one rank each; returns the results in rank order.

    Raises:
        BaseException: the exception of the lowest rank that raised (every rank's is in
            ``__notes__``), after every thread ended.
        TimeoutError: a thread did not end within ``timeout`` seconds.
    """
    world = ThreadedWorld(world_size, collective_timeout)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(world.communicator(rank))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[rank] = e
            world.barrier.abort()  # peers waiting in a collective stop now, not at their timeout

    threads = [
        threading.Thread(target=body, args=(r,), name=f"phalanx-rank-{r}", daemon=True) for r in range(world_size)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"threaded ranks did not finish within {timeout}s")
    raised = [(r, e) for r, e in enumerate(errors) if e is not None]
    if raised:
        first = raised[0][1]
        for r, e in raised:
            first.add_note(f"rank {r}: {type(e).__name__}: {e}")
        raise first
    return results


def per_rank_errors(
    world_size: int, fn: Callable[[ThreadedCommunicator], Any], timeout: float = 30.0
) -> list[BaseException | None]:
    """Like :func:`run_threaded` but returns each rank's exception (or None) instead of raising."""
    out: list[BaseException | None] = [None] * world_size

    def wrapped(comm: ThreadedCommunicator) -> None:
        try:
            fn(comm)
        except BaseException as e:  # noqa: BLE001 - returned
            out[comm.rank] = e

    run_threaded(world_size, wrapped, timeout)
    return out
