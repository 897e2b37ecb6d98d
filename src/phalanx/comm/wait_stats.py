"""Where the shared-memory all-reduce's waits go: opt-in statistics, kept beside the hot path.

:class:`~phalanx.comm.shm.ShmAllReduce` records its waits here only when asked (its
``stats_dir``, or :func:`record_wait_stats` for every instance made afterwards); off, a wait pays
one attribute test, and only when a peer is missing. ``python -m benchmarks.load_diag`` turns it
on in its jobs (the diagnosis of issue 33).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phalanx.comm.core_packing import Placement

__all__ = ["WaitStats", "record_wait_stats", "stats_dir"]


class WaitStats:
    """Where a communicator's waits went; on only where asked (``stats_dir``, `record_wait_stats`).

    At close (or exit) each rank writes ``shm-<pid>-rank<rank>.json`` into the directory: the
    number of waits that found a peer missing, their wall time and this thread's CPU time during
    them, the time spent polling/yielding within the spin budget, the waits that outlived it,
    futex sleeps and time asleep, the longest wait, and a histogram of wait times. Off, a wait
    pays one attribute test, and only when a peer is missing.
    """

    BOUNDS_US = (10, 100, 1000, 10_000, 100_000)  # histogram buckets: < 10 us, < 100 us, ...

    def __init__(self, directory: str, rank: int, world_size: int, budget: float) -> None:
        self.path = os.path.join(directory, f"shm-{os.getpid()}-rank{rank}.json")
        self.data: dict[str, Any] = {
            "rank": rank,
            "world_size": world_size,
            "pid": os.getpid(),
            "spin_budget_s": budget,
            "waits": 0,  # waits that found a peer missing (the others cost a counter read)
            "wait_s": 0.0,
            "wait_cpu_s": 0.0,  # this thread's CPU time while waiting (spinning, yielding, syscalls)
            "spin_s": 0.0,  # wall time inside the spin budget
            "past_spin": 0,  # waits that outlived the spin budget
            "sleeps": 0,
            "sleep_s": 0.0,
            "longest_s": 0.0,
            "histogram_us": [0] * (len(self.BOUNDS_US) + 1),
        }
        self.placement: Placement | None = None

    def _placement(self) -> dict[str, Any]:
        p = self.placement
        if p is None:
            return {}
        return {"packing": p.enabled, "packs": p.packs, "packed_s": p.packed_seconds()}

    def wait(self, wall: float, cpu: float, spin: float) -> None:
        d = self.data
        d["waits"] += 1
        d["wait_s"] += wall
        d["wait_cpu_s"] += cpu
        d["spin_s"] += min(wall, spin)
        d["past_spin"] += wall > spin
        d["longest_s"] = max(d["longest_s"], wall)
        us = wall * 1e6
        d["histogram_us"][sum(us >= b for b in self.BOUNDS_US)] += 1

    def sleep(self, wall: float) -> None:
        self.data["sleeps"] += 1
        self.data["sleep_s"] += wall

    def write(self) -> None:
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(self.path, "w") as f:
                json.dump({**self.data, **self._placement()}, f)
        except OSError:  # diagnostics never fail a job
            pass


_STATS_DIR: list[str | None] = [None]  # set by record_wait_stats


def record_wait_stats(directory: str | None) -> None:
    """Makes every `~phalanx.comm.shm.ShmAllReduce` created after this in the process record where its waits go.

    At close (or exit) each rank then writes ``shm-<pid>-rank<rank>.json`` into ``directory``:
    waits that found a peer missing, their wall and CPU time, time spinning, futex sleeps and time
    asleep, the longest wait and a histogram (the diagnosis of issue 33; ``python -m
    benchmarks.load_diag`` turns it on in its jobs). ``None`` turns it off for later instances.
    A wait pays one attribute test for it, and only when a peer is missing.
    """
    _STATS_DIR[0] = directory


def stats_dir() -> str | None:
    """The directory :func:`record_wait_stats` set, if any."""
    return _STATS_DIR[0]
