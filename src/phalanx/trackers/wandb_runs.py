"""The W&B tracker: one Weights & Biases run per job, through W&B's own client (``phalanx[wandb]``).

``wandb.init`` is called once, in the chief, with the writer's ``logdir`` as its ``dir`` (so an
offline run is ``<logdir>/wandb/offline-run-*``), the writer's ``run_name`` and ``config``; the
job's environment joins the config under ``phalanx.*`` keys. W&B's own settings apply as usual:
``WANDB_MODE=offline`` (no login, no network; ``wandb sync`` uploads later), ``WANDB_PROJECT``,
``WANDB_ENTITY``, or ``project=`` / ``entity=`` / ``mode=`` here.

Values are logged against a ``global_step`` axis (``run.define_metric("*", step_metric=...)``):
the job's step, not W&B's row counter, so an epoch metric written at an earlier step than the
batch metrics before it is kept, not dropped. The values of one step make one row.

Example::

    from phalanx import summary
    from phalanx.trackers import WandbTracker

    writer = summary.create_file_writer("logs", trackers=(WandbTracker(project="mnist"),), run_name="baseline")
"""

from __future__ import annotations

from typing import Any

from phalanx.trackers.base import RunInfo, Tracker

STEP_METRIC = "global_step"


class WandbTracker(Tracker):
    """Logs to a W&B run.

    Args:
        project: the W&B project (default: ``WANDB_PROJECT``, else ``"phalanx"``).
        entity: the W&B entity (team or user); default: W&B's.
        mode: ``"online"``, ``"offline"`` or ``"disabled"``; default: W&B's (``WANDB_MODE``).
        **init_kwargs: passed on to ``wandb.init`` (``group``, ``tags``, ``notes``, ...).
    """

    name = "wandb"
    module = "wandb"
    extra = "wandb"

    def __init__(
        self, project: str | None = None, entity: str | None = None, mode: str | None = None, **init_kwargs: Any
    ) -> None:
        self.project, self.entity, self.mode, self.init_kwargs = project, entity, mode, init_kwargs
        self._run: Any = None
        self._row: dict[str, Any] = {}
        self._row_step: int | None = None
        self._where: str | None = None

    def open(self, run: RunInfo) -> None:
        import os

        import wandb

        os.makedirs(run.logdir, exist_ok=True)  # W&B before 0.19 falls back to a temp folder when it is missing
        config = {**run.config, **run.environment}
        self._run = wandb.init(
            project=self.project or os.environ.get("WANDB_PROJECT") or "phalanx",
            entity=self.entity,
            mode=self.mode,
            dir=run.logdir,
            name=run.run_name,
            config=config,
            **self.init_kwargs,
        )
        self._where = os.path.dirname(str(self._run.dir))  # <dir>/wandb/<run folder>/files: the run folder
        self._run.define_metric(STEP_METRIC)
        self._run.define_metric("*", step_metric=STEP_METRIC)

    def _put(self, name: str, value: Any, step: int) -> None:
        if self._row_step is not None and step != self._row_step:
            self._commit()
        self._row_step = step
        self._row[name] = value

    def _commit(self) -> None:
        if self._row:
            row, self._row = self._row, {}
            self._run.log({**row, STEP_METRIC: self._row_step})

    def scalar(self, name: str, value: float, step: int) -> None:
        self._put(name, float(value), step)

    def histogram(self, name: str, values: Any, step: int, bins: Any) -> None:
        import numpy as np
        import wandb

        array = np.asarray(values, dtype=np.float64).ravel()
        self._put(
            name, wandb.Histogram(np_histogram=np.histogram(array, bins=bins if isinstance(bins, int) else 30)), step
        )

    def text(self, name: str, text: str, step: int) -> None:
        self._put(name, text, step)

    def flush(self) -> None:
        if self._run is not None:
            self._commit()

    def close(self) -> None:
        if self._run is None:
            return
        import wandb

        try:
            self._commit()
        finally:
            run, self._run = self._run, None
            run.finish()
            # finish() leaves W&B's service process and threads up for the next run; none is left
            # open here, so stop them now rather than at exit (a test or a notebook goes on).
            if wandb.run is None:
                wandb.teardown()

    @property
    def location(self) -> str | None:
        return self._where
