"""``keras.Variable`` under a strategy: TF's ``aggregation`` and ``synchronization`` for the variables a step names.

Under TF, a ``keras.Variable`` made in ``strategy.scope()`` is a MirroredVariable or a
SyncOnReadVariable. Here, a Keras variable that the function given to ``strategy.run`` names
(module globals or closure cells, two calls deep, as :mod:`phalanx.keras.metrics` finds metrics)
joins the strategy before that step, once:

* its value is broadcast from replica 0, and a trainable one has its gradients summed across
  replicas like a parameter created in scope (sync-on-read ones are only broadcast: their
  replicas' values differ by design);
* the instance (never the class) is adapted so that ``assign``, ``assign_add`` and ``assign_sub``
  follow :mod:`phalanx.core.distributed_variable`'s rules by the variable's ``aggregation``
  (``'sum'``, ``'mean'``, ``'only_first_replica'``, ``'none'``) and ``synchronization``
  (``'on_read'``: reading ``value``, ``numpy()`` or ``float()`` in cross-replica context combines
  the replicas' values, a collective; checkpoints save that value and restore it as TF does).

Keras' own variables are left alone: a model's weights, an optimizer's slots and step counter and
a metric's state (kept per replica and combined by ``result()``, :mod:`phalanx.keras.metrics`) are
reached through their objects, not named by the step. Gradients are already summed, so an update a
Keras optimizer makes (``optimizer.apply``) is applied as it is on every replica, with no collective
of its own, as TF's optimizer applies it in cross-replica context.

Example::

    with strategy.scope():
        seen = keras.Variable(0.0, aggregation="sum", trainable=False)
    def step(x):
        seen.assign_add(torch.tensor(float(len(x))))    # every replica's examples
    for x in dist_dataset:
        strategy.run(step, args=(x,))
    float(seen.value)                                   # the global count, on every replica
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import keras
import torch

from phalanx.core.distributed_variable import (
    AggregationError,
    VariableAggregation,
    VariableSynchronization,
    aggregate_update,
    combine_across_replicas,
    in_replica_context_of,
    on_read_cross_replica_operand,
)
from phalanx.core.named_objects import objects_used_by

if TYPE_CHECKING:
    from phalanx.core.strategy import Strategy

_FOUND: weakref.WeakKeyDictionary[Any, tuple] = weakref.WeakKeyDictionary()
_ADAPTED: dict[type, type] = {}


def observe_run(strategy: Strategy, fn: Callable[..., Any]) -> None:
    """Joins the Keras variables ``fn`` names to ``strategy`` (called by ``strategy.run`` before each step).

    What ``fn`` names is found once per function; a later step only checks that each variable joined.
    """
    if strategy.num_replicas_in_sync == 1:
        return
    try:
        cached = _FOUND.get(fn)
    except TypeError:  # not weak-referenceable
        cached = None
    if cached is None:
        cached = tuple(objects_used_by(fn, keras.Variable))
        try:
            _FOUND[fn] = cached
        except TypeError:
            pass
    for variable in cached:
        if not isinstance(variable, _Aggregated) and not strategy.extended.variable_created_in_scope(variable):
            join(variable, strategy)


def join(variable: Any, strategy: Strategy) -> Any:
    """Synchronises ``variable`` under ``strategy`` and adapts its updates and reads (module docstring).

    Collective: every replica joins the same variables at the same point (before the same step).
    """
    if isinstance(variable, _Aggregated):
        return variable
    aggregation = VariableAggregation.from_any(variable.aggregation)
    synchronization = VariableSynchronization.from_any(getattr(variable, "synchronization", "auto"))  # Keras 3.7+
    on_read = synchronization is VariableSynchronization.ON_READ
    ext = strategy.extended
    stored = variable.value
    if on_read:
        ext.broadcast([stored.data], 0)
    else:
        ext.adopt_variables([stored])
    base = type(variable)
    adapted = _ADAPTED.get(base)
    if adapted is None:
        # The instance's class becomes a subclass of its own made here: Keras' class is untouched.
        adapted = _ADAPTED[base] = type(base.__name__, (_Aggregated, base), {"__module__": base.__module__})
    variable.__class__ = adapted
    variable._phalanx_state = (weakref.ref(strategy), aggregation, on_read)
    return variable


def _by_keras_optimizer(frame: Any) -> bool:
    # Keras' optimizers update with gradients that phalanx has already summed: every replica
    # applies the same update, as TF's optimizer does in cross-replica context.
    caller = frame.f_back if frame is not None else None
    name = caller.f_globals.get("__name__", "") if caller is not None else ""
    return name.startswith("keras.") and ".optimizers" in name


class _Aggregated:
    """The adaptation of one Keras variable (see :func:`join`)."""

    _phalanx_state: tuple

    @property
    def value(self) -> Any:
        local = super().value  # type: ignore[misc]
        ref, aggregation, on_read = self._phalanx_state
        strategy = ref()
        if not on_read or strategy is None or strategy.num_replicas_in_sync == 1 or in_replica_context_of(strategy):
            return local
        return combine_across_replicas(strategy.extended, aggregation, local.detach().clone(), name=self.name)

    def assign(self, value: Any) -> Any:
        return self._phalanx_update("assign", value, _by_keras_optimizer(inspect.currentframe()))

    def assign_add(self, value: Any) -> Any:
        return self._phalanx_update("assign_add", value, _by_keras_optimizer(inspect.currentframe()))

    def assign_sub(self, value: Any) -> Any:
        return self._phalanx_update("assign_sub", value, _by_keras_optimizer(inspect.currentframe()))

    def _phalanx_update(self, kind: str, value: Any, by_optimizer: bool) -> Any:
        stored = super().value  # type: ignore[misc]
        t = keras.ops.convert_to_tensor(value, dtype=self.dtype).to(device=stored.device, dtype=stored.dtype)
        if tuple(t.shape) != tuple(stored.shape):
            raise AggregationError(
                f"Cannot update variable {self.name!r} of shape {tuple(stored.shape)} with a value of shape "
                f"{tuple(t.shape)}.",
                variable=self.name,
                hint="give a value of the variable's shape",
            )
        ref, aggregation, on_read = self._phalanx_state
        strategy = ref()
        old = None
        if strategy is not None and strategy.num_replicas_in_sync > 1 and not by_optimizer:
            if not in_replica_context_of(strategy):
                if on_read:
                    t = on_read_cross_replica_operand(kind, aggregation, t, strategy, name=self.name)
            elif not on_read:
                # Read before the collective: see phalanx.Variable's replica-context update.
                old = None if kind == "assign" else stored.detach().clone()
                python_value = value if isinstance(value, (int, float)) else None
                t = aggregate_update(strategy.extended, aggregation, t, python_value=python_value, name=self.name)
        base = stored.detach() if old is None else old
        with torch.no_grad():
            if kind == "assign":
                stored.copy_(t)
            else:
                stored.copy_(base + t if kind == "assign_add" else base - t)
        return stored
