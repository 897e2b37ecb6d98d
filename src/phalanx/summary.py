"""Summaries from a custom training loop, in ``tf.summary``'s shape, written once per job, to the trackers you use.

Every replica process runs the training program, so every process reaches the summary calls.
A writer writes only in the chief process (replica 0, or the ``chief`` task); everywhere else the
calls are checked the same way and write nothing, so a job leaves exactly one run in each tracker.
The trackers are named at :func:`create_file_writer` (see :mod:`phalanx.trackers`):
``"tensorboard"`` (the default; event files through ``torch.utils.tensorboard``,
``pip install -e ".[tensorboard]"``), ``"csv"`` (``metrics.csv``, built in), ``"mlflow"``
(``phalanx[mlflow]``) and ``"wandb"`` (``phalanx[wandb]``), each through its own client.

Example (each replica runs this; only the chief writes ``logs/``)::

    import phalanx as px
    from phalanx import summary

    strategy = px.MirroredStrategy(["cpu:0", "cpu:1"])
    writer = summary.create_file_writer("logs/train", trackers=("tensorboard", "csv", "mlflow"),
                                        config={"lr": 0.1, "batch": 64}, run_name="baseline")
    for step, (x, y) in enumerate(strategy.experimental_distribute_dataset(loader)):
        loss = strategy.reduce("SUM", strategy.run(train_step, args=(x, y)), axis=None)
        with writer.as_default(step=step):
            summary.scalar("loss", loss)                 # one value, reduced over the replicas
            summary.histogram("dense/kernel", model[0].weight)
    writer.close()

Differences from ``tf.summary``: values are torch tensors, numpy arrays or numbers; a
:class:`~phalanx.values.PerReplica` value is refused (reduce it first, so the curve shows the
whole job, not replica 0's share); a step lower than one already written under the same name is
refused. A NaN or infinite value is logged as it is, with one warning per writer. A tracker that
fails in the middle of a run is dropped with one warning naming it; the others keep every value.
Which process writes is decided at the first write, from the strategy that is current then or,
outside any ``scope()``, the strategy this process built last (see :func:`phalanx.is_chief`; a
program without one is a single process, which writes). :func:`job_report` says where the job's
time and memory went.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import threading
import types
import warnings
import weakref
from collections.abc import Iterable
from typing import Any, Iterator

from phalanx.errors import NonFiniteSummaryWarning, SummaryError, TrackerError, TrackerFailedWarning

__all__ = [
    "SummaryWriter",
    "SummaryError",
    "create_file_writer",
    "create_noop_writer",
    "scalar",
    "histogram",
    "text",
    "flush",
    "record_if",
    "should_record_summaries",
    "get_step",
    "set_step",
    "experimental",
    "job_report",
]


class _State(threading.local):
    def __init__(self) -> None:
        self.writers: list["SummaryWriter"] = []
        self.step: int | None = None
        self.record: list[Any] = []


_state = _State()


def _is_chief() -> bool:
    from phalanx.core.process import identity

    # The current strategy, else the one this process built last, else the launcher's
    # environment, else a single process (which writes): a custom loop writes outside scope().
    return identity().is_chief


def _environment() -> dict[str, str]:
    """The job's description, logged once per run: strategy, replica count, versions."""
    import torch

    from phalanx.core.context import get_strategy, has_strategy
    from phalanx.core.process import identity
    from phalanx.core.strategy import live_strategy

    strategy = get_strategy() if has_strategy() else live_strategy()
    try:
        from importlib.metadata import version

        phalanx_version = version("phalanx")
    except Exception:  # not installed as a distribution (a source checkout on sys.path)
        phalanx_version = "unknown"
    return {
        "phalanx.strategy": type(strategy).__name__ if strategy is not None else "none",
        "phalanx.num_replicas": str(strategy.num_replicas_in_sync if strategy is not None else identity().count),
        "phalanx.version": phalanx_version,
        "torch.version": str(torch.__version__),
    }


_OPEN_WRITERS: "weakref.WeakSet[SummaryWriter]" = weakref.WeakSet()


def _close_open_writers() -> None:
    # An MLflow run left open stays RUNNING; a program that never calls writer.close() still
    # ends its runs. Quietly: W&B finishes its own run at exit, maybe before this runs, and a
    # client that closed itself is no tracker failing mid-run.
    for writer in list(_OPEN_WRITERS):
        with contextlib.suppress(Exception), warnings.catch_warnings():
            warnings.simplefilter("ignore", TrackerFailedWarning)
            writer.close()


atexit.register(_close_open_writers)


class SummaryWriter:
    """A writer to one or more trackers that writes in the chief process only.

    Create it with :func:`create_file_writer`. Each tracker's run (and the log directory) is
    created at the first write, and only in the chief, so the other replicas never touch the file
    system or a tracking server.
    """

    def __init__(
        self,
        logdir: str | os.PathLike[str] | None,
        *,
        max_queue: int | None = None,
        flush_millis: int | None = None,
        filename_suffix: str | None = None,
        trackers: Iterable[Any] | str = ("tensorboard",),
        config: dict[str, Any] | None = None,
        run_name: str | None = None,
    ) -> None:
        from phalanx.trackers import resolve

        self._logdir = None if logdir is None else os.fspath(logdir)
        tensorboard = {
            "max_queue": 10 if max_queue is None else int(max_queue),
            "flush_secs": 120 if flush_millis is None else max(1, int(flush_millis) // 1000),
            "filename_suffix": filename_suffix or "",
        }
        # Names are checked (and clients looked for) in every process, so a typo or a missing
        # extra fails the whole job at once, before it trains.
        self._trackers = [] if self._logdir is None else resolve(trackers, **tensorboard)
        if config is not None and not isinstance(config, dict):
            raise SummaryError(
                f"config must be a dict of hyperparameters; received {config!r}.",
                hint="e.g. config={'lr': 0.1, 'batch_size': 64}",
            )
        self._config = dict(config or {})
        self._run_name = run_name
        if self._trackers:
            from phalanx import report

            report.activate()  # a job that logs its run gets the job report at exit (every replica sends its row)
        self._chief: bool | None = None
        self._opened = False
        self._closed = False
        self._last_step: dict[str, int] = {}
        self._latest_step: int | None = None  # the step of the last value written, for messages
        self._warned_non_finite = False
        self._lock = threading.Lock()

    @property
    def logdir(self) -> str | None:
        return self._logdir

    @property
    def trackers(self) -> tuple[Any, ...]:
        """The trackers still writing (a tracker that failed mid-run is no longer among them)."""
        return tuple(self._trackers)

    def is_writing(self) -> bool:
        """Whether this process writes (decided once, at the first call)."""
        if self._chief is None:
            self._chief = self._logdir is not None and _is_chief()
        return self._chief and not self._closed

    def init(self) -> None:
        """Starts the trackers' runs now rather than at the first write (in the chief; elsewhere nothing)."""
        if self.is_writing():
            self._open()

    def _open(self) -> None:
        if self._opened:
            return
        from phalanx import report
        from phalanx.trackers import RunInfo

        self._opened = True
        run = RunInfo(self._logdir or "", self._run_name, self._config, _environment())
        for tracker in self._trackers:
            try:
                tracker.open(run)
            except Exception as e:  # a server or a login the client needs: fail before training
                raise TrackerError(tracker.name, e, hint=_open_hint(tracker.name)) from e
        _OPEN_WRITERS.add(self)
        for tracker in self._trackers:
            report.record_place("logs", tracker.location or self._logdir or "")

    @contextlib.contextmanager
    def as_default(self, step: int | None = None) -> Iterator["SummaryWriter"]:
        """Makes this the writer that :func:`scalar` and friends use; ``step`` becomes the default step."""
        _state.writers.append(self)
        previous = _state.step
        if step is not None:
            _state.step = int(step)
        try:
            yield self
        finally:
            _state.writers.pop()
            if step is not None:
                _state.step = previous
            self.flush()

    def set_as_default(self, step: int | None = None) -> None:
        """Makes this the default writer until another is set (TF's ``set_as_default``)."""
        _state.writers[:] = [self]
        if step is not None:
            _state.step = int(step)

    def flush(self) -> None:
        if self._opened and not self._closed:
            self._each("flush", step=self._latest_step)

    def close(self) -> None:
        """Flushes and ends every tracker's run; later writes through this writer are ignored."""
        if self._closed:
            return
        if self._opened:
            self._each("close")
        self._closed = True
        _OPEN_WRITERS.discard(self)

    def _each(self, method: str, *args: Any, step: int | None = None) -> None:
        for tracker in list(self._trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as e:
                self._drop(tracker, method, e, step)

    def _drop(self, tracker: Any, method: str, error: BaseException, step: int | None) -> None:
        """A tracker failed: the run goes on without it, saying so once; the others keep every value."""
        with self._lock:
            if tracker not in self._trackers:
                return
            self._trackers.remove(tracker)
        at = f" at step {step}" if step is not None else ""
        warnings.warn(
            f"The {tracker.name!r} tracker failed in {method}(){at} ({type(error).__name__}: {error}); the run goes "
            f"on without it, and the other trackers "
            f"({', '.join(repr(t.name) for t in self._trackers) or 'none left'}) keep every value.",
            TrackerFailedWarning,
            stacklevel=4,
        )
        with contextlib.suppress(Exception):
            tracker.close()

    def _check_step(self, name: str, step: int) -> None:
        last = self._last_step.get(name)
        if last is not None and step < last:
            raise SummaryError(
                f"Summary {name!r} received step {step}, before step {last} already written for it.",
                hint="steps of one name must not go back: use the job's global step (e.g. strategy.extended.step), "
                "or a new writer (another logdir) for a new run",
            )
        self._last_step[name] = step

    def _write(self, kind: str, name: str, data: Any, step: int | None, **kwargs: Any) -> bool:
        if self._logdir is None or self._closed or not should_record_summaries():
            return False
        # Checked in every process, so that bad input fails every replica at the same call.
        step = _resolve_step(step, name)
        value = _plain(data, name)
        self._check_step(name, step)
        if not self.is_writing():
            return False
        self._open()
        self._latest_step = step
        if kind == "scalar":
            number = float(value)
            if not math.isfinite(number) and not self._warned_non_finite:
                self._warned_non_finite = True
                warnings.warn(
                    f"Summary {name!r} is {number} at step {step}; it is logged as it is (this writer says so once).",
                    NonFiniteSummaryWarning,
                    stacklevel=3,
                )
            self._each("scalar", name, number, step, step=step)
        elif kind == "histogram":
            self._each("histogram", name, value, step, kwargs["bins"], step=step)
        else:
            self._each("text", name, str(value), step, step=step)
        return True


def _open_hint(tracker: str) -> str:
    return {
        "mlflow": "set MLFLOW_TRACKING_URI (e.g. file:./mlruns with MLFLOW_ALLOW_FILE_STORE=true, or "
        "sqlite:///mlflow.db with the full mlflow package), or pass MLflowTracker(tracking_uri=...)",
        "wandb": "run `wandb login`, or set WANDB_MODE=offline to write the run to disk and `wandb sync` it later",
    }.get(tracker, "see the error above")


def create_file_writer(
    logdir: str | os.PathLike[str],
    max_queue: int | None = None,
    flush_millis: int | None = None,
    filename_suffix: str | None = None,
    name: str | None = None,
    experimental_trackable: bool = False,
    *,
    trackers: Iterable[Any] | str = ("tensorboard",),
    config: dict[str, Any] | None = None,
    run_name: str | None = None,
) -> SummaryWriter:
    """A writer to the trackers named, written by the chief process only: one run per tracker per job.

    Args:
        logdir: the run's directory: TensorBoard's event files, ``metrics.csv``, W&B's ``wandb/``
            folder (created at the first write, on the chief).
        max_queue: TensorBoard events queued before a write to disk (default 10).
        flush_millis: the longest time between TensorBoard flushes, in milliseconds (default 120000).
        filename_suffix: appended to the event file's name.
        name, experimental_trackable: accepted for TF compatibility; unused.
        trackers: names (``"tensorboard"``, ``"csv"``, ``"mlflow"``, ``"wandb"``) or
            :class:`phalanx.trackers.Tracker` objects (for their options); default TensorBoard.
        config: the run's hyperparameters, logged once (MLflow parameters, W&B config,
            TensorBoard text, ``run.json`` beside the CSV) with the job's strategy, replica count
            and phalanx and torch versions.
        run_name: the run's name in MLflow and W&B.

    Raises:
        UnknownTrackerError: a tracker name phalanx does not know.
        TrackerUnavailableError: a tracker's client is not installed (the hint names the extra).

    Example:
        >>> import tempfile, os
        >>> import phalanx as px
        >>> from phalanx import summary
        >>> logdir = tempfile.mkdtemp()
        >>> strategy = px.OneDeviceStrategy("cpu")  # one process: the chief, which writes
        >>> with strategy.scope():
        ...     writer = summary.create_file_writer(logdir, trackers=("csv",), config={"lr": 0.1})
        ...     with writer.as_default(step=1):
        ...         summary.scalar("loss", 0.25)
        True
        >>> writer.close()
        >>> print(open(os.path.join(logdir, "metrics.csv")).read().strip())
        step,name,value
        1,loss,0.25
    """
    del name, experimental_trackable
    return SummaryWriter(
        logdir,
        max_queue=max_queue,
        flush_millis=flush_millis,
        filename_suffix=filename_suffix,
        trackers=trackers,
        config=config,
        run_name=run_name,
    )


def create_noop_writer() -> SummaryWriter:
    """A writer that never writes (TF's ``create_noop_writer``)."""
    return SummaryWriter(None, trackers=())


def _default_writer() -> SummaryWriter | None:
    return _state.writers[-1] if _state.writers else None


def _resolve_step(step: int | None, name: str) -> int:
    if step is None:
        step = _state.step
    if step is None:
        raise SummaryError(
            f"No step for summary {name!r}.",
            hint="pass step=..., or use writer.as_default(step=...) or phalanx.summary.set_step(n)",
        )
    return int(step)


def _plain(data: Any, name: str) -> Any:
    from phalanx.values import DistributedValues

    if isinstance(data, DistributedValues):
        raise SummaryError(
            f"Summary {name!r} received a per-replica value {data!r}.",
            hint="reduce it first, e.g. strategy.reduce('SUM', value, axis=None), so the summary covers every replica",
        )
    try:
        import torch

        if isinstance(data, torch.Tensor):
            return data.detach().cpu()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return data


def scalar(name: str, data: Any, step: int | None = None, description: str | None = None) -> bool:
    """Writes a scalar to the default writer; returns whether it was written (False off the chief).

    Raises:
        SummaryError: no step was given or set, or ``data`` is a per-replica value.
    """
    del description
    writer = _default_writer()
    return False if writer is None else writer._write("scalar", name, data, step)


def histogram(
    name: str, data: Any, step: int | None = None, buckets: int | None = None, description: str | None = None
) -> bool:
    """Writes a histogram of ``data``'s values (e.g. a weight tensor); returns whether it was written."""
    del description
    writer = _default_writer()
    kwargs = {"bins": "tensorflow" if buckets is None else int(buckets)}
    return False if writer is None else writer._write("histogram", name, data, step, **kwargs)


def text(name: str, data: Any, step: int | None = None, description: str | None = None) -> bool:
    """Writes a text summary; returns whether it was written."""
    del description
    writer = _default_writer()
    return False if writer is None else writer._write("text", name, data, step)


def flush(writer: SummaryWriter | None = None, name: str | None = None) -> None:
    """Flushes ``writer`` (default: the default writer)."""
    del name
    writer = writer or _default_writer()
    if writer is not None:
        writer.flush()


@contextlib.contextmanager
def record_if(condition: Any) -> Iterator[None]:
    """Records summaries only while ``condition`` (a bool or a callable returning one) holds."""
    _state.record.append(condition)
    try:
        yield
    finally:
        _state.record.pop()


def should_record_summaries() -> bool:
    """Whether summaries are recorded here (every enclosing :func:`record_if` condition holds)."""
    return all(c() if callable(c) else bool(c) for c in _state.record)


def get_step() -> int | None:
    """The default step (``tf.summary.experimental.get_step``)."""
    return _state.step


def set_step(step: int | None) -> None:
    """Sets the default step (``tf.summary.experimental.set_step``)."""
    _state.step = None if step is None else int(step)


def job_report(print_it: bool = True) -> Any:
    """Where this job's time and memory went so far: a collective (every replica calls it).

    Returns the :class:`phalanx.report.JobReport` (steps, samples per second, the share of step
    time spent waiting in collectives, peak host and GPU memory per replica, and where logs,
    traces and checkpoints went); the chief prints it when ``print_it``. See :mod:`phalanx.report`.
    """
    from phalanx import report

    return report.job_report(print_it=print_it)


experimental = types.SimpleNamespace(get_step=get_step, set_step=set_step)
