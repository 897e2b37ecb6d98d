"""The one place where a Keras model object is adapted to a strategy (instance level only).

Keras 3 has no distribution hook for its torch backend, so phalanx adapts the *model objects*
created under ``strategy.scope()``, and nothing else: no Keras or torch class is changed.

How a model is found. Keras-on-torch layers are ``torch.nn.Module`` s. ``phalanx.keras`` joins the
core's scope-enter hooks (:func:`phalanx.core.extension_points.register_scope_enter_hook`); from the first
scope on, torch's module-registration hook (a public torch extension point) reports every Keras
``Model`` that registers a sub-module: a model built in scope registers its parameter dict, a
subclassed model its layers. Each such model gets a :class:`~phalanx.keras.adapter.DistributedModel`
attached (:func:`adapter_for`: :class:`~phalanx.keras.sync_adapter.SyncAdapter`, or the
parameter-server strategy's :class:`~phalanx.keras.adapter.PsAdapter`). The pieces live beside
this module: the base adapter (``adapter.py``), the synchronous one (``sync_adapter.py``), a
step's batch (``batches.py``) and the optimizer's ``apply`` (``optimizer_adapter.py``).

What the adaptation is, on that instance only:

* ``fit`` / ``evaluate`` / ``predict`` are wrapped: the chief keeps the progress bar and the
  writing callbacks, a :class:`~phalanx.keras.callbacks.Coordinator` is appended (stopping,
  shuffling and restored state agreed across replicas), then the model's own method runs
  unchanged.
* ``train_function`` / ``test_function`` / ``predict_function``, the attributes Keras' trainer
  calls each step (and re-creates only when they are None), are wrapped around the functions
  Keras makes. Each step receives the *global* batch Keras sliced from the input; the wrapper
  gives this replica its part (``torch.tensor_split`` bounds, as ``experimental_distribute_dataset``
  does) and runs Keras' step inside ``strategy.run``.
* The model's optimizer gets an ``apply`` that behaves as TF's ``apply_gradients`` in replica
  context (:func:`~phalanx.keras.optimizer_adapter.adapt_optimizer`): gradients it is given that no
  ``backward()`` summed (``torch.autograd.grad``, hand-made) are summed across replicas first; and
  on a replica left without gradients because its strategy reduced them to the chief
  (CentralStorageStrategy: the chief alone updates the one copy of the variables) it skips the
  update instead of raising, and counts the step. So does a Keras optimizer a custom training loop
  uses in ``strategy.run`` (found as metrics are, by the names the step function uses:
  :func:`~phalanx.keras.optimizer_adapter.optimizers_used_by`); its slot variables then exist on the chief
  only under CentralStorage, next to the one copy of the variables, as a torch optimizer's state
  does.

Semantics (tf.keras under tf.distribute):

* Gradients. Keras' loss is the mean over the replica's ``b`` examples (plus regularisation).
  phalanx sums gradients across replicas, so each replica's gradient is scaled by ``b / B`` (by
  the strategy's gradient synchronisation, one multiplication per bucket, or a tensor hook on a
  parameter it does not sum itself): the sum is the gradient of the mean over the global batch
  ``B`` plus the regularisation once, exactly one-device training on the global batch.
* Metrics (and the loss tracker) keep additive state (totals, counts, confusion matrices). Each
  step every replica's contribution is all-reduced and added to the state, so the progress bar,
  ``History`` and ``evaluate`` report the global values, the same on every replica.
* Non-trainable state a step updates (BatchNormalization's moving statistics) is averaged,
  weighted by each replica's share of the batch, so replicas stay identical.
* ``predict`` gathers every replica's outputs in replica order: each input row once, in order.
* ``save`` / ``save_weights`` / ``export`` write once: the chief writes, and every replica
  returns when the file is complete (a failed write raises on every replica). A replica given
  another path than the chief's (TF's multi-worker tutorial saves non-chief copies to temporary
  paths) writes its own. Every replica must call them, as every replica runs the program.
* A final batch smaller than the number of replicas leaves some replicas without rows. They run
  the step on a stand-in row with weight 0 (no gradient, no metric contribution), so every
  replica takes part in every collective and nothing hangs.
* Variables created lazily, outside the scope (a subclassed model is built by its first
  ``fit``), are broadcast from the chief and given gradient synchronisation at the first step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import keras
import torch

from phalanx import hooks
from phalanx.core import context
from phalanx.core.extension_points import register_device_context, register_scope_enter_hook
from phalanx.errors import StrategyScopeError
from phalanx.keras.adapter import DistributedModel, PsAdapter, _replica_device
from phalanx.keras.discovery import distributed_model
from phalanx.keras.sync_adapter import SyncAdapter

if TYPE_CHECKING:
    from phalanx.core.strategy import Strategy

__all__ = [
    "DistributedModel",
    "PsAdapter",
    "SyncAdapter",
    "adapter_for",
    "distribute",
    "distributed_model",
]


def distribute(model: Any, strategy: "Strategy | None" = None) -> Any:
    """Makes ``model.fit`` / ``evaluate`` / ``predict`` run under ``strategy``.

    Models that register layers or variables inside ``strategy.scope()`` are adapted
    automatically; call this for one that does not (e.g. a ``Sequential`` without an input
    shape, whose layers are only built by ``fit``). Idempotent.

    Args:
        model: a Keras 3 model (torch backend).
        strategy: default: the current strategy (call it inside ``strategy.scope()``).

    Returns:
        ``model`` itself.

    Raises:
        TypeError: ``model`` is not a Keras model.
        StrategyScopeError: no strategy is given or current, or the model already belongs to
            another strategy.

    Example::

        with strategy.scope():
            model = keras.Sequential([keras.layers.Dense(16), keras.layers.Dense(1)])  # no input shape
            phalanx.keras.distribute(model)
            model.compile(optimizer="sgd", loss="mse")
        model.fit(x, y, batch_size=64)
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"phalanx.keras.distribute needs a keras.Model; received {type(model).__name__}")
    if strategy is None:
        if not context.has_strategy():
            raise StrategyScopeError(
                "phalanx.keras.distribute(model) was called outside any strategy scope.",
                hint="pass the strategy, or call it inside `with strategy.scope():`",
            )
        strategy = context.get_strategy()
    existing = distributed_model(model)
    if existing is not None:
        if existing.strategy is not strategy:
            raise StrategyScopeError(
                f"The Keras model {model.name!r} already belongs to {existing.strategy!r}; "
                f"it cannot also be distributed by {strategy!r}.",
                hint="create the model again inside the new strategy's scope",
            )
        return model
    adapter_for(model, strategy)
    return model


def _on_module_registered(module: torch.nn.Module, name: str, submodule: torch.nn.Module | None) -> None:
    if not (isinstance(module, keras.Model) and context.has_strategy() and context.in_cross_replica_context()):
        return
    strategy = context.get_strategy()
    adapted = distributed_model(module) or adapter_for(module, strategy)
    if submodule is not None and adapted.strategy is strategy:
        # Registered in this scope, these parameters were captured (and will be synchronised)
        # by the strategy itself; the first step need not broadcast them again.
        adapted._mark_synced(submodule.parameters())


def _on_scope_enter(strategy: "Strategy") -> None:
    """Scope-enter hook: model discovery needs the module-registration hook from the first scope on."""
    hooks.install("phalanx.keras.model.discovery", "module_module_registration", _on_module_registered)


# The core calls this at every scope entry; it imports this package only by name, when Keras is
# loaded (phalanx.core.integrations). Imported inside an open scope (Keras imported there), it joins now.
register_scope_enter_hook(_on_scope_enter)
register_device_context(_replica_device)
if context.has_strategy():
    _on_scope_enter(context.get_strategy())


def adapter_for(model: Any, strategy: "Strategy") -> "DistributedModel":
    """Adapts ``model`` to ``strategy``: chosen once, by the kind of training the strategy does."""
    if strategy.extended.is_asynchronous:
        return PsAdapter(model, strategy)
    return SyncAdapter(model, strategy)
