"""The CSV tracker: one ``metrics.csv`` with ``step,name,value`` rows, and the run's description beside it.

Built in (the standard library's ``csv``), so it needs no extra. A run that writes into a folder
that already has a ``metrics.csv`` appends to it (a resumed job continues its file).

Example:
    >>> import tempfile, os
    >>> from phalanx.trackers import CSVTracker, RunInfo
    >>> folder = tempfile.mkdtemp()
    >>> tracker = CSVTracker()
    >>> tracker.open(RunInfo(folder, config={"lr": 0.1}))
    >>> tracker.scalar("loss", 0.5, step=1)
    >>> tracker.close()
    >>> print(open(os.path.join(folder, "metrics.csv")).read().strip())
    step,name,value
    1,loss,0.5
"""

from __future__ import annotations

import csv
import json
import os
from typing import Any, TextIO

from phalanx.trackers.base import RunInfo, Tracker

HEADER = ("step", "name", "value")


class CSVTracker(Tracker):
    """Writes scalars to ``<logdir>/metrics.csv`` and the config and environment to ``<logdir>/run.json``."""

    name = "csv"

    def __init__(self, filename: str = "metrics.csv") -> None:
        self.filename = filename
        self._file: TextIO | None = None
        self._writer: Any = None
        self._path: str | None = None

    def open(self, run: RunInfo) -> None:
        os.makedirs(run.logdir, exist_ok=True)
        self._path = os.path.join(run.logdir, self.filename)
        fresh = not os.path.exists(self._path) or os.path.getsize(self._path) == 0
        self._file = open(self._path, "a", newline="", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._writer = csv.writer(self._file)
        if fresh:
            self._writer.writerow(HEADER)
        with open(os.path.join(run.logdir, "run.json"), "w", encoding="utf-8") as f:
            json.dump(
                {"run_name": run.run_name, "config": run.config, "environment": run.environment},
                f,
                indent=2,
                default=repr,
            )

    def scalar(self, name: str, value: float, step: int) -> None:
        self._writer.writerow((step, name, repr(float(value))))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    @property
    def location(self) -> str | None:
        return self._path
