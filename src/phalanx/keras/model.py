"""The one place where a Keras model object is adapted to a strategy (instance level only).

Keras 3 has no distribution hook for its torch backend, so phalanx adapts the *model objects*
created under ``strategy.scope()``, and nothing else: no Keras or torch class is changed.

How a model is found. Keras-on-torch layers are ``torch.nn.Module`` s. ``phalanx.keras`` joins the
core's scope-enter hooks (:func:`phalanx.core.strategy.register_scope_enter_hook`); from the first
scope on, torch's module-registration hook (a public torch extension point) reports every Keras
``Model`` that registers a sub-module: a model built in scope registers its parameter dict, a
subclassed model its layers. Each such model gets :class:`DistributedModel` attached.

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
  context (:func:`adapt_optimizer`): gradients it is given that no ``backward()`` summed
  (``torch.autograd.grad``, hand-made) are summed across replicas first; and on a replica left
  without gradients because its strategy reduced them to the chief (CentralStorageStrategy: the
  chief alone updates the one copy of the variables) it skips the update instead of raising, and
  counts the step. So does a Keras optimizer a custom training loop uses in ``strategy.run``
  (found as metrics are, by the names the step function uses: :func:`optimizers_used_by`); its
  slot variables then exist on the chief only under CentralStorage, next to the one copy of the
  variables, as a torch optimizer's state does.

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

import contextlib
import functools
import hashlib
import inspect
import sys
import weakref
from typing import TYPE_CHECKING, Any, Callable

import keras
import numpy as np
import torch

from phalanx import hooks, nest
from phalanx._compat.keras import count_optimizer_step, optimizer_variables
from phalanx._compat.keras import current_device as keras_device
from phalanx._compat.torch import version_counter
from phalanx._sidetable import IdentityTable
from phalanx.core import context
from phalanx.core.losses import mark_loss_scaled
from phalanx.core.strategy import (
    RUN_ARGUMENT_OBSERVERS,
    RUN_OBSERVERS,
    register_device_context,
    register_scope_enter_hook,
)
from phalanx.errors import InputMismatchError, StrategyScopeError, UnsupportedLayerError, WriteError
from phalanx.input import global_batch
from phalanx.input.distributed_dataset import slice_bounds
from phalanx.keras import callbacks as px_callbacks
from phalanx.keras import discovery, sharding
from phalanx.keras.discovery import distributed_model
from phalanx.values import ReduceOp, local_results

if TYPE_CHECKING:
    from phalanx.core.strategy import Strategy

_KINDS = ("train", "test", "predict")
_WRITERS = ("save", "save_weights", "export")


class _GradScale:
    """A gradient hook: multiplies by this replica's share of the batch during a training step.

    One per strategy, shared by all its models, and registered once per parameter, so that a
    layer shared by two models is scaled once.
    """

    def __init__(self) -> None:
        self.value = 1.0

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        value = self.value
        return grad if value == 1.0 else grad * value


_GRAD_SCALES: "weakref.WeakKeyDictionary[Any, _GradScale]" = weakref.WeakKeyDictionary()
# Side tables (phalanx._sidetable), instead of attributes on Keras' and torch's objects:
_RAW_STEP: IdentityTable[Callable[[Any], Any]] = IdentityTable()  # wrapped step function -> Keras' own
_ORIGINAL_APPLY: IdentityTable[Callable[..., Any]] = IdentityTable()  # optimizer -> its own apply
_SCALED: IdentityTable[_GradScale] = IdentityTable()  # parameter -> the scale hook registered on it


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


def _replica_device(strategy: "Strategy") -> Any:
    """Keras' device scope for the replica's device, where Keras would put its tensors elsewhere.

    On the torch backend Keras makes every tensor (variables, the batches it converts, metric
    state) on its default device: the GPU whenever one exists, also for CPU replicas (a notebook
    testing MirroredStrategy(["cpu:0", "cpu:1"]) after using its GPU got GPU metrics beside CPU
    weights). TF places a replica's ops on the replica's device; the core enters this around
    ``scope()`` and every ``run`` (None, at once, where Keras already uses that device).
    """
    wanted = strategy.extended.device
    if wanted.type == "cuda" and wanted.index is None:
        wanted = torch.device("cuda", torch.cuda.current_device())
    current = torch.device(keras_device())
    if current.type == "cuda" and current.index is None:
        current = torch.device("cuda", torch.cuda.current_device())
    return None if current == wanted else keras.device(str(wanted))


# The core calls this at every scope entry; it imports this package only by name, when Keras is
# loaded (phalanx.core.integrations). Imported inside an open scope (Keras imported there), it joins now.
register_scope_enter_hook(_on_scope_enter)
register_device_context(_replica_device)
if context.has_strategy():
    _on_scope_enter(context.get_strategy())


# ---------------------------------------------------------------------------------- optimizers
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


if _observe_run not in RUN_OBSERVERS:
    RUN_OBSERVERS.append(_observe_run)
if _observe_arguments not in RUN_ARGUMENT_OBSERVERS:
    RUN_ARGUMENT_OBSERVERS.append(_observe_arguments)


# ---------------------------------------------------------------------------------- batches
def _batch_size(batch: Any) -> int:
    for leaf in nest.flatten(batch):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) > 0:
            return int(shape[0])
    raise ValueError(f"A Keras batch must contain an array with a batch dimension; received {batch!r:.200}")


def _rows(batch: Any, start: int, end: int) -> Any:
    def cut(leaf: Any) -> Any:
        shape = getattr(leaf, "shape", None)
        return leaf[start:end] if shape is not None and len(shape) > 0 else leaf

    return nest.map_structure(cut, batch)


def _is_float(variable: Any) -> bool:
    return "float" in str(variable.dtype)


class _Step:
    """This replica's part of one global batch."""

    def __init__(self, batch: Any, num_replicas: int, rank: int) -> None:
        self.global_size = _batch_size(batch)
        start, end = slice_bounds(self.global_size, num_replicas, rank)
        self.empty = end <= start
        # A replica past the end of a short final batch computes on a stand-in row, weight 0.
        self.local = _rows(batch, 0, 1) if self.empty else _rows(batch, start, end)
        self.share = 0.0 if self.empty else (end - start) / self.global_size

    @classmethod
    def local(cls, batch: Any, global_size: int) -> "_Step":
        """A step on a batch that is already this replica's part of a global batch of ``global_size``."""
        step = cls.__new__(cls)
        step.global_size = global_size
        rows = _batch_size(batch)
        step.empty = rows == 0
        step.local = _stand_in(batch) if step.empty else batch
        step.share = 0.0 if step.empty else rows / global_size
        return step


def _stand_in(batch: Any) -> Any:
    """One row of zeros shaped as ``batch``'s rows: the stand-in of a replica whose part is empty."""

    def row(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.new_zeros((1, *leaf.shape[1:]))
        if isinstance(leaf, np.ndarray) and leaf.ndim > 0:
            return np.zeros((1, *leaf.shape[1:]), leaf.dtype)
        return leaf

    return nest.map_structure(row, batch)


def _is_distributed_input(value: Any) -> bool:
    from phalanx.input.distributed_dataset import DatasetFromFunction, DistributedDataset

    return isinstance(value, (DistributedDataset, DatasetFromFunction))


class _LocalBatches(torch.utils.data.IterableDataset):
    """A distributed dataset's batches for this replica, each tagged with its global batch's size.

    Each ``iter()`` starts a pass of the distributed dataset (a collective: every replica starts
    it). Keras keeps its iterator across epochs when given the number of steps and starts a new
    one after as many batches as the dataset has, which is TF's Keras's way with a distributed
    dataset: ``fit`` goes on from where the last epoch stopped.
    """

    def __init__(self, dataset: Any) -> None:
        super().__init__()
        self._dataset = dataset

    def __iter__(self) -> Any:
        for batch in self._dataset:
            info = global_batch.find((batch,), {})
            local = nest.map_structure(lambda v: local_results(v)[0], batch)
            if info is not None:
                global_batch.tag(local, info)
            yield local


class _SizedLocalBatches(_LocalBatches):
    """A :class:`_LocalBatches` of a dataset of known length (a DistributedDataset of a sized loader)."""

    def __len__(self) -> int:
        return len(self._dataset)


class _LocalLoader(torch.utils.data.DataLoader):
    """A :class:`_LocalBatches` as Keras takes it: a DataLoader of ready batches."""

    def __init__(self, batches: "_LocalBatches") -> None:
        super().__init__(batches, batch_size=None)


# ---------------------------------------------------------------------------------- the adapter
def adapter_for(model: Any, strategy: "Strategy") -> "DistributedModel":
    """Adapts ``model`` to ``strategy``: chosen once, by the kind of training the strategy does."""
    if strategy.extended.is_asynchronous:
        return PsAdapter(model, strategy)
    return SyncAdapter(model, strategy)


class DistributedModel:
    """A Keras model's fit / evaluate / predict under a strategy; see the module docstring.

    Created by the scope (or :func:`distribute`) through :func:`adapter_for`, as a
    :class:`SyncAdapter` (synchronous strategies) or a :class:`PsAdapter` (parameter servers);
    reach it with ``distributed_model(model)``.
    """

    def __init__(self, model: Any, strategy: "Strategy") -> None:
        self._model_ref = weakref.ref(model)
        self.strategy = strategy
        self._writing = False  # inside the chief's own save: nested saves are not collective
        discovery.attach(model, self)
        for method in ("fit", "evaluate", "predict"):
            wrapper = functools.update_wrapper(functools.partial(getattr(self, method)), getattr(type(model), method))
            # object.__setattr__: an instance attribute, bypassing Keras' and torch's tracking.
            object.__setattr__(model, method, wrapper)
        for method in _WRITERS:
            if hasattr(type(model), method):
                wrapper = functools.update_wrapper(
                    functools.partial(self._write_once, method), getattr(type(model), method)
                )
                object.__setattr__(model, method, wrapper)
        # Also now, in case the model is adapted by its own first fit() (a model without input
        # shape, fitted inside the scope): that fit then takes phalanx's step functions.
        self._prepare()

    # ------------------------------------------------------------------------------ properties
    @property
    def model(self) -> Any:
        model = self._model_ref()
        if model is None:
            raise ReferenceError("the Keras model was garbage-collected")
        return model

    @property
    def _ext(self) -> Any:
        return self.strategy.extended

    @property
    def _num_replicas(self) -> int:
        return self.strategy.num_replicas_in_sync

    @property
    def _rank(self) -> int:
        return self._ext.process_index

    @property
    def is_chief(self) -> bool:
        return bool(self._ext.should_checkpoint)

    # ------------------------------------------------------------------------------ public methods
    def fit(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_inference(type(self.model).evaluate, args, kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_inference(type(self.model).predict, args, kwargs)

    def _run_inference(self, method: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def _prepare(self) -> None:
        """Adapts Keras' step functions (again after ``compile`` reset them); nothing by default."""

    def _mark_synced(self, params: Any) -> None:
        """Notes parameters the strategy's scope captured (and synchronises); nothing by default."""

    def _write_once(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``model.<method>(path)`` once per path: the chief writes, and a replica that was given a
        path of its own (TF's multi-worker pattern: non-chief workers save to temporary paths) writes
        that one; every replica returns once every file is complete."""
        model = self.model
        original = getattr(type(model), method)
        if self._writing or self._num_replicas == 1 or isinstance(self, PsAdapter) or _in_chief_only_callback():
            return original(model, *args, **kwargs)
        path = str(kwargs.get("filepath", args[0] if args else ""))
        digest = int.from_bytes(hashlib.sha256(path.encode()).digest()[:7], "big")
        chiefs = torch.tensor([digest if self.is_chief else 0], dtype=torch.int64)
        self._ext.broadcast([chiefs])
        result, error = None, None
        # A sharded model's weights are gathered by every replica first (a collective), so the
        # writer reads whole values.
        with sharding.gathered(model):
            if self.is_chief or int(chiefs[0]) != digest:
                self._writing = True
                try:
                    result = original(model, *args, **kwargs)
                except Exception as e:  # noqa: BLE001 - re-raised below, after telling the others
                    error = e
                finally:
                    self._writing = False
        # Also the barrier: nobody returns before the files are complete.
        failed = self._ext.all_reduce([torch.tensor([float(error is not None)])], ReduceOp.SUM)[0]
        if error is not None:
            raise error
        if float(failed[0]) > 0:
            raise WriteError(
                f"model.{method}(...) failed on another replica; see its error (the chief's output "
                "or its replica log).",
                hint="the file may be missing or incomplete",
            )
        return result

    @staticmethod
    def _bind(method: Callable[..., Any], model: Any, args: tuple, kwargs: dict) -> tuple[Callable, dict]:
        try:
            bound = inspect.signature(method).bind(model, *args, **kwargs)
        except TypeError:
            # A custom signature phalanx cannot read: pass the call through as given.
            return (lambda _: method(model, *args, **kwargs)), dict(kwargs)
        params = inspect.signature(method).parameters

        def call(arguments: dict) -> Any:
            for name in ("callbacks", "verbose", "x", "validation_data"):
                if name in arguments and name in params:
                    bound.arguments[name] = arguments[name]
            return method(*bound.args, **bound.kwargs)

        return call, dict(bound.arguments)


class PsAdapter(DistributedModel):
    """Under ParameterServerStrategy: the chief schedules ``fit``'s steps on the workers
    (:mod:`phalanx.keras.parameter_server`); ``evaluate`` and ``predict`` run Keras' own steps
    on the chief's copy after pulling the servers' values (TF's inline evaluation)."""

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        from phalanx.keras import parameter_server

        model = self.model
        _, arguments = self._bind(type(model).fit, model, args, kwargs)
        return parameter_server.fit(self, arguments)

    def _run_inference(self, method: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        call, arguments = self._bind(method, self.model, args, kwargs)
        self._ext.pull_variables()
        return call(arguments)


class SyncAdapter(DistributedModel):
    """Under a synchronous strategy: Keras' step functions run inside ``strategy.run`` on each
    replica's slice of the global batch, with gradient scaling, metric merging, statistics
    averaging and lazy-variable synchronisation (see the module docstring)."""

    def __init__(self, model: Any, strategy: "Strategy") -> None:
        self._grad_scale = _GRAD_SCALES.setdefault(strategy, _GradScale())
        self._synced: dict[int, torch.Tensor] = {}
        self._decorrelated = False
        self._checks_left = 0
        self._stat_vars: list[Any] | None = None  # non-trainable variables a training step updates
        self._sharded = False  # FullyShardedStrategy split the model's weights
        # Per step function: whether its batches come from a distributed dataset (already this
        # replica's part of the global batch) rather than whole global batches.
        self._local_input = {kind: False for kind in _KINDS}
        self._summed_loss = False  # the compiled loss is a sum over the batch (reduction="sum")
        super().__init__(model, strategy)

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        call, arguments = self._bind(type(model).fit, model, args, kwargs)
        user = _flat_callbacks(arguments.get("callbacks"))
        if isinstance(arguments.get("callbacks"), keras.callbacks.CallbackList):
            # The caller built the list: keep it, and make sure it ends with one coordinator.
            cbl = arguments["callbacks"]
            cbl.callbacks = [cb for cb in cbl.callbacks if not isinstance(cb, px_callbacks.Coordinator)]
            coordinator = px_callbacks.Coordinator(self.strategy, cbl.callbacks)
            coordinator.set_model(model)
            cbl.callbacks.append(coordinator)
        else:
            arguments["callbacks"] = px_callbacks.for_replica(user, self.is_chief) + [
                px_callbacks.Coordinator(self.strategy, user)
            ]
        if not self.is_chief:
            arguments["verbose"] = 0
        arguments["x"] = self._local_batches(arguments.get("x"), arguments.get("steps_per_epoch"), "steps_per_epoch")
        validation = arguments.get("validation_data")
        if _is_distributed_input(validation):
            arguments["validation_data"] = self._local_batches(
                validation, arguments.get("validation_steps"), "validation_steps"
            )
        self._prepare()
        if self._sharded:
            sharding.check_callbacks(user)
        self._stat_vars = None
        with self._on_replica_device(), self._reading("train", arguments["x"]):
            return call(arguments)

    def _local_batches(self, value: Any, steps: Any, steps_name: str) -> Any:
        """A distributed dataset as ``fit`` / ``evaluate`` / ``predict`` take it (TF's Keras takes
        one): this replica's batches, each tagged with the size of its global batch; anything
        else as it is. TF's rule: the number of steps must be given, and the iterator is not
        restarted at each epoch (repeat the dataset as needed)."""
        if not _is_distributed_input(value):
            return value
        if steps is None:
            raise ValueError(
                f"When providing a distributed dataset, you must specify the number of steps to run: {steps_name} "
                f"is None for a {type(value).__name__}. Its batches are the replicas' parts of global batches, "
                "so Keras cannot count them; TF's Keras asks the same (repeat the dataset as needed)"
            )
        try:
            len(value)
        except TypeError:  # a DatasetFromFunction, or a DistributedDataset of an unsized iterable
            return _LocalLoader(_LocalBatches(value))
        return _LocalLoader(_SizedLocalBatches(value))

    @contextlib.contextmanager
    def _reading(self, kind: str, x: Any) -> Any:
        """Notes, for the duration of a call, whether the ``kind`` steps get this replica's batches."""
        before = self._local_input[kind]
        self._local_input[kind] = isinstance(x, _LocalLoader)
        try:
            yield
        finally:
            self._local_input[kind] = before

    def _on_replica_device(self) -> Any:
        """Keras' device scope for the replica's device, around fit, evaluate and predict (the
        batches Keras converts before each step, too): see :func:`_replica_device`."""
        return _replica_device(self.strategy) or contextlib.nullcontext()

    def _run_inference(self, method: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        call, arguments = self._bind(method, self.model, args, kwargs)
        passed = arguments.get("callbacks")
        if not isinstance(passed, keras.callbacks.CallbackList):  # fit's own list when validating
            if passed is not None:
                arguments["callbacks"] = px_callbacks.for_replica(_flat_callbacks(passed), self.is_chief)
            if not self.is_chief:
                arguments["verbose"] = 0
        arguments["x"] = self._local_batches(arguments.get("x"), arguments.get("steps"), "steps")
        kind = "predict" if method.__name__ == "predict" else "test"
        self._prepare()
        with self._on_replica_device(), self._reading(kind, arguments.get("x")):
            return call(arguments)

    # ------------------------------------------------------------------------------ step functions
    def _prepare(self) -> None:
        """Wraps the step functions Keras made (again after ``compile`` reset them)."""
        model = self.model
        _refuse_stateful_rnn(model, self.strategy)
        self._summed_loss = _summed_loss(model, self.strategy)
        self._checks_left = 2  # look for lazily built variables at the first two steps
        # The compiled optimizer, and any other a custom train_step uses (TF's WideDeepModel trains
        # each half with its own): every Keras optimizer the model holds as an attribute.
        optimizers = _held_optimizers(model)
        for optimizer in optimizers:
            adapt_optimizer(optimizer)
        self._sharded = any(sharding.is_sharded(v) for v in model.trainable_weights)
        if self._sharded:
            for optimizer in optimizers:
                sharding.adapt_optimizer(optimizer)
        for kind in _KINDS:
            current = getattr(model, f"{kind}_function", None)
            if current is not None and current in _RAW_STEP:
                continue
            getattr(model, f"make_{kind}_function")(force=True)
            raw = getattr(model, f"{kind}_function")
            step = getattr(self, f"_{kind}_step")
            wrapped = functools.partial(step, raw)
            _RAW_STEP[wrapped] = raw
            setattr(model, f"{kind}_function", wrapped)

    def _run_local(self, raw: Callable[[Any], Any], step: _Step, scale: float) -> Any:
        out: dict[str, Any] = {}

        def replica_fn() -> None:
            # The gradient synchronisation scales what it sums, bucket by bucket; a gradient hook
            # scales the rest (a sharded model's gathered parameters).
            self._grad_scale.value = scale
            mark_loss_scaled()
            try:
                with self._ext.gradient_sync.scaled(scale):
                    out["result"] = raw([step.local])
            finally:
                self._grad_scale.value = 1.0

        _OWN_STEPS.add(replica_fn)
        self.strategy.run(replica_fn)
        return out["result"]

    def _begin(self, data: Any, kind: str) -> _Step:
        if self._checks_left > 0:
            self._checks_left -= 1
            self._sync_new_variables()
        if self._local_input[kind]:
            # Counted by the distributed dataset that cut it (the job report's samples per second).
            return _Step.local(data[0], self._global_size_of(data[0]))
        step = _Step(data[0], self._num_replicas, self._rank)
        self._ext.stats.add_samples(step.global_size)  # the job report's samples per second
        return step

    def _global_size_of(self, batch: Any) -> int:
        """The size of the global batch this replica's ``batch`` was cut from (its tag, or the sum
        of the replicas' sizes where Keras copied the tensors)."""
        info = global_batch.find((batch,), {})
        if info is not None:
            return info.global_size
        size = torch.tensor([float(_batch_size(batch))], dtype=torch.float64)
        return round(float(self._ext.all_reduce([size], ReduceOp.SUM)[0][0]))

    def _train_step(self, raw: Callable[[Any], Any], data: Any) -> Any:
        step = self._begin(data, "train")
        model = self.model
        metric_vars = self._metric_variables()
        saved = self._zero(metric_vars)
        versions = None
        if self._stat_vars is None and self._num_replicas > 1:
            candidates = [v for v in model.non_trainable_weights if _is_float(v)]
            versions = [version_counter(v.value) for v in candidates]
        # A mean over the replica's rows is scaled by its share of the global batch; a sum over
        # them (reduction="sum") is already its part of the global sum (a stand-in row: 0).
        scale = (0.0 if step.empty else 1.0) if self._summed_loss else step.share
        logs = self._run_local(raw, step, scale)
        if versions is not None:
            changed = torch.tensor(
                [float(version_counter(v.value) != before) for v, before in zip(candidates, versions)]
            )
            changed = self._ext.all_reduce([changed], ReduceOp.SUM)[0] if len(candidates) else changed
            self._stat_vars = [v for v, c in zip(candidates, changed.tolist()) if c > 0]
        stat_vars = self._stat_vars or []
        # In float64, so that a value every replica updated alike comes back exactly.
        extra = [v.value.detach().double() * step.share for v in stat_vars]
        reduced_extra = self._merge(step, metric_vars, saved, extra)
        with torch.no_grad():
            for v, value in zip(stat_vars, reduced_extra):
                v.assign(value.to(v.value.dtype))
        return self._global_logs(logs, step)

    def _test_step(self, raw: Callable[[Any], Any], data: Any) -> Any:
        step = self._begin(data, "test")
        metric_vars = self._metric_variables()
        saved = self._zero(metric_vars)
        logs = self._run_local(raw, step, 1.0)
        if self._sharded:
            sharding.reshard(self.model)
        self._merge(step, metric_vars, saved, [])
        return self._global_logs(logs, step)

    def _predict_step(self, raw: Callable[[Any], Any], data: Any) -> Any:
        first = self._checks_left > 0
        step = self._begin(data, "predict")
        outputs = self._run_local(raw, step, 1.0)
        if first and self._num_replicas > 1 and self._has_unsynced_variables():
            # predict() does not build the model first: it was built by this very step, with each
            # replica's own initial values. Make them the chief's and compute the step again.
            self._sync_new_variables()
            outputs = self._run_local(raw, step, 1.0)
        if self._sharded:
            sharding.reshard(self.model)
        if self._num_replicas == 1:
            return outputs

        def gather(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                return t
            return self._ext.all_gather(t[:0] if step.empty else t, 0)

        return nest.map_structure(gather, outputs)

    # ------------------------------------------------------------------------------ metrics
    def _metric_variables(self) -> list[Any]:
        seen: dict[int, Any] = {}
        for metric in self.model.metrics:
            for v in metric.variables:
                seen.setdefault(id(v), v)
        return list(seen.values())

    def _loss_totals(self, metric_vars: list[Any]) -> list[int]:
        """Where the loss tracker's running total is in ``metric_vars``."""
        totals = {id(v) for m in self.model.metrics if m.name == "loss" for v in m.variables if v.name == "total"}
        return [i for i, v in enumerate(metric_vars) if id(v) in totals]

    def _zero(self, variables: list[Any]) -> list[torch.Tensor]:
        """Saves the (global) metric state and zeroes it, so the step leaves only its contribution."""
        if self._num_replicas == 1:
            return []
        saved = [v.value.detach().clone() for v in variables]
        for v in variables:
            v.assign(torch.zeros_like(v.value))
        return saved

    def _merge(
        self, step: _Step, metric_vars: list[Any], saved: list[torch.Tensor], extra: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Global metric state = saved + every replica's contribution; ``extra`` summed.

        One collective per dtype (float32 metrics, the float64 ``extra``), shared with the check
        that every replica was fed a global batch of the same size.
        """
        if self._num_replicas == 1:
            return extra
        contributions = [torch.zeros_like(v.value) if step.empty else v.value.detach().clone() for v in metric_vars]
        if self._summed_loss and not step.empty:
            # The loss tracker averages each replica's loss weighted by its rows; a summed loss is a
            # part of the global sum, so the replica's total counts 1/share times: the result is the sum.
            for i in self._loss_totals(metric_vars):
                contributions[i] = contributions[i] / step.share
        header = torch.tensor([float(step.global_size)], dtype=torch.float32)
        reduced = self._ext.all_reduce([header, *contributions, *extra], ReduceOp.SUM)
        if round(float(reduced[0][0])) != step.global_size * self._num_replicas:
            raise InputMismatchError(
                f"Replicas disagree on the size of the global batch at step {self._ext.step}: this replica "
                f"({self._ext.process_name()}) has {step.global_size}, the sum over "
                f"{self._num_replicas} replicas is {float(reduced[0][0]):g}.",
                hint="every worker must call fit/evaluate/predict with the same data and batch_size; "
                "batch_size is the global batch",
            )
        n = len(metric_vars)
        for v, base, total in zip(metric_vars, saved, reduced[1 : 1 + n]):
            v.assign(base + total.to(base.dtype))
        return list(reduced[1 + n :])

    def _global_logs(self, logs: Any, step: _Step) -> Any:
        """Replaces the step's local metric values by the global ones (the same on every replica)."""
        if self._num_replicas == 1 or not isinstance(logs, dict):
            return logs
        metric_logs = self.model.get_metrics_result()
        result = {k: metric_logs.get(k, v) for k, v in logs.items()}
        # Values a custom train_step returns that are not model metrics: average by batch share.
        custom = sorted(k for k, v in logs.items() if k not in metric_logs and _is_scalar(v))
        if custom:
            values = torch.tensor([float(logs[k]) * step.share for k in custom], dtype=torch.float64)
            reduced = self._ext.all_reduce([values], ReduceOp.SUM)[0]
            result.update({k: float(x) for k, x in zip(custom, reduced.tolist())})
        return result

    # ------------------------------------------------------------------------------ variables
    def _mark_synced(self, params: Any) -> None:
        for p in params:
            self._synced[id(p)] = p

    def _has_unsynced_variables(self) -> bool:
        return any(not sharding.is_sharded(v) and id(v.value) not in self._synced for v in self.model.weights)

    def _sync_new_variables(self) -> None:
        """Broadcasts variables the scope did not see (built lazily) and synchronises their gradients."""
        model = self.model
        weights = model.weights
        # (A sharded weight was synchronised when it was sharded; its value is a shard or the
        # gathered tensor by turns.)
        new = [v.value for v in weights if not sharding.is_sharded(v) and id(v.value) not in self._synced]
        if new and self._num_replicas > 1:
            # A collective: every replica reaches it at the same step. (Those the strategy
            # captured, in scope or inside run, it synchronises itself: adopt_variables skips them.)
            self._ext.adopt_variables(p for p in new if isinstance(p, torch.nn.Parameter))
        for p in new:
            self._synced[id(p)] = p
        if self._num_replicas > 1:
            # Weights thawed since the last look (fine-tuning after compile) join the strategy's
            # gradient synchronisation now, so that it is known which of them it scales itself.
            self._ext.sync_variables()
            for v in model.trainable_weights:
                # A sharded weight's gradient is computed for its gathered parameter.
                gathered = sharding.gathered_parameter(v)
                p = v.value if gathered is None else gathered
                if p.requires_grad and p not in _SCALED and not self._ext.gradient_sync.scales(p):
                    p.register_hook(self._grad_scale)
                    _SCALED[p] = self._grad_scale
            if not self._decorrelated:
                self._decorrelated = True
                self._decorrelate_seeds(model)

    def _decorrelate_seeds(self, model: Any) -> None:
        """Gives each replica its own dropout (and other random-layer) stream.

        Seed-generator state created in scope was broadcast from the chief, so replicas would draw
        the same masks for their different rows; offsetting the seed by the replica index keeps
        the chief's stream (and one-device behaviour) and makes the others independent.
        """
        if self._rank == 0:
            return
        for v in model.variables:
            if v.path.endswith("seed_generator_state") and not _is_float(v):
                offset = torch.tensor([self._rank * 1_000_003, 0], dtype=v.value.dtype)
                v.assign(v.value + offset)


def _summed_loss(model: Any, strategy: "Strategy") -> bool:
    """Whether ``model``'s compiled loss sums over the batch (``reduction="sum"``) rather than
    averaging: its replicas' gradients then add up without scaling, as TF sums them (its Keras
    scales only mean reductions by the number of replicas).

    Raises:
        ValueError: under several replicas, a sum mixed with means (several losses), or a sum
            with losses the model adds itself (regularisers, ``add_loss``): one scale per step
            cannot serve both.
    """
    losses = [loss for loss in nest.flatten(getattr(model, "loss", None)) if loss is not None]
    summed = [getattr(loss, "reduction", None) == "sum" for loss in losses]
    if not any(summed) or strategy.num_replicas_in_sync == 1:
        return False
    if not all(summed) or len(losses) > 1 or model.losses:
        raise ValueError(
            f"The model's loss sums over the batch (reduction='sum') beside other losses "
            f"({len(losses)} compiled, {len(model.losses)} added by the model); under "
            f"{type(strategy).__name__} with {strategy.num_replicas_in_sync} replicas phalanx scales a step's "
            "gradients once, so it cannot sum one loss and average the others. Use "
            "reduction='sum_over_batch_size' (and a learning rate times the batch size), or one summed loss alone"
        )
    return True


def _held_optimizers(model: Any) -> list[Any]:
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


def _refuse_stateful_rnn(model: Any, strategy: "Strategy") -> None:
    """A stateful RNN keeps one state row per row of the batch it was built for; on several replicas
    each replica sees another part of every batch, so the states would be mixed up. tf_keras refuses
    such a layer in a strategy's scope (``base_rnn.py``): so does phalanx, when the model joins a
    strategy of more than one replica and at each ``fit``/``evaluate``/``predict``."""
    if strategy.num_replicas_in_sync == 1:
        return
    for layer in _all_layers(model):
        if getattr(layer, "stateful", False) is True:  # RNN layers and their wrappers (Bidirectional)
            raise UnsupportedLayerError(
                layer,
                "Stateful RNNs (created with `stateful=True`) are not yet supported with tf.distribute.Strategy, "
                f"nor under {type(strategy).__name__} with {strategy.num_replicas_in_sync} replicas: each replica "
                "computes on its own part of every batch, so the layer's states would not follow the rows",
                hint="train a stateful RNN on one replica (OneDeviceStrategy), or make it stateless "
                "(stateful=False) and pass the states explicitly",
            )


def _all_layers(model: Any) -> list[Any]:
    """Every layer of ``model``, nested models' layers included."""
    out: list[Any] = []
    for layer in getattr(model, "layers", []):
        out.append(layer)
        if isinstance(layer, keras.Model):
            out.extend(_all_layers(layer))
    return out


def _in_chief_only_callback(depth: int = 12) -> bool:
    """Whether a writer callback that runs on the chief alone (ModelCheckpoint, ...) is calling.

    Such a callback saves on the chief only, so its save must not wait for the other replicas.
    Keras gives no other way to tell who called ``model.save``; saves are rare, so looking at the
    callers' frames costs nothing that matters.
    """
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if isinstance(frame.f_locals.get("self"), px_callbacks.CHIEF_ONLY):
            return True
        frame = frame.f_back
    return False


def _is_scalar(value: Any) -> bool:
    if isinstance(value, (int, float, np.floating, np.integer)):
        return True
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()


def _flat_callbacks(callbacks: Any) -> list[Any]:
    if callbacks is None:
        return []
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return list(callbacks.callbacks)
    if isinstance(callbacks, (list, tuple)):
        return [cb for item in callbacks for cb in _flat_callbacks(item)]
    return [callbacks]
