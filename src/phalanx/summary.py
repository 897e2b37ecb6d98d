"""TensorBoard summaries from a custom training loop, in ``tf.summary``'s shape, written once.

Every replica process runs the training program, so every process reaches the summary calls.
A writer writes only in the chief process (the strategy's ``extended.should_save_summary``:
replica 0, or the ``chief`` task); everywhere else the calls are accepted and do nothing, so one
run leaves exactly one set of event files. Files are written with
``torch.utils.tensorboard`` (``pip install "phalanx[tensorboard]"``); view them with
``tensorboard --logdir DIR``.

Example (each replica runs this; only the chief writes ``logs/``)::

    import phalanx as px
    from phalanx import summary

    strategy = px.MirroredStrategy(["cpu:0", "cpu:1"])
    writer = summary.create_file_writer("logs/train")
    for step, (x, y) in enumerate(strategy.experimental_distribute_dataset(loader)):
        loss = strategy.reduce("SUM", strategy.run(train_step, args=(x, y)), axis=None)
        with writer.as_default(step=step):
            summary.scalar("loss", loss)                 # one value, reduced over the replicas
            summary.histogram("dense/kernel", model[0].weight)
    writer.close()

Differences from ``tf.summary``: values are torch tensors, numpy arrays or numbers; a
:class:`~phalanx.values.PerReplica` value is refused (reduce it first, so the curve shows the
whole job, not replica 0's share). Which process writes is decided at the first write, from the
strategy that is current then or, outside any ``scope()``, the strategy this process built last
(see :func:`phalanx.is_chief`; a program without one is a single process, which writes).
"""

from __future__ import annotations

import contextlib
import os
import threading
import types
from typing import Any, Iterator

from phalanx.errors import PhalanxError

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
]


class SummaryError(PhalanxError, ValueError):
    """A summary call phalanx cannot honour (no step, a per-replica value, tensorboard missing)."""


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


class SummaryWriter:
    """A TensorBoard event-file writer that writes in the chief process only.

    Create it with :func:`create_file_writer`. The underlying
    ``torch.utils.tensorboard.SummaryWriter`` (and the log directory) is created at the first
    write, and only in the chief, so the other replicas never touch the file system.
    """

    def __init__(
        self,
        logdir: str | os.PathLike[str] | None,
        *,
        max_queue: int | None = None,
        flush_millis: int | None = None,
        filename_suffix: str | None = None,
    ) -> None:
        self._logdir = None if logdir is None else os.fspath(logdir)
        self._max_queue = 10 if max_queue is None else int(max_queue)
        self._flush_secs = 120 if flush_millis is None else max(1, int(flush_millis) // 1000)
        self._suffix = filename_suffix or ""
        self._writer: Any = None
        self._chief: bool | None = None
        self._closed = False

    @property
    def logdir(self) -> str | None:
        return self._logdir

    def is_writing(self) -> bool:
        """Whether this process writes (decided once, at the first call)."""
        if self._chief is None:
            self._chief = self._logdir is not None and _is_chief()
        return self._chief and not self._closed

    def _torch_writer(self) -> Any:
        if self._writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter as TorchWriter
            except ImportError as e:
                raise SummaryError(
                    f"Writing TensorBoard summaries needs the tensorboard package ({e}).",
                    hint='pip install "phalanx[tensorboard]" (or pip install tensorboard)',
                ) from e
            self._writer = TorchWriter(
                self._logdir, max_queue=self._max_queue, flush_secs=self._flush_secs, filename_suffix=self._suffix
            )
        return self._writer

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

    def init(self) -> None:
        """Nothing to do (TF API compatibility): the file is opened at the first write."""

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flushes and closes the file; later writes through this writer are ignored."""
        if self._writer is not None:
            self._writer.close()
        self._closed = True

    def _write(self, kind: str, name: str, data: Any, step: int | None, **kwargs: Any) -> bool:
        if not self.is_writing() or not should_record_summaries():
            return False
        step = _resolve_step(step, name)
        value = _plain(data, name)
        writer = self._torch_writer()
        if kind == "scalar":
            writer.add_scalar(name, float(value), global_step=step)
        elif kind == "histogram":
            writer.add_histogram(name, value, global_step=step, **kwargs)
        else:
            writer.add_text(name, str(value), global_step=step)
        return True


def create_file_writer(
    logdir: str | os.PathLike[str],
    max_queue: int | None = None,
    flush_millis: int | None = None,
    filename_suffix: str | None = None,
    name: str | None = None,
    experimental_trackable: bool = False,
) -> SummaryWriter:
    """A writer of TensorBoard event files in ``logdir``, written by the chief process only.

    Args:
        logdir: the directory of the event files (created at the first write, on the chief).
        max_queue: events queued before a write to disk (default 10).
        flush_millis: the longest time between flushes, in milliseconds (default 120000).
        filename_suffix: appended to the event file's name.
        name, experimental_trackable: accepted for TF compatibility; unused.
    """
    del name, experimental_trackable
    return SummaryWriter(logdir, max_queue=max_queue, flush_millis=flush_millis, filename_suffix=filename_suffix)


def create_noop_writer() -> SummaryWriter:
    """A writer that never writes (TF's ``create_noop_writer``)."""
    return SummaryWriter(None)


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


experimental = types.SimpleNamespace(get_step=get_step, set_step=set_step)
