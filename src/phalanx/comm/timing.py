"""How long this process waited in collectives, and the marks a profiler shows around them.

The communicator adds the wall time of every collective it runs (from the call to the end of its
wait) to its :class:`CollectiveTimes`: two ``perf_counter`` reads and an addition per collective,
0.2 to 0.4 us measured with ``timeit`` on a loaded 2-core VM, against the microseconds the
cheapest collective takes. The job report divides it by the time since the first step, which
says how much of a step the replica spent waiting for its peers and moving bytes (on one host:
the shared-memory all-reduces, in backward and in ``reduce``).

While a phalanx profile records (:mod:`phalanx.profiler`), each collective is also a
``torch.profiler.record_function`` range named ``phalanx::<collective>``, so a trace shows where
a step waited; outside a profile nothing is recorded (a range costs a few microseconds).

Example:
    >>> times = CollectiveTimes()
    >>> with times.measure("all_reduce"):
    ...     pass
    >>> times.calls
    1
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch


class _Marks:
    """Whether collectives are marked for a profiler (a counter: profiles may nest)."""

    active = 0


MARKS = _Marks()


@contextlib.contextmanager
def marking() -> Iterator[None]:
    """Marks collectives as ``phalanx::<name>`` ranges for the block (a profile's recording window)."""
    MARKS.active += 1
    try:
        yield
    finally:
        MARKS.active -= 1


class CollectiveTimes:
    """The seconds this process spent in collectives and how many it ran."""

    __slots__ = ("seconds", "calls")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.calls += 1

    @contextlib.contextmanager
    def measure(self, name: str) -> Iterator[None]:
        """Times the block (and marks it while a profile records); for collectives off the hot path."""
        start = time.perf_counter()
        try:
            if MARKS.active:
                with torch.profiler.record_function(f"phalanx::{name}"):
                    yield
            else:
                yield
        finally:
            self.add(time.perf_counter() - start)
