"""A progress bar for custom loops: one for the job, on the chief only.

``phalanx.progress(dist_data)`` wraps a distributed dataset (or any iterable) and counts the job's
steps: each element is one global batch. The bar shows the step (of ``total``, or the iterable's
length), the job's samples per second (from the global batch size each distributed batch carries,
or ``batch_size=``), the time left, and the values last given to :meth:`Progress.set_postfix`
(the job's values: a per-replica value is refused, as ``phalanx.summary.scalar`` refuses it).

Where it draws:

* a terminal or a Jupyter notebook: ``tqdm`` (``style="tqdm"``, the default where it is
  installed, ``pip install -e ".[progress]"``) or ``rich`` (``style="rich"``);
* anything else (a batch job, a log file, a pipe): one plain line every ``interval`` seconds
  and one at the end, no carriage returns (``style="plain"``; the default off a terminal, and
  where neither tqdm nor rich is installed).

The other replicas iterate the same elements and print nothing, in a script as in a notebook
whose replicas follow the kernel.

Example (each replica runs this; the chief draws the bar)::

    bar = phalanx.progress(strategy.experimental_distribute_dataset(loader), desc="epoch 1")
    for x, y in bar:
        loss = strategy.reduce("SUM", strategy.run(step, args=(x, y)), axis=None)
        bar.set_postfix(loss=loss)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from phalanx import report
from phalanx.errors import ProgressError

STYLES = ("tqdm", "rich", "plain")
DEFAULT_INTERVAL = 30.0


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    if shell is None or "ipykernel" not in sys.modules:
        return False
    ip = shell.get_ipython() if hasattr(shell, "get_ipython") else None
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


def _installed(module: str) -> bool:
    import importlib.util

    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def choose_style(style: str | None, stream: TextIO) -> str:
    """The style to draw in: ``style`` itself (checked), or the default for ``stream`` (see the module docstring)."""
    if style is not None:
        if style not in STYLES:
            raise ProgressError(f"Unknown progress style {style!r}.", hint=f"use one of {', '.join(map(repr, STYLES))}")
        if style != "plain" and not _installed(style):
            raise ProgressError(
                f"The {style!r} progress bar needs the {style!r} package, which is not installed.",
                hint=f'pip install -e ".[progress]" (or pip install {style}), or style="plain"',
            )
        return style
    interactive = _in_notebook() or bool(getattr(stream, "isatty", lambda: False)())
    if not interactive:
        return "plain"
    return next((s for s in ("tqdm", "rich") if _installed(s)), "plain")


def _number(value: Any, name: str) -> Any:
    from phalanx.values import DistributedValues

    if isinstance(value, DistributedValues):
        raise ProgressError(
            f"set_postfix({name}=...) received a per-replica value {value!r}.",
            hint="reduce it first, e.g. strategy.reduce('SUM', value, axis=None), so the bar shows the job's value",
        )
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def _format(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """The bar :func:`progress` returns: iterate it as the iterable it wraps."""

    def __init__(
        self,
        iterable: Iterable[Any],
        total: int | None = None,
        desc: str | None = None,
        *,
        batch_size: int | None = None,
        style: str | None = None,
        interval: float = DEFAULT_INTERVAL,
        file: TextIO | None = None,
    ) -> None:
        from phalanx.core.process import identity

        self._iterable = iterable
        if total is None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
        self.total, self.desc, self.batch_size = total, desc, batch_size
        self.interval = float(interval)
        self._stream = file if file is not None else sys.stderr
        self.style = choose_style(style, self._stream)  # checked in every process: the same error everywhere
        self.chief = identity().is_chief
        self.n = 0
        self.samples = 0
        self.postfix: dict[str, Any] = {}
        self._started: float | None = None
        # The speed leaves out the first step (start-up: compilation, the trackers' first
        # connection), as a warm-up: measured from its end.
        self._first_done: tuple[float, int] | None = None
        self._last_line = 0.0
        self._printed_n = 0
        self._bar: Any = None
        self._closed = False
        report.activate()

    # ------------------------------------------------------------------ numbers
    @property
    def elapsed(self) -> float:
        return 0.0 if self._started is None else time.perf_counter() - self._started

    @property
    def samples_per_second(self) -> float | None:
        """The job's examples per second since the first step ended (None before a second step)."""
        if self._first_done is None or self.n < 2:
            return None
        at, samples = self._first_done
        seconds = time.perf_counter() - at
        return (self.samples - samples) / seconds if self.samples > samples and seconds > 0 else None

    @property
    def seconds_left(self) -> float | None:
        if self.total is None or not self.n or self.elapsed <= 0:
            return None
        if self._first_done is not None and self.n >= 2:  # the pace after the warm-up step
            per_step = (time.perf_counter() - self._first_done[0]) / (self.n - 1)
        else:
            per_step = self.elapsed / self.n
        return max(0.0, (self.total - self.n) * per_step)

    def line(self) -> str:
        """The plain line: ``desc: step n/total (p%), s samples/s, h:mm:ss left, key=value ...``."""
        parts = [f"step {self.n}" + (f"/{self.total} ({100 * self.n / self.total:.0f}%)" if self.total else "")]
        if self.samples_per_second is not None:
            parts.append(f"{self.samples_per_second:,.0f} samples/s")
        if self.seconds_left is not None:
            parts.append(f"{_duration(self.seconds_left)} left")
        parts += [f"{k}={_format(v)}" for k, v in self.postfix.items()]
        return (f"{self.desc}: " if self.desc else "") + ", ".join(parts)

    # ------------------------------------------------------------------ iteration
    def __len__(self) -> int:
        if self.total is None:
            raise TypeError("this progress bar's iterable has no length")
        return self.total

    def __iter__(self) -> Iterator[Any]:
        from phalanx.input import global_batch

        self._started = self._started or time.perf_counter()
        try:
            for element in self._iterable:
                size = self.batch_size
                if size is None:
                    info = global_batch.find((element,), {})
                    size = info.global_size if info is not None else None
                yield element
                # Counted when the loop body is done: the step is finished, not just started.
                self.n += 1
                self.samples += size or 0
                if self.n == 1:
                    self._first_done = (time.perf_counter(), self.samples)
                self._draw()
        finally:
            self.close()

    def set_postfix(self, **values: Any) -> None:
        """Shows ``values`` (the job's: reduced, not per-replica) after the numbers, until the next call."""
        self.postfix = {k: _number(v, k) for k, v in values.items()}
        if self._bar is not None and self.style == "tqdm":
            self._bar.set_postfix(self._tqdm_postfix(), refresh=False)

    # ------------------------------------------------------------------ drawing
    def _tqdm_postfix(self) -> dict[str, str]:
        shown = {k: _format(v) for k, v in self.postfix.items()}
        if self.samples_per_second is not None:
            shown = {"samples/s": f"{self.samples_per_second:,.0f}", **shown}
        return shown

    def _draw(self) -> None:
        if not self.chief or self._closed:
            return
        if self.style == "plain":
            now = time.perf_counter()
            if self.n == 1 or now - self._last_line >= self.interval:
                self._last_line, self._printed_n = now, self.n
                print(self.line(), file=self._stream, flush=True)
            return
        if self._bar is None:
            self._bar = self._open_bar()
        if self.style == "tqdm":
            self._bar.set_postfix(self._tqdm_postfix(), refresh=False)
            self._bar.update(1)
        else:
            progress, task = self._bar
            speed = f"{self.samples_per_second:,.0f} samples/s" if self.samples_per_second is not None else ""
            post = " ".join(f"{k}={_format(v)}" for k, v in self.postfix.items())
            progress.update(task, completed=self.n, speed=speed, postfix=post)

    def _open_bar(self) -> Any:
        if self.style == "tqdm":
            if _in_notebook() and _installed("ipywidgets"):
                from tqdm.notebook import tqdm
            else:
                from tqdm import tqdm
            bar = tqdm(total=self.total, desc=self.desc, unit="step", file=self._stream, dynamic_ncols=True)
            bar.update(self.n - 1)  # steps done before the bar was drawn (the first step's)
            return bar
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[speed]}"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[postfix]}"),
            console=Console(file=self._stream),
        )
        progress.start()
        task = progress.add_task(self.desc or "", total=self.total, speed="", postfix="")
        return progress, task

    def close(self) -> None:
        """Draws the last state and ends the bar (iterating to the end does it)."""
        if self._closed:
            return
        self._closed = True
        if not self.chief:
            return
        if self.style == "plain":
            if self.n and self._printed_n != self.n:  # the last state, unless its line is out already
                print(self.line(), file=self._stream, flush=True)
            return
        if self._bar is None:
            return
        if self.style == "tqdm":
            self._bar.close()
        else:
            self._bar[0].stop()


def progress(
    iterable: Iterable[Any],
    total: int | None = None,
    desc: str | None = None,
    *,
    batch_size: int | None = None,
    style: str | None = None,
    interval: float = DEFAULT_INTERVAL,
    file: TextIO | None = None,
) -> Progress:
    """Wraps ``iterable`` in the job's progress bar (drawn on the chief only; see the module docstring).

    Args:
        iterable: a distributed dataset (each element one global batch) or any iterable.
        total: the number of steps (default: ``len(iterable)`` where it has one).
        desc: the bar's label.
        batch_size: the examples per step, where the elements do not carry it (a distributed
            dataset's do).
        style: ``"tqdm"``, ``"rich"`` or ``"plain"``; default: see the module docstring.
        interval: seconds between plain lines.
        file: where to draw (default ``sys.stderr``, as tqdm).

    Raises:
        ProgressError: an unknown style, or the client of the style asked for is not installed.

    Example:
        >>> import io, phalanx as px
        >>> out = io.StringIO()
        >>> for _ in px.progress(range(3), desc="demo", batch_size=8, file=out):
        ...     pass
        >>> print(out.getvalue().splitlines()[0].split(",")[0])
        demo: step 1/3 (33%)
    """
    return Progress(iterable, total, desc, batch_size=batch_size, style=style, interval=interval, file=file)
