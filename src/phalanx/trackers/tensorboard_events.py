"""The TensorBoard tracker: event files through ``torch.utils.tensorboard`` (``phalanx[tensorboard]``).

``tensorboard --logdir DIR`` shows the scalars, histograms and text; the config and the job's
environment are one text summary each (``config``, ``phalanx/environment``) at step 0.
"""

from __future__ import annotations

from typing import Any

from phalanx.trackers.base import RunInfo, Tracker, as_text


class TensorBoardTracker(Tracker):
    """Writes event files into the writer's ``logdir``.

    Args:
        max_queue: events queued before a write to disk.
        flush_secs: the longest time between flushes.
        filename_suffix: appended to the event file's name.
    """

    name = "tensorboard"
    module = "tensorboard"
    extra = "tensorboard"

    def __init__(self, max_queue: int = 10, flush_secs: int = 120, filename_suffix: str = "") -> None:
        self.max_queue, self.flush_secs, self.filename_suffix = max_queue, flush_secs, filename_suffix
        self._writer: Any = None
        self._logdir: str | None = None

    def open(self, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._logdir = run.logdir
        self._writer = SummaryWriter(
            run.logdir, max_queue=self.max_queue, flush_secs=self.flush_secs, filename_suffix=self.filename_suffix
        )
        if run.config:
            self._writer.add_text("config", _markdown(as_text(run.config)), global_step=0)
        if run.environment:
            self._writer.add_text("phalanx/environment", _markdown(as_text(run.environment)), global_step=0)

    def scalar(self, name: str, value: float, step: int) -> None:
        self._writer.add_scalar(name, value, global_step=step)

    def histogram(self, name: str, values: Any, step: int, bins: Any) -> None:
        self._writer.add_histogram(name, values, global_step=step, bins=bins)

    def text(self, name: str, text: str, step: int) -> None:
        self._writer.add_text(name, text, global_step=step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    @property
    def location(self) -> str | None:
        return self._logdir


def _markdown(text: str) -> str:
    # TensorBoard renders text summaries as Markdown: indent to keep the JSON a code block.
    return "\n".join("    " + line for line in text.splitlines())
