"""The job report: where a job's time and memory went, and where its logs, traces and checkpoints are.

One block, printed by the chief: the steps, the job's samples per second, the share of step time
each replica spent waiting in collectives (the communicator's timers, :mod:`phalanx.comm.timing`),
peak host and GPU memory per replica, and the places the job wrote to. Two ways to get it:

* :func:`job_report` (also ``phalanx.summary.job_report()``): a collective every replica calls;
  returns the :class:`JobReport` everywhere and prints it on the chief.
* At the end of a job that watched itself (it wrote through a ``phalanx.summary`` writer, showed
  a ``phalanx.progress`` bar or took a ``phalanx.profile``), the chief prints it as the program
  exits. The replicas send their rows through the job's store (small JSON strings, no pickles),
  and the chief waits for them at most :data:`EXIT_WAIT_SECONDS`; a job that ends with an
  uncaught exception prints none. ``PHALANX_JOB_REPORT=0`` turns it off.

Example:
    >>> import phalanx as px
    >>> from phalanx import report
    >>> strategy = px.OneDeviceStrategy("cpu")
    >>> _ = strategy.run(lambda: 1.0)
    >>> rep = report.job_report(print_it=False, strategy=strategy)
    >>> rep.steps, len(rep.replicas)
    (1, 1)
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import resource
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

EXIT_WAIT_SECONDS = 10.0
_KEY = "phalanx/job-report/"


@dataclass(frozen=True)
class ReplicaRow:
    """One replica's part of the report.

    Attributes:
        replica: the replica's index (0 is the chief).
        steps: ``strategy.run`` calls.
        samples: examples of the global batches read (the whole job's, as every replica counts them).
        seconds: since the first step began.
        collective_seconds: spent in collectives since the first step.
        peak_host_bytes: the process's peak resident memory.
        peak_gpu_bytes: the peak memory torch allocated on its GPU (None on a CPU replica).
    """

    replica: int
    steps: int
    samples: int
    seconds: float
    collective_seconds: float
    peak_host_bytes: int
    peak_gpu_bytes: int | None = None

    @property
    def collective_share(self) -> float:
        return self.collective_seconds / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class JobReport:
    """The whole job's report (see the module docstring); ``str()`` is the printed block."""

    strategy: str
    replicas: list[ReplicaRow]
    places: dict[str, list[str]] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)  # replicas whose rows did not arrive

    @property
    def steps(self) -> int:
        return max((r.steps for r in self.replicas), default=0)

    @property
    def seconds(self) -> float:
        return max((r.seconds for r in self.replicas), default=0.0)

    @property
    def samples_per_second(self) -> float | None:
        chief = self.replicas[0] if self.replicas else None
        if chief is None or not chief.samples or chief.seconds <= 0:
            return None
        return chief.samples / chief.seconds

    @property
    def collective_share(self) -> float:
        """The mean over the replicas of the share of step time spent in collectives."""
        return sum(r.collective_share for r in self.replicas) / len(self.replicas) if self.replicas else 0.0

    def __str__(self) -> str:
        n = len(self.replicas) + len(self.missing)
        speed = self.samples_per_second
        lines = [
            f"phalanx job report: {self.strategy}, {n} replica{'s' if n != 1 else ''}",
            f"  {self.steps} steps in {self.seconds:.1f} s"
            + (f", {speed:,.0f} samples/s" if speed is not None else "")
            + f"; waiting in collectives: {100 * self.collective_share:.1f}% of step time",
            f"  {'replica':>7}  {'steps':>6}  {'collectives':>11}  {'peak host':>10}  {'peak GPU':>10}",
        ]
        for r in self.replicas:
            gpu = _size(r.peak_gpu_bytes) if r.peak_gpu_bytes is not None else "-"
            share = f"{100 * r.collective_share:.1f}%"
            lines.append(f"  {r.replica:>7}  {r.steps:>6}  {share:>11}  {_size(r.peak_host_bytes):>10}  {gpu:>10}")
        for m in self.missing:
            lines.append(f"  {m:>7}  (no report: the replica ended before sending it)")
        for kind in ("logs", "traces", "checkpoints"):
            if self.places.get(kind):
                lines.append(f"  {kind}: " + ", ".join(self.places[kind]))
        return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


# ----------------------------------------------------------------------------- places
class Places:
    """Where this process wrote (logs, traces, checkpoints), each folder once, in order."""

    def __init__(self) -> None:
        self._kinds: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    def add(self, kind: str, where: str) -> None:
        if not where:
            return
        with self._lock:
            found = self._kinds.setdefault(kind, [])
            if where not in found:
                found.append(where)

    def as_dict(self) -> dict[str, list[str]]:
        with self._lock:
            return {k: list(v) for k, v in self._kinds.items()}


PLACES = Places()


def record_place(kind: str, where: str | os.PathLike[str]) -> None:
    """Notes that the job wrote ``kind`` (``"logs"``, ``"traces"``, ``"checkpoints"``) at ``where``."""
    where = os.fspath(where)
    # A path as an absolute one (the job may have changed directory since); a URI as it is.
    PLACES.add(kind, where if "://" in where or not where else os.path.abspath(where))


# ----------------------------------------------------------------------------- rows
def _strategy() -> Any:
    from phalanx.core.context import get_strategy, has_strategy
    from phalanx.core.strategy import live_strategies

    candidates = ([get_strategy()] if has_strategy() else []) + live_strategies()
    candidates = [s for s in candidates if getattr(s.extended, "stats", None) is not None]
    # The job's strategy: the one spanning the most processes, then the one that ran the most steps.
    return max(candidates, key=lambda s: (s.extended.num_processes, s.extended.stats.steps), default=None)


def local_row(strategy: Any) -> ReplicaRow:
    """This replica's row."""
    ext = strategy.extended
    stats = ext.stats
    times = getattr(ext.communicator, "times", None)
    waited = (times.seconds - stats.wait_before_first_step) if times is not None and stats.steps else 0.0
    gpu = None
    if ext.device.type == "cuda":
        gpu = int(torch.cuda.max_memory_allocated(ext.device))
    # Linux reports kilobytes, macOS bytes.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return ReplicaRow(
        replica=int(ext.process_index),
        steps=stats.steps,
        samples=stats.samples,
        seconds=stats.seconds(),
        collective_seconds=max(0.0, waited),
        peak_host_bytes=int(peak),
        peak_gpu_bytes=gpu,
    )


_FIELDS = ("replica", "steps", "samples", "seconds", "collective_seconds", "peak_host_bytes", "peak_gpu_bytes")


def job_report(print_it: bool = True, strategy: Any = None) -> JobReport:
    """The job's report so far: a collective, every replica calls it; the chief prints it.

    Args:
        print_it: print the block on the chief (the other replicas never print it).
        strategy: the job's strategy (default: the current one, else the one this process built).

    Raises:
        SummaryError: no strategy in this process.
    """
    from phalanx.errors import SummaryError

    strategy = strategy or _strategy()
    if strategy is None:
        raise SummaryError(
            "job_report() found no strategy in this process.", hint="call it after creating the strategy"
        )
    comm = strategy.extended.communicator
    row = local_row(strategy)
    values = torch.tensor(
        [float(-1 if v is None else v) for v in (getattr(row, f) for f in _FIELDS)], dtype=torch.float64
    )
    rows = [_row_from(t.tolist()) for t in comm.all_gather(values)] if comm.world_size > 1 else [row]
    report = JobReport(type(strategy).__name__, rows, PLACES.as_dict())
    if print_it and strategy.extended.should_checkpoint:
        print(report, flush=True)
    return report


def _row_from(values: list[float]) -> ReplicaRow:
    kwargs: dict[str, Any] = dict(zip(_FIELDS, values))
    for name in ("replica", "steps", "samples", "peak_host_bytes"):
        kwargs[name] = int(kwargs[name])
    kwargs["peak_gpu_bytes"] = None if kwargs["peak_gpu_bytes"] < 0 else int(kwargs["peak_gpu_bytes"])
    return ReplicaRow(**kwargs)


# ----------------------------------------------------------------------------- at exit
class _AtExit:
    """Prints the report when the program ends, once something asked to watch the job."""

    def __init__(self) -> None:
        self.registered = False
        self.lock = threading.Lock()

    def activate(self) -> None:
        if _setting() == "0":
            return
        with self.lock:
            if not self.registered:
                self.registered = True
                # Registered after the communicator's own atexit (made with the strategy), so it
                # runs first, while the job's store still serves.
                atexit.register(self.run)

    def run(self) -> None:
        if getattr(sys, "last_value", None) is not None:  # the program died of an exception
            return
        with contextlib.suppress(Exception):  # a report must never fail a job that succeeded
            _exchange_and_print()


_AT_EXIT = _AtExit()


def activate() -> None:
    """Prints the job report when the program exits (the summary writers, progress bars and profiles call it)."""
    _AT_EXIT.activate()


def _exchange_and_print() -> None:
    strategy = _strategy()
    if strategy is None or strategy.extended.stats.steps == 0:
        return
    ext = strategy.extended
    comm = ext.communicator
    row = local_row(strategy)
    if comm.world_size == 1:
        print(JobReport(type(strategy).__name__, [row], PLACES.as_dict()), flush=True)
        return
    store = comm.store
    if not ext.should_checkpoint:
        store.set(f"{_KEY}{row.replica}", json.dumps(asdict(row)))
        return
    rows, missing = [row], []
    deadline = time.monotonic() + EXIT_WAIT_SECONDS  # one wait for all of them, not one each
    for rank in range(comm.world_size):
        if rank == row.replica:
            continue
        try:
            left = max(0.05, deadline - time.monotonic())
            store.wait([f"{_KEY}{rank}"], datetime.timedelta(seconds=left))
            rows.append(ReplicaRow(**json.loads(store.get(f"{_KEY}{rank}"))))
        except Exception:  # ended without sending (killed, or failed after its last step)
            missing.append(rank)
    rows.sort(key=lambda r: r.replica)
    print(JobReport(type(strategy).__name__, rows, PLACES.as_dict(), missing), flush=True)


def _setting() -> str:
    from phalanx.config import settings

    return (settings().job_report or "").strip()
