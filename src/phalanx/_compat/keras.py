"""Keras' private APIs phalanx relies on, each behind one function.

Checked on Keras 3.6 to 3.15 (the range :mod:`phalanx.keras._version` accepts; CI runs the newest);
``tests/test_compat.py`` exercises every shim against the installed Keras.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "count_optimizer_step",
    "current_device",
    "direct_sublayers",
    "initial_epoch",
    "is_uninitialized",
    "learning_rate",
    "set_initial_epoch",
    "set_initializer",
]


def learning_rate(optimizer: Any) -> Any:
    """The optimizer's learning rate as Keras stores it: a float variable, a schedule or a callable.

    ``optimizer._learning_rate`` (Keras 3.0 to 3.15): the public ``learning_rate`` property
    evaluates a schedule at the current step, and phalanx needs the schedule itself.
    """
    return optimizer._learning_rate


def count_optimizer_step(optimizer: Any) -> None:
    """Counts one ``optimizer.apply`` call without applying anything, as ``apply`` itself counts it.

    ``optimizer._iterations`` (Keras 3.0 to 3.15) counts every ``apply`` call; the public
    ``iterations`` is the same variable, except with ``gradient_accumulation_steps`` set, where it
    is a tensor, the number of updates made (``_iterations // gradient_accumulation_steps``).
    """
    getattr(optimizer, "_iterations", optimizer.iterations).assign_add(1)


def initial_epoch(model: Any) -> int | None:
    """The epoch ``fit`` resumes from, as ``BackupAndRestore`` set it (``model._initial_epoch``, Keras 3.0 to 3.15)."""
    return getattr(model, "_initial_epoch", None)


def set_initial_epoch(model: Any, epoch: int | None) -> None:
    """Sets the epoch ``fit`` resumes from (``model._initial_epoch``; how ``BackupAndRestore`` does it)."""
    model._initial_epoch = epoch


# Checkpoints (phalanx.checkpoint.keras_objects) walk Keras' object graph and restore into
# variables Keras creates later.
def direct_sublayers(layer: Any) -> list[Any] | None:
    """The layers ``layer`` tracks directly, in tracking order, or None if it tracks none this way.

    ``layer._flatten_layers(include_self=False, recursive=False)`` (Keras 3.0 to 3.15): the public
    ``layers`` property exists on models only.
    """
    flatten = getattr(layer, "_flatten_layers", None)
    return list(flatten(include_self=False, recursive=False)) if callable(flatten) else None


def is_uninitialized(variable: Any) -> bool:
    """Whether Keras created ``variable`` without a value (inside a ``StatelessScope``) to give it later.

    ``variable._value is None`` with a ``variable._initializer`` (Keras 3.0 to 3.15): such a
    variable is initialized from its initializer when the scope ends, and an assignment made
    inside the scope is discarded.
    """
    return getattr(variable, "_value", 0) is None and callable(getattr(variable, "_initializer", None))


def set_initializer(variable: Any, initializer: Any) -> None:
    """Replaces the initializer an uninitialized variable will be given its value from (``_initializer``)."""
    variable._initializer = initializer


def current_device() -> Any:
    """The device Keras (torch backend) puts new tensors on now: its default (the GPU whenever
    one exists) or the innermost ``keras.device`` scope's.

    ``keras.src.backend.torch.core.get_device`` (Keras 3.0 to 3.15); Keras has no public getter.
    """
    from keras.src.backend.torch.core import get_device

    return get_device()
