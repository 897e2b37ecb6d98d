"""Who this process is in the job: public process identity, right inside and outside ``scope()``.

As accelerate's ``PartialState`` and horovod's ``rank()``/``size()``: every process of a
synchronous job has an index (0 is the chief) and knows how many there are. The answer comes from
the job's strategy: of the strategy that is current and those this process built and has not
closed, the one spanning the most processes (so ``is_chief()`` is right after ``with
strategy.scope():`` has ended, and a helper ``OneDeviceStrategy`` built on a replica of a
multi-process job does not make every replica the chief); else from what the launcher put in the
environment (``phalanx run``, torchrun, ``TF_CONFIG``, Slurm); else a single process.

Example:
    >>> import phalanx as px
    >>> px.process_index(), px.num_processes(), px.is_chief()
    (0, 1, True)
    >>> px.barrier()  # one process: returns at once
    >>> with px.wait_for_chief():  # every replica; the chief works alone inside
    ...     if px.is_chief():
    ...         pass  # an evaluation, a save: as long as it takes
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from phalanx.core import context
from phalanx.core.strategy import Strategy, live_strategies


@dataclass(frozen=True)
class ProcessIdentity:
    """This process's place in the job.

    Attributes:
        index: among the job's synchronous processes (0 is the chief); 0 for a ``ps`` task.
        count: how many synchronous processes the job has.
        is_chief: whether this process writes checkpoints, logs and summaries.
        source: where the answer came from: ``strategy``, ``environment`` or ``default``.
    """

    index: int
    count: int
    is_chief: bool
    source: str


def _strategy() -> Strategy | None:
    """The job's strategy: the one spanning the most processes (the current one first on a tie, then the newest)."""
    candidates = ([context.get_strategy()] if context.has_strategy() else []) + live_strategies()
    return max(candidates, key=lambda s: s.extended.num_processes) if candidates else None


def identity() -> ProcessIdentity:
    """This process's :class:`ProcessIdentity` (see the module docstring for where it comes from)."""
    strategy = _strategy()
    if strategy is not None:
        ext = strategy.extended
        return ProcessIdentity(ext.process_index, ext.num_processes, bool(ext.should_checkpoint), "strategy")
    found = _from_environment()
    return found if found is not None else ProcessIdentity(0, 1, True, "default")


def _from_environment() -> ProcessIdentity | None:
    from phalanx.cluster import resolve_from_environment
    from phalanx.launch import mode

    role = mode.current()  # how this process runs, decided in phalanx.launch.mode
    if role.env is not None:
        return ProcessIdentity(role.rank, role.world_size, role.rank == 0, "environment")
    resolver = resolve_from_environment()
    if resolver is None:
        return None
    if resolver.task_type in ("ps", "evaluator"):
        return ProcessIdentity(0, 1, False, "environment")
    placement = resolver.placement()  # global ranks follow the spec: the chief (or worker 0) is rank 0
    return ProcessIdentity(max(placement.rank, 0), placement.world_size, placement.rank == 0, "environment")


def process_index() -> int:
    """This process's index among the job's synchronous processes (0 is the chief)."""
    return identity().index


def num_processes() -> int:
    """The number of synchronous processes of the job."""
    return identity().count


def is_chief() -> bool:
    """Whether this process is the one that writes checkpoints, logs and summaries."""
    return identity().is_chief


def barrier() -> None:
    """Returns once every process of the current (or last built) strategy has called it.

    Without a multi-process strategy there is nobody to wait for, and it returns at once.
    """
    strategy = _strategy()
    if strategy is not None:
        strategy.extended.barrier()


@contextlib.contextmanager
def wait_for_chief(what: str = "chief-only work") -> Iterator[None]:
    """Lets the chief do work alone for longer than the collective timeout; the others wait for it.

    Every replica enters the block at the same point; inside, the chief works alone (an evaluation, a
    save: ``if px.is_chief(): ...``) and the others do nothing. At the end of the block they wait for
    the chief for as long as it is alive, however long the work takes, where a collective would give
    up after ``PHALANX_COLLECTIVE_TIMEOUT`` seconds (300 by default; TF's collectives wait forever).
    A chief that dies ends the wait at once with ``PeerUnavailableError``; one stopped (SIGSTOP, a
    debugger) or whose heartbeat stops for longer than the collective timeout, with
    ``CollectiveTimeoutError``. While it works, a diagnosis (``phalanx diagnose --live``) shows the
    chief busy with ``what`` and the others waiting for it.

    Without a multi-process strategy there is nobody to wait for: the block just runs.

    Args:
        what: what the chief does, for the diagnosis (``"evaluation"``).
    """
    strategy = _strategy()
    comm = strategy.extended.communicator if strategy is not None else None
    wait = getattr(comm, "wait_for_chief", None)
    if wait is None or strategy.extended.num_processes == 1:
        yield
        return
    with wait(what):
        yield
