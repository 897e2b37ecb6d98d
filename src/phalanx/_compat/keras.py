"""Keras' private APIs phalanx relies on, each behind one function.

Checked on Keras 3.6 to 3.15 (the range :mod:`phalanx.keras._version` accepts; CI runs the newest);
``tests/test_compat.py`` exercises every shim against the installed Keras.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "StoredElsewhere",
    "count_optimizer_step",
    "current_device",
    "direct_sublayers",
    "initial_epoch",
    "is_uninitialized",
    "learning_rate",
    "optimizer_variables",
    "set_initial_epoch",
    "set_initializer",
    "store_elsewhere",
    "stored_value",
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


def optimizer_variables(optimizer: Any) -> list[Any]:
    """The trainable variables ``optimizer.apply(grads)`` updates when given none (``[]`` before it is built).

    ``optimizer._trainable_variables`` (Keras 3.0 to 3.15): what ``apply`` falls back to; Keras has
    no public name for it.
    """
    return list(getattr(optimizer, "_trainable_variables", None) or [])


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


# FullyShardedStrategy (phalanx.keras.sharding) keeps a Keras variable's tensor in the module
# parameter torch's FSDP2 swaps, not in the variable.
def stored_value(variable: Any) -> Any:
    """The tensor a Keras variable stores (``variable._value``, Keras 3.0 to 3.15): ``value`` without
    autocasting."""
    return variable._value


class StoredElsewhere:
    """A mixin for a Keras variable's class: the variable holds no tensor of its own, its stored
    tensor (``_value``, which ``value``, ``numpy`` and ``trainable`` read, Keras 3.0 to 3.15) is
    whatever ``read()`` returns now, and an assignment (``_direct_assign``, which ``assign`` ends
    in) is ``write(value)``. Set with :func:`store_elsewhere`.
    """

    @property
    def _value(self) -> Any:
        return self.__dict__["_phalanx_storage"][0]()

    @_value.setter
    def _value(self, value: Any) -> None:
        raise AttributeError(f"{self.path}'s tensor is kept by its model, which replaced it")  # type: ignore[attr-defined]

    def _direct_assign(self, value: Any) -> None:
        self.__dict__["_phalanx_storage"][1](value)


def store_elsewhere(variable: Any, read: Any, write: Any) -> None:
    """Makes ``variable`` (an instance of a :class:`StoredElsewhere` subclass) read its stored tensor
    through ``read()`` and assign through ``write(value)``, and drops the tensor it held."""
    variable.__dict__["_phalanx_storage"] = (read, write)
    variable.__dict__.pop("_value", None)
