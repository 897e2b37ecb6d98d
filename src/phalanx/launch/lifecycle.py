"""The vocabulary of a launcher's replicas: the state they are in, and how their run ended.

Every route that starts replicas is a :class:`~phalanx.launch.launcher.Launcher` over the one
:class:`~phalanx.launch.supervisor.Supervisor` (self-launch and an embedding R host,
:mod:`phalanx.launch.self_launch`; ``phalanx run``, :mod:`phalanx.launch.runner`; a notebook's
replicas, :mod:`phalanx.interactive.session`), and each one says where its replicas are with
one :class:`JobState`, after torch elastic's ``WorkerState``::

    STARTING ──> RUNNING ──> SUCCEEDED
        │           │
        │           └──> STOPPING ──> SUCCEEDED   (the program ended, the others were waited for)
        │                    │
        └────────────────────┴──────> FAILED      (a replica failed, or could not start)

``STOPPING`` is the launcher stopping the replicas: after a failure (then ``FAILED``), at an
interrupt, or at the end of the program or session. How the run ended is a :class:`RunResult`
(torch elastic's ``RunResult``): the final state, every task's :class:`~phalanx.launch.root_cause.Exit`
and the root cause (:func:`~phalanx.launch.root_cause.root_cause`).

Example:
    >>> life = Lifecycle()
    >>> life.state
    <JobState.STARTING: 'starting'>
    >>> life.to(JobState.RUNNING); life.to(JobState.FAILED); life.to(JobState.RUNNING)  # the end stays
    >>> life.state.is_final, life.state
    (True, <JobState.FAILED: 'failed'>)
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

from phalanx.launch.root_cause import Exit

__all__ = ["JobState", "Lifecycle", "RunResult"]


class JobState(str, enum.Enum):
    """Where a launcher's replicas are (see the module docstring for the transitions).

    Attributes:
        STARTING: the launcher is starting the replicas (they may not all run yet).
        RUNNING: every replica was started; the program (or session) runs on them.
        STOPPING: the launcher is stopping them (a failure, an interrupt, the end).
        SUCCEEDED: the run ended and no replica failed.
        FAILED: a replica failed (or could not start); the run's root cause says which.
    """

    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def is_final(self) -> bool:
        """Whether the run has ended (nothing changes the state afterwards)."""
        return self in (JobState.SUCCEEDED, JobState.FAILED)


@dataclass(frozen=True)
class RunResult:
    """How a launcher's run ended (or stands, while it runs).

    Attributes:
        state: the launcher's :class:`JobState`.
        status: the shell exit status the run stands for (0 once it succeeded; 128 + n after
            signal n; a replica's own status after its failure).
        exits: how each replica task that has ended did, in the order they were seen ending.
        root_cause: the first failure (:func:`~phalanx.launch.root_cause.root_cause`), if any.
    """

    state: JobState
    status: int = 0
    exits: tuple[Exit, ...] = ()
    root_cause: Exit | None = None

    @property
    def is_failed(self) -> bool:
        return self.state is JobState.FAILED


class Lifecycle:
    """A launcher's :class:`JobState`, changed under a lock; a final state is never left."""

    def __init__(self) -> None:
        self._state = JobState.STARTING
        self._lock = threading.Lock()

    @property
    def state(self) -> JobState:
        return self._state

    def to(self, state: JobState) -> None:
        """Moves to ``state``, unless the run has already ended (its end is decided once)."""
        with self._lock:
            if not self._state.is_final:
                self._state = state

    def end(self, status: int) -> None:
        """Ends the run with a shell exit status: 0 is ``SUCCEEDED``, anything else ``FAILED``."""
        self.to(JobState.SUCCEEDED if status == 0 else JobState.FAILED)
