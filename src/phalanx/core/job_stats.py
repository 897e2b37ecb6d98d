"""What a job did, counted cheaply as it runs: steps, samples, and when the first step began.

A strategy's extended holds one :class:`JobStats` (``strategy.extended.stats``). ``strategy.run``
marks each step (one ``perf_counter`` read), the distributed datasets and Keras ``fit`` add the
size of each global batch, and the communicator keeps its own collective times
(:mod:`phalanx.comm.timing`). :mod:`phalanx.report` turns them into the job report.

Example:
    >>> stats = JobStats()
    >>> stats.step_began(wait_seconds=0.0)
    >>> stats.add_samples(64)
    >>> stats.steps, stats.samples
    (1, 64)
"""

from __future__ import annotations

import time


class JobStats:
    """Steps, samples and the time of the first step of one strategy in this process."""

    __slots__ = ("steps", "samples", "first_step_at", "last_step_at", "wait_before_first_step")

    def __init__(self) -> None:
        self.steps = 0
        self.samples = 0
        self.first_step_at: float | None = None  # perf_counter at the first step's start
        self.last_step_at: float | None = None
        # Collective seconds spent before the first step (the variables' broadcast at scope
        # exit), left out of the steps' share.
        self.wait_before_first_step = 0.0

    def step_began(self, wait_seconds: float) -> None:
        """Marks the start of a step; ``wait_seconds``: the communicator's collective time so far."""
        now = time.perf_counter()
        if self.first_step_at is None:
            self.first_step_at = now
            self.wait_before_first_step = wait_seconds
        self.last_step_at = now
        self.steps += 1

    def add_samples(self, count: int) -> None:
        """Adds a global batch of ``count`` examples (the whole job's, not this replica's slice)."""
        self.samples += int(count)

    def seconds(self) -> float:
        """Seconds since the first step began (0 before it)."""
        return 0.0 if self.first_step_at is None else time.perf_counter() - self.first_step_at
