"""Keras' private APIs phalanx relies on, each behind one function.

Checked on Keras 3.6 to 3.15 (the range :mod:`phalanx.keras._version` accepts; CI runs the newest);
``tests/test_compat.py`` exercises every shim against the installed Keras.
"""

from __future__ import annotations

from typing import Any

__all__ = ["initial_epoch", "learning_rate", "set_initial_epoch"]


def learning_rate(optimizer: Any) -> Any:
    """The optimizer's learning rate as Keras stores it: a float variable, a schedule or a callable.

    ``optimizer._learning_rate`` (Keras 3.0 to 3.15): the public ``learning_rate`` property
    evaluates a schedule at the current step, and phalanx needs the schedule itself.
    """
    return optimizer._learning_rate


def initial_epoch(model: Any) -> int | None:
    """The epoch ``fit`` resumes from, as ``BackupAndRestore`` set it (``model._initial_epoch``, Keras 3.0 to 3.15)."""
    return getattr(model, "_initial_epoch", None)


def set_initial_epoch(model: Any, epoch: int | None) -> None:
    """Sets the epoch ``fit`` resumes from (``model._initial_epoch``; how ``BackupAndRestore`` does it)."""
    model._initial_epoch = epoch
