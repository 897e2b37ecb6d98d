"""What a tracker is: one experiment-tracking client behind :mod:`phalanx.summary`'s writer.

A :class:`Tracker` receives the job's values (already reduced over the replicas, with the job's
global step) from one process, the chief, and writes them through its library's own client. The
writer (:class:`phalanx.summary.SummaryWriter`) decides who writes, checks every value and step,
and keeps a failing tracker from taking the others down; a tracker only translates.

Example (a tracker of your own, e.g. for a tool phalanx does not ship)::

    from phalanx import summary
    from phalanx.trackers import Tracker

    class PrintTracker(Tracker):
        name = "print"

        def scalar(self, name, value, step):
            print(step, name, value)

    writer = summary.create_file_writer("logs", trackers=("csv", PrintTracker()))
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar

from phalanx.errors import TrackerUnavailableError


@dataclass(frozen=True)
class RunInfo:
    """What a tracker's run is told once, when it starts.

    Attributes:
        logdir: the writer's directory (files of file-based trackers go here).
        run_name: the run's name, or None for the tracker's default.
        config: the program's hyperparameters (``create_file_writer(config=...)``).
        environment: the job's description: strategy, replica count, phalanx and torch versions.
    """

    logdir: str
    run_name: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)


def flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optimizer": {"lr": 0.1}}`` as ``{"optimizer.lr": 0.1}`` (for trackers with flat parameters).

    >>> flat({"optimizer": {"lr": 0.1}, "epochs": 3})
    {'optimizer.lr': 0.1, 'epochs': 3}
    """
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat(value, f"{name}."))
        else:
            out[name] = value
    return out


def as_text(values: dict[str, Any]) -> str:
    """A dict as indented JSON (values JSON cannot hold become their ``repr``)."""
    return json.dumps(values, indent=2, sort_keys=True, default=repr)


class Tracker:
    """One tracking client (TensorBoard, CSV, MLflow, W&B, or your own).

    Subclasses set :attr:`name` (and, for a client that is an extra, :attr:`module` and
    :attr:`extra`) and override the writes they support; a kind of value a tracker has no place
    for (a histogram in a CSV file) is skipped by the default methods. Every method is called in
    the chief process only, after :meth:`open`.
    """

    name: ClassVar[str] = "tracker"
    module: ClassVar[str | None] = None  # the official client's import name
    extra: ClassVar[str | None] = None  # the phalanx extra that installs it

    def check_installed(self) -> None:
        """Raises :class:`~phalanx.errors.TrackerUnavailableError` when the client is not installed.

        Called in every process at ``create_file_writer``, without importing the client (some take
        a second to import), so a missing one fails the job before it trains.
        """
        if self.module is not None and not _installed(self.module):
            raise TrackerUnavailableError(self.name, self.module, self.extra or self.name)

    def open(self, run: RunInfo) -> None:
        """Starts the run and logs ``run.config`` and ``run.environment`` once."""

    def scalar(self, name: str, value: float, step: int) -> None:
        """Logs one number (NaN and infinities included) at ``step``."""

    def histogram(self, name: str, values: Any, step: int, bins: Any) -> None:
        """Logs the distribution of ``values`` (a CPU tensor); skipped by trackers without histograms."""

    def text(self, name: str, text: str, step: int) -> None:
        """Logs a string; skipped by trackers without text."""

    def flush(self) -> None:
        """Hands what is buffered to the client (the writer calls it at the end of each ``as_default``)."""

    def close(self) -> None:
        """Ends the run (flushes first)."""

    @property
    def location(self) -> str | None:
        """Where the run went (a directory, a tracking URI and run id), for the job report."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _installed(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None  # None: marked missing (as a test or a user does)
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
