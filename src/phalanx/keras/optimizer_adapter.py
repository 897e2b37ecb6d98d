"""A Keras optimizer under a strategy: TF's ``apply_gradients`` in replica context.

:func:`adapt_optimizer` gives one optimizer instance an ``apply`` that sums across replicas the
gradients no ``backward()`` summed (``torch.autograd.grad``, hand-made), and that skips the update
on a replica its strategy left without gradients (CentralStorageStrategy: the chief alone updates
the one copy of the variables). A custom training loop's optimizers are found by the names its
step function uses (:func:`optimizers_used_by`), through the core's run observers.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import TYPE_CHECKING, Any, Callable

import keras
import torch

from phalanx._compat.keras import count_optimizer_step, optimizer_variables
from phalanx._sidetable import IdentityTable
from phalanx.core import context
from phalanx.core.extension_points import RUN_ARGUMENT_OBSERVERS, RUN_OBSERVERS
from phalanx.keras import sharding
from phalanx.values import ReduceOp

if TYPE_CHECKING:
    pass


_ORIGINAL_APPLY: IdentityTable[Callable[..., Any]] = IdentityTable()  # optimizer -> its own apply


def _update_is_the_chiefs(strategy: Any) -> bool:
    """Whether ``strategy`` sends this replica's gradients to the chief, which alone updates."""
    ext = strategy.extended
    return bool(getattr(ext, "updates_on_chief_only", False)) and ext.process_index != 0


def _sums_in_apply(strategy: Any) -> bool:
    """Whether a Keras optimizer's ``apply`` called now must sum the gradients it is given (TF's
    ``apply_gradients`` in replica context): inside ``run`` of a synchronous strategy of several
    replicas that does not shard the model (sharded gradients are reduce-scattered by FSDP)."""
    return (
        strategy.num_replicas_in_sync > 1
        and not strategy.extended.is_asynchronous
        and context.get_replica_context() is not None
        and not sharding.shards_models(strategy)
    )


def _sum_unsummed(strategy: Any, grads: list[Any], variables: list[Any]) -> list[Any]:
    """Sums across replicas the gradients whose variable has no ``.grad``: those ``backward()`` did
    not produce (``torch.autograd.grad``, or made by hand). A gradient ``backward()`` produced was
    summed by the strategy already (the variable's ``.grad`` holds the sum), and so was anything
    derived from it in this step (clipped, scaled): summing those again would count them twice.
    Every replica takes the same decision (after ``backward()`` the replicas' ``.grad`` are set or
    unset alike), so the collective meets on every replica."""
    picked = [
        i
        for i, (g, v) in enumerate(zip(grads, variables))
        if g is not None and getattr(getattr(v, "value", v), "grad", None) is None
    ]
    if not picked:
        return grads
    summed = strategy.extended.all_reduce([torch.as_tensor(grads[i]) for i in picked], ReduceOp.SUM)
    out = list(grads)
    for i, value in zip(picked, summed):
        out[i] = value
    return out


def adapt_optimizer(optimizer: Any) -> None:
    """Gives a Keras optimizer TF's ``apply_gradients`` under a synchronous strategy of several replicas.

    * **Gradients are summed across replicas**, as TF's ``apply_gradients`` all-reduces the
      gradients it is given in replica context: a gradient computed with ``torch.autograd.grad``
      (TF's ``tape.gradient``) or made by hand is summed before the update (:func:`_sum_unsummed`);
      one ``backward()`` produced is summed already.
    * **Only the chief updates** where the strategy keeps one copy of the variables
      (CentralStorageStrategy): the chief alone receives the summed gradients and updates that
      copy; another replica skips the update and only counts the step, so ``optimizer.iterations``
      reads the same everywhere (Keras' own ``apply`` would raise on its missing gradients).

    Idempotent; on any other strategy (or none) ``apply`` is Keras' own.
    """
    if optimizer is None or optimizer in _ORIGINAL_APPLY:
        return
    original = optimizer.apply

    def apply(grads: Any, trainable_variables: Any = None) -> Any:
        grads = list(grads)
        strategy = context.get_strategy()
        if _sums_in_apply(strategy):
            variables = list(trainable_variables) if trainable_variables is not None else None
            grads = _sum_unsummed(strategy, grads, optimizer_variables(optimizer) if variables is None else variables)
            trainable_variables = variables
        if _update_is_the_chiefs(strategy) and (
            context.get_replica_context() is not None or all(g is None for g in grads)
        ):
            count_optimizer_step(optimizer)  # the chief's accumulates (gradient_accumulation_steps) and updates
            return None
        return original(grads, trainable_variables)

    _ORIGINAL_APPLY[optimizer] = original
    # object.__setattr__: an instance attribute (apply_gradients calls self.apply), no tracking.
    object.__setattr__(optimizer, "apply", functools.update_wrapper(apply, original))


_SEARCH_DEPTH = 2  # functions called by name from the step function, followed this deep (as for metrics)
_MAX_ITEMS = 64  # a dict, list or tuple the step function names is searched when no longer than this


def optimizers_used_by(fn: Callable[..., Any]) -> list[Any]:
    """The Keras optimizers ``fn`` names: globals, closure cells, a bound method's own attributes.

    Functions it names are followed two calls deep; a Keras model it names contributes its
    compiled optimizer. How TF's tutorials and most custom loops reach their optimizer.
    """
    found: dict[int, Any] = {}
    seen: set[int] = set()

    def consider(value: Any, depth: int) -> None:
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
        if len(items) > _MAX_ITEMS:
            return  # data (a list of losses, say), not where a program keeps its optimizers
        for item in items:
            if isinstance(item, keras.Model):
                item = getattr(item, "optimizer", None)
            if isinstance(item, keras.optimizers.Optimizer):
                found.setdefault(id(item), item)
            elif depth > 0 and (inspect.isfunction(item) or inspect.ismethod(item)):
                visit(item, depth - 1)

    def visit(f: Any, depth: int) -> None:
        owner = getattr(f, "__self__", None)
        f = getattr(f, "__func__", f)
        code = getattr(f, "__code__", None)
        if code is None or id(f) in seen:
            return
        seen.add(id(f))
        names = code.co_names
        namespace = getattr(f, "__globals__", {})
        values = [namespace[n] for n in names if n in namespace]
        for cell in f.__closure__ or ():
            try:
                values.append(cell.cell_contents)
            except ValueError:  # a cell not filled yet
                pass
        own = getattr(owner, "__dict__", None)
        if isinstance(own, dict) and not inspect.ismodule(owner):  # self.optimizer in a trainer's method
            values += [own[n] for n in names if n in own]
        for value in values:
            consider(value, depth)

    visit(fn, _SEARCH_DEPTH)
    return list(found.values())


_SEARCHED: "weakref.WeakSet[Any]" = weakref.WeakSet()  # step functions whose optimizers were adapted
_OWN_STEPS: "weakref.WeakSet[Any]" = weakref.WeakSet()  # fit's own replica functions: adapted in _prepare


def _observe_run(strategy: Any, fn: Callable[..., Any]) -> None:
    """Run observer: adapts the Keras optimizers ``fn`` uses under a synchronous strategy of several
    replicas (:func:`adapt_optimizer`), and where the strategy shards Keras models (their slots are
    cut to the shards)."""
    if strategy.num_replicas_in_sync == 1 or strategy.extended.is_asynchronous or fn in _OWN_STEPS:
        return
    chief_only = getattr(strategy.extended, "updates_on_chief_only", False)
    shards = sharding.shards_models(strategy)
    if not (chief_only or shards):
        # Once per step function (a custom loop gives run the same one every step).
        try:
            if fn in _SEARCHED:
                return
            _SEARCHED.add(fn)
        except TypeError:  # not weak-referenceable: searched every time
            pass
    # Otherwise searched at every run (a few microseconds): a global may be rebound to a new optimizer.
    for optimizer in optimizers_used_by(fn):
        if shards:
            sharding.adapt_optimizer(optimizer)
        else:
            adapt_optimizer(optimizer)


def _observe_arguments(strategy: Any, args: tuple, kwargs: dict) -> None:
    """Run argument observer: adapts a Keras optimizer given to the step function (directly, in a
    list, tuple or dict, or as a compiled model's), as :func:`_observe_run` adapts one it names."""
    if strategy.num_replicas_in_sync == 1 or strategy.extended.is_asynchronous:
        return
    shards = None
    for value in (*args, *kwargs.values()):
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
        if len(items) > _MAX_ITEMS:
            continue
        for item in items:
            if isinstance(item, keras.Model):
                item = getattr(item, "optimizer", None)
            if isinstance(item, keras.optimizers.Optimizer):
                shards = sharding.shards_models(strategy) if shards is None else shards
                if shards:
                    sharding.adapt_optimizer(item)
                else:
                    adapt_optimizer(item)


def held_optimizers(model: Any) -> list[Any]:
    """The Keras optimizers ``model`` holds: its compiled one, and those in its attributes (directly,
    or in a list, tuple or dict)."""
    found: dict[int, Any] = {}
    compiled = getattr(model, "optimizer", None)
    if compiled is not None:
        found[id(compiled)] = compiled
    for value in vars(model).values():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
        if len(items) > _MAX_ITEMS:
            continue
        for item in items:
            if isinstance(item, keras.optimizers.Optimizer):
                found.setdefault(id(item), item)
    return list(found.values())


if _observe_run not in RUN_OBSERVERS:
    RUN_OBSERVERS.append(_observe_run)
if _observe_arguments not in RUN_ARGUMENT_OBSERVERS:
    RUN_ARGUMENT_OBSERVERS.append(_observe_arguments)
