"""Profiles that are written: a ``torch.profiler`` trace of chosen steps, one file per replica, in one folder.

``with phalanx.profile(logdir, steps=(a, b)):`` around a custom loop records steps ``a`` to ``b``
(``strategy.run`` calls, counted from 1 over the job, as ``strategy.extended.step`` counts them)
in every replica, and each replica writes its own Chrome trace,
``<logdir>/plugins/profile/steps_<a>-<b>/replica<r>.pt.trace.json``, which Perfetto
(ui.perfetto.dev) and ``chrome://tracing`` open (its name follows
``torch.profiler.tensorboard_trace_handler``'s pattern, for ``torch-tb-profiler``). While it records, phalanx's
collectives are marked ``phalanx::all_reduce``, ``phalanx::broadcast``, ... so the trace shows
where a step waited for its peers. ``phalanx.keras.callbacks.TensorBoard(profile_batch=(a, b))``
takes the same profile of Keras ``fit``'s batches.

Example (each replica runs this)::

    with phalanx.profile("logs", steps=(10, 12)):
        for batch in dist_data:
            strategy.run(train_step, args=(batch,))
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from phalanx import report
from phalanx.comm.timing import marking
from phalanx.core.extension_points import RUN_OBSERVERS
from phalanx.errors import ProfileError


def parse_steps(steps: Any) -> tuple[int, int]:
    """``(a, b)``, ``"a,b"`` or ``n`` (one step) as ``(first, last)``, both at least 1.

    >>> parse_steps((3, 5)), parse_steps("3,5"), parse_steps(4)
    ((3, 5), (3, 5), (4, 4))

    Raises:
        ProfileError: not a range of positive steps.
    """
    try:
        if isinstance(steps, str):
            parts = [int(p) for p in steps.split(",")]
        elif isinstance(steps, int):
            parts = [steps, steps]
        else:
            parts = [int(p) for p in steps]
        if len(parts) == 1:
            parts = parts * 2
        first, last = parts
    except (TypeError, ValueError):
        first = last = -1
    if first < 1 or last < first:
        raise ProfileError(
            f"steps must be (first, last) with 1 <= first <= last; received {steps!r}.",
            hint="e.g. steps=(10, 12) records the 10th, 11th and 12th steps",
        )
    return first, last


class Profile:
    """One profile of steps ``first`` to ``last`` of this replica; :func:`profile` makes one.

    :meth:`start` and :meth:`stop` may also be called directly (the Keras callback does, at its
    batches); the trace is written at :meth:`stop`.
    """

    def __init__(self, logdir: str | os.PathLike[str], steps: Any, *, replica: int | None = None, label: str = "steps"):
        self.first, self.last = parse_steps(steps)
        self.folder = os.path.join(os.fspath(logdir), "plugins", "profile", f"{label}_{self.first}-{self.last}")
        self._replica = replica
        self._profiler: Any = None
        self._marks: Any = None
        self.path: str | None = None
        report.activate()

    @property
    def recording(self) -> bool:
        return self._profiler is not None

    def start(self) -> None:
        """Starts recording (nothing if it records already)."""
        if self._profiler is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)
        self._marks = marking()
        self._marks.__enter__()
        self._profiler.__enter__()

    def stop(self) -> str | None:
        """Stops recording and writes this replica's trace; returns its path (None if it was not recording)."""
        if self._profiler is None:
            return None
        profiler, self._profiler = self._profiler, None
        try:
            profiler.__exit__(None, None, None)
        finally:
            self._marks.__exit__(None, None, None)
        os.makedirs(self.folder, exist_ok=True)
        self.path = os.path.join(self.folder, f"replica{self._replica_index()}.pt.trace.json")
        profiler.export_chrome_trace(self.path)
        report.record_place("traces", self.folder)
        return self.path

    def _replica_index(self) -> int:
        if self._replica is None:
            from phalanx.core.process import identity

            self._replica = identity().index
        return self._replica


class _StepProfile(Profile):
    """A :class:`Profile` driven by ``strategy.run``: starts before step ``first``, stops before ``last + 1``."""

    def __init__(self, logdir: str | os.PathLike[str], steps: Any) -> None:
        super().__init__(logdir, steps)
        self._thread = threading.get_ident()

    def observe(self, strategy: Any, fn: Any) -> None:
        del fn
        if threading.get_ident() != self._thread:  # another thread's strategy (threaded test ranks)
            return
        upcoming = strategy.extended.step + 1
        if self._replica is None:
            self._replica = int(strategy.extended.process_index)
        if upcoming == self.first:
            self.start()
        elif upcoming == self.last + 1:
            self.stop()

    def __enter__(self) -> "_StepProfile":
        RUN_OBSERVERS.append(self.observe)
        return self

    def __exit__(self, *exc: Any) -> None:
        RUN_OBSERVERS.remove(self.observe)
        self.stop()  # the block ended inside the range (or right after its last step)


def profile(logdir: str | os.PathLike[str], steps: Any = (2, 3)) -> _StepProfile:
    """Records steps ``steps = (first, last)`` of the ``strategy.run`` calls inside the block.

    Every replica writes ``<logdir>/plugins/profile/steps_<first>-<last>/replica<r>.pt.trace.json``
    (a Chrome trace, see the module docstring). Steps are the job's (``strategy.extended.step``
    after the step: the first ``run`` of a program is step 1).

    Raises:
        ProfileError: ``steps`` is not a range of positive steps.

    Example:
        >>> import json, tempfile, os
        >>> import phalanx as px
        >>> strategy = px.OneDeviceStrategy("cpu")
        >>> logdir = tempfile.mkdtemp()
        >>> with px.profile(logdir, steps=(1, 1)) as prof:
        ...     _ = strategy.run(lambda: 1.0)
        >>> "traceEvents" in json.load(open(prof.path))
        True
    """
    return _StepProfile(logdir, steps)
