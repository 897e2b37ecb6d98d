"""Experiment trackers behind :mod:`phalanx.summary`: TensorBoard, CSV, MLflow and W&B, each through its own client.

``phalanx.summary.create_file_writer(logdir, trackers=(...))`` names them; this package resolves the
names, checks that each client is installed (a typed error naming the extra otherwise), and holds
the tracker classes, whose options a program passes by giving an object instead of a name:

* ``"tensorboard"``: ``torch.utils.tensorboard`` (``phalanx[tensorboard]``); scalars, histograms, text.
* ``"csv"``: the standard library; scalars (``metrics.csv``: ``step,name,value``).
* ``"mlflow"``: ``mlflow`` (``mlflow-skinny`` is enough; ``phalanx[mlflow]``); scalars, text (as
  artifacts), the config as parameters.
* ``"wandb"``: ``wandb`` (``phalanx[wandb]``); scalars, histograms, text, config.

Example:
    >>> from phalanx import trackers
    >>> [t.name for t in trackers.resolve(("csv",))]
    ['csv']
    >>> trackers.resolve(("tensorbord",))
    Traceback (most recent call last):
    ...
    phalanx.errors.UnknownTrackerError: Unknown tracker 'tensorbord'. HINT: use one of 'tensorboard', ...
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from phalanx.errors import UnknownTrackerError
from phalanx.trackers.base import RunInfo, Tracker
from phalanx.trackers.csv_file import CSVTracker
from phalanx.trackers.mlflow_runs import MLflowTracker
from phalanx.trackers.tensorboard_events import TensorBoardTracker
from phalanx.trackers.wandb_runs import WandbTracker

TRACKERS: dict[str, type[Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "csv": CSVTracker,
    "mlflow": MLflowTracker,
    "wandb": WandbTracker,
}

__all__ = [
    "CSVTracker",
    "MLflowTracker",
    "RunInfo",
    "TRACKERS",
    "TensorBoardTracker",
    "Tracker",
    "WandbTracker",
    "resolve",
]


def resolve(trackers: str | Tracker | Iterable[str | Tracker], **tensorboard_options: Any) -> list[Tracker]:
    """The trackers named (or given) in ``trackers``, each checked to be installed.

    Args:
        trackers: names from :data:`TRACKERS`, :class:`Tracker` objects, or a mix.
        **tensorboard_options: options of the TensorBoard tracker made from the name
            ``"tensorboard"`` (``max_queue``, ``flush_secs``, ``filename_suffix``).

    Raises:
        UnknownTrackerError: a name phalanx does not know, or something that is neither a name
            nor a tracker.
        TrackerUnavailableError: a tracker's client is not installed; the hint names the extra.
    """
    if isinstance(trackers, (str, Tracker)):
        trackers = (trackers,)
    out: list[Tracker] = []
    for item in trackers:
        if isinstance(item, Tracker):
            tracker = item
        elif isinstance(item, str) and item.lower() in TRACKERS:
            kind = TRACKERS[item.lower()]
            tracker = kind(**tensorboard_options) if kind is TensorBoardTracker else kind()
        else:
            raise UnknownTrackerError(item, tuple(TRACKERS))
        tracker.check_installed()
        out.append(tracker)
    return out
