"""Keras ``fit`` / ``evaluate`` / ``predict`` under ParameterServerStrategy (TF 2's, which Keras 3 dropped).

As in TF 2, the chief (coordinator) runs ``fit``; every training step is a function scheduled on
whichever worker is free; each worker reads the current variables from the parameter servers,
computes the gradients of one batch of its own input and sends them to the servers, which apply
them as they arrive (asynchronous: no worker waits for another). ``steps_per_epoch`` is the
number of steps scheduled per epoch (as TF requires it); for arrays it defaults to one pass.

Per piece:

* **The model on a worker** is rebuilt once per worker from the model's Keras config and compile
  config (``serialize_keras_object``: Sequential, functional, and registered subclassed models),
  and its variables are bound to the servers' variables, refreshed before each step.
* **Input**: arrays ``x, y`` (each worker draws shuffled batches of ``batch_size`` from them,
  seeded per worker and epoch), a re-iterable dataset (each worker iterates it over and over),
  or a :class:`DatasetCreator` / callable ``dataset_fn(input_context)`` built on every worker.
* **Optimizer**: the servers apply the update with the ``torch.optim`` equivalent of the Keras
  optimizer (:func:`torch_optimizer_config`: SGD, Adam, AdamW, RMSprop, Adagrad, with their
  hyperparameters; the learning rate, schedules included, is evaluated on the chief at each
  step). Its state lives on the servers with the variables. Adam's epsilon is applied as torch
  applies it (outside the bias correction), a difference of order ``epsilon``.
* **Logs**: each step returns its batch's loss and metrics; the epoch's values are their
  averages weighted by batch size, which is exact for the loss and for mean metrics (accuracy,
  MAE, ...) and a batch-weighted average for others (AUC, precision).
* **Callbacks** run on the chief (progress bar, ``History``, ``ModelCheckpoint``, ``EarlyStopping``
  ...), with each step's logs in order; ``model.stop_training`` ends ``fit`` after the epoch.
* **Validation, evaluate, predict** run on the chief's copy after the servers' values are pulled
  (TF's inline evaluation on the coordinator).

Example (every task runs ``train.py``: ``phalanx run --ps 2 --workers 3 train.py``)::

    strategy = phalanx.ParameterServerStrategy()     # ps and worker tasks serve here and exit
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, epochs=5, batch_size=32, steps_per_epoch=50)
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

import keras
import numpy as np
import torch

from phalanx._compat import keras as compat_keras
from phalanx._sidetable import IdentityTable
from phalanx.errors import PhalanxError
from phalanx.keras.discovery import distributed_model
from phalanx.ps import pickling

_KIND = "keras_model"
# Side tables phalanx owns, rather than attributes stuck on Keras objects.
_MODEL_CONFIG: IdentityTable[tuple[str, str]] = IdentityTable()  # model -> (config, compile config)
_PS_CONFIG: IdentityTable[dict[str, Any]] = IdentityTable()  # optimizer -> its torch.optim config


class UnsupportedOptimizerError(PhalanxError, ValueError):
    """A Keras optimizer (or an option of one) that parameter servers cannot apply."""


class DatasetCreator:
    """Builds a worker's dataset: ``dataset_fn(input_context)`` (``tf.keras.utils.experimental.DatasetCreator``).

    Args:
        dataset_fn: called on every worker, with an :class:`~phalanx.InputContext` if it takes an
            argument; returns an iterable of ``(x, y)`` or ``(x, y, sample_weight)`` batches.
    """

    def __init__(self, dataset_fn: Callable[..., Any]) -> None:
        if not callable(dataset_fn):
            raise TypeError(f"DatasetCreator needs a callable; received {type(dataset_fn).__name__}")
        self.dataset_fn = dataset_fn

    def __call__(self, input_context: Any) -> Any:
        """``dataset_fn(input_context)``, or ``dataset_fn()`` when it takes no argument."""
        import inspect

        try:
            takes = any(
                p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
                for p in inspect.signature(self.dataset_fn).parameters.values()
            )
        except (TypeError, ValueError):
            takes = True
        return self.dataset_fn(input_context) if takes else self.dataset_fn()


# ---------------------------------------------------------------------------------- optimizer
def _learning_rate(optimizer: Any) -> float:
    lr = compat_keras.learning_rate(optimizer)
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
        return float(lr(optimizer.iterations))
    if callable(lr):
        return float(lr())
    # float() of the variable's 0-d tensor: going through numpy trips numpy 2's __array__ deprecation.
    return float(getattr(lr, "value", lr))


def torch_optimizer_config(optimizer: Any) -> dict[str, Any]:
    """The ``torch.optim`` class and hyperparameters that apply ``optimizer``'s update on a server.

    Raises:
        UnsupportedOptimizerError: an optimizer or option without a torch.optim equivalent.
    """
    name = type(optimizer).__name__
    for option in ("clipnorm", "clipvalue", "global_clipnorm", "gradient_accumulation_steps"):
        if getattr(optimizer, option, None):
            raise UnsupportedOptimizerError(
                f"{name}({option}=...) cannot be applied on parameter servers",
                hint=f"drop {option}, or clip inside a custom train_step",
            )
    if getattr(optimizer, "use_ema", False):
        raise UnsupportedOptimizerError(f"{name}(use_ema=True) cannot be applied on parameter servers")
    lr = _learning_rate(optimizer)
    wd = getattr(optimizer, "weight_decay", None) or 0.0
    if name != "AdamW" and wd:
        raise UnsupportedOptimizerError(
            f"{name}(weight_decay={wd}) is decoupled in Keras but not in torch.optim",
            hint="use keras.optimizers.AdamW for weight decay",
        )
    if name == "SGD":
        # Keras: v = m*v - lr*g; w += v.  torch: b = m*b + g; w -= lr*b.  The same for a constant rate.
        return {
            "class": "SGD",
            "hyper": {"lr": lr, "momentum": float(optimizer.momentum), "nesterov": bool(optimizer.nesterov)},
        }
    if name in ("Adam", "AdamW"):
        hyper = {
            "lr": lr,
            "betas": [float(optimizer.beta_1), float(optimizer.beta_2)],
            "eps": float(optimizer.epsilon),
            "amsgrad": bool(optimizer.amsgrad),
        }
        if name == "AdamW":
            hyper["weight_decay"] = float(wd)
        return {"class": name, "hyper": hyper}
    if name == "RMSprop":
        # Keras' update (epsilon inside the square root), not torch.optim.RMSprop's: see ps/optimizers.py.
        return {
            "class": "KerasRMSprop",
            "hyper": {
                "lr": lr,
                "rho": float(optimizer.rho),
                "eps": float(optimizer.epsilon),
                "momentum": float(optimizer.momentum),
                "centered": bool(optimizer.centered),
            },
        }
    if name == "Adagrad":
        return {
            "class": "Adagrad",
            "hyper": {
                "lr": lr,
                "eps": float(optimizer.epsilon),
                "initial_accumulator_value": float(optimizer.initial_accumulator_value),
            },
        }
    raise UnsupportedOptimizerError(
        f"Keras optimizer {name} has no torch.optim equivalent for parameter servers",
        hint="use SGD, Adam, AdamW, RMSprop or Adagrad",
    )


# ---------------------------------------------------------------------------------- the worker's model
def reference(model: Any, extended: Any) -> tuple | None:
    """The persistent reference a scheduled function carries instead of the pickled chief model.

    None (pickled by value) for a model that was not built in a strategy's scope.
    """
    if distributed_model(model) is None:
        return None
    specs = []
    for v in model.variables:
        spec_json = extended.variable_json(v.value)
        if spec_json is None and v.trainable:
            raise PhalanxError(
                f"the Keras variable {v.path} was not created on the parameter servers",
                hint="create and compile the model inside `with strategy.scope():`",
            )
        specs.append(spec_json)
    cached = _MODEL_CONFIG.get(model)
    if cached is None:
        # An uncompiled model (a custom loop with its own optimizer) travels uncompiled: Keras 3.6
        # describes it as None, which compile_from_config refuses, and later Keras as {}, which
        # compile_from_config would turn into a default compile (an RMSprop of the worker's own).
        compiled = model.get_compile_config() if getattr(model, "compiled", False) else None
        cached = (json.dumps(keras.saving.serialize_keras_object(model)), json.dumps(compiled))
        _MODEL_CONFIG[model] = cached
    return (str(id(model)), cached[0], cached[1], specs)


def resolve(service: Any, payload: tuple, run: Any) -> Any:
    """The worker's model for ``payload`` (built once), its variables bound to the servers' for this run."""
    key, config, compile_config, specs = payload
    models = service.extension_state(_KIND)
    entry = models.get(key)
    if entry is None or entry[0] != (config, compile_config):
        model = keras.saving.deserialize_keras_object(json.loads(config))
        compiled = json.loads(compile_config)
        if compiled is not None:
            model.compile_from_config(compiled)
        if len(model.variables) != len(specs):
            raise PhalanxError(
                f"the model rebuilt on {service.task} has {len(model.variables)} variables; the "
                f"chief's has {len(specs)}",
                hint="the model's config must rebuild the same model",
            )
        for v, spec_json in zip(model.variables, specs):
            if spec_json is not None:
                service.adopt(spec_json, v.value)  # the Keras variable's own tensor is the worker's copy
        if getattr(model, "optimizer", None) is not None:  # Keras 3.6 has none before compile
            _send_updates_to_servers(model.optimizer)
        entry = models[key] = ((config, compile_config), model)
    model = entry[1]
    for spec_json in specs:
        if spec_json is not None:
            service.bind(spec_json, run)
    return model


def _send_updates_to_servers(optimizer: Any) -> None:
    """On a worker: ``optimizer.apply`` sends the gradients to the servers instead of updating locally."""
    from phalanx.ps.worker import active_run

    def apply(grads: Any, trainable_variables: Any = None) -> None:
        run = active_run()
        if run is None:
            raise PhalanxError("a parameter-server Keras model applied an update outside a scheduled step")
        run.service.push_gradients(list(grads), [v.value for v in trainable_variables], _PS_CONFIG[optimizer])

    object.__setattr__(optimizer, "apply", apply)


_OPTIMIZER_KIND = "keras_optimizer"


def optimizer_reference(optimizer: Any, extended: Any = None) -> tuple:
    """What a scheduled function carries instead of a Keras optimizer of the chief.

    On the worker it becomes an optimizer whose ``apply`` / ``apply_gradients`` send the gradients
    to the parameter servers, which apply them with the ``torch.optim`` equivalent (learning rate
    as it is when the function is scheduled; see :func:`torch_optimizer_config`).

    Raises:
        UnsupportedOptimizerError: the optimizer has no equivalent on the servers (at ``schedule``).
    """
    config = torch_optimizer_config(optimizer)
    return (json.dumps(keras.optimizers.serialize(optimizer)), json.dumps(config))


def resolve_optimizer(service: Any, payload: tuple, run: Any) -> Any:
    """The worker's stand-in for the chief's Keras optimizer (built once per configuration)."""
    config, server_config = payload
    cache = service.extension_state(_OPTIMIZER_KIND)
    optimizer = cache.get((config, server_config))
    if optimizer is None:
        optimizer = keras.optimizers.deserialize(json.loads(config))
        _PS_CONFIG[optimizer] = json.loads(server_config)
        _send_updates_to_servers(optimizer)
        cache[(config, server_config)] = optimizer
    return optimizer


def train_step(model: Any, iterator: Any, optimizer_config: dict[str, Any]) -> tuple[dict[str, float], int]:
    """One training step on a worker: the scheduled function of ``fit``. Returns the batch's logs and size."""
    batch = next(iterator)
    batch = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    data = keras.tree.map_structure(
        lambda t: torch.as_tensor(np.asarray(t)) if not isinstance(t, torch.Tensor) else t, batch
    )
    _PS_CONFIG[model.optimizer] = optimizer_config
    model.reset_metrics()
    logs = model.train_step(data)
    size = int(keras.tree.flatten(data[0])[0].shape[0])
    return {k: float(keras.ops.convert_to_numpy(v)) for k, v in logs.items()}, size


# ---------------------------------------------------------------------------------- input on the workers
class _ArrayBatches:
    """Shuffled batches of arrays, forever, a new order per pass (seeded per worker)."""

    def __init__(self, arrays: tuple, batch_size: int, shuffle: bool, seed: int) -> None:
        self.arrays, self.batch_size, self.shuffle, self.seed = arrays, batch_size, shuffle, seed

    def __iter__(self) -> Any:
        n = len(keras.tree.flatten(self.arrays[0])[0])
        rng = np.random.default_rng(self.seed)
        while True:
            order = rng.permutation(n) if self.shuffle else np.arange(n)
            for start in range(0, n, self.batch_size):
                idx = order[start : start + self.batch_size]
                yield keras.tree.map_structure(lambda a: np.asarray(a)[idx], self.arrays)  # noqa: B023 - applied now


def _arrays_fn(arrays: tuple, batch_size: int, shuffle: bool) -> Callable[[Any], Any]:
    def dataset_fn(ctx: Any) -> Any:
        return _ArrayBatches(arrays, batch_size, shuffle, seed=1000 + ctx.input_pipeline_id)

    return dataset_fn


def _repeat_fn(dataset: Any) -> Callable[[], Any]:
    def dataset_fn() -> Any:
        def forever() -> Any:
            while True:
                empty = True
                for batch in dataset:
                    empty = False
                    yield batch
                if empty:
                    raise ValueError("the dataset given to fit yields no batches")

        return forever()

    return dataset_fn


def _input(arguments: dict[str, Any]) -> tuple[Callable[..., Any], int | None]:
    x, y = arguments.get("x"), arguments.get("y")
    sample_weight = arguments.get("sample_weight")
    if isinstance(x, DatasetCreator) or (callable(x) and not hasattr(x, "__iter__")):
        return x, None
    if isinstance(x, (np.ndarray, torch.Tensor, list, dict)) and not _is_batch_iterable(x):
        arrays = tuple(a for a in (x, y, sample_weight) if a is not None)
        arrays = keras.tree.map_structure(lambda a: a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a), arrays)
        batch_size = arguments.get("batch_size") or 32
        n = len(keras.tree.flatten(arrays[0])[0])
        return _arrays_fn(arrays, int(batch_size), bool(arguments.get("shuffle", True))), math.ceil(n / batch_size)
    if hasattr(x, "__iter__"):
        try:
            steps = len(x)
        except TypeError:
            steps = None
        return _repeat_fn(x), steps
    raise TypeError(
        f"fit under ParameterServerStrategy takes arrays, a re-iterable dataset or a DatasetCreator; "
        f"received {type(x).__name__}"
    )


def _is_batch_iterable(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and isinstance(x[0], (tuple, list))


# ---------------------------------------------------------------------------------- the chief's loop
def fit(dm: Any, arguments: dict[str, Any]) -> Any:
    """``model.fit`` on the chief under ParameterServerStrategy; see the module docstring."""
    from phalanx.ps.cluster_coordinator import ClusterCoordinator

    model, strategy = dm.model, dm.strategy
    if getattr(model, "optimizer", None) is None:
        raise PhalanxError(
            "fit under ParameterServerStrategy needs a compiled model",
            hint="call model.compile(...) inside `with strategy.scope():`",
        )
    unsupported = {
        k: arguments[k] for k in ("validation_split", "class_weight", "validation_steps") if arguments.get(k)
    }
    if unsupported:
        raise PhalanxError(
            f"fit under ParameterServerStrategy does not support {sorted(unsupported)}",
            hint="pass validation_data instead of validation_split",
        )
    dataset_fn, default_steps = _input(arguments)
    steps = arguments.get("steps_per_epoch") or default_steps
    if not steps:
        raise PhalanxError(
            "fit under ParameterServerStrategy needs steps_per_epoch for this input",
            hint="pass steps_per_epoch=N, as TF requires with ParameterServerStrategy",
        )
    epochs, initial_epoch = int(arguments.get("epochs", 1)), int(arguments.get("initial_epoch", 0))
    verbose = arguments.get("verbose", "auto")
    verbose = 1 if verbose == "auto" else verbose
    coordinator = ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    callbacks = arguments.get("callbacks")
    if not isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = keras.callbacks.CallbackList(
            callbacks,
            add_history=True,
            add_progbar=verbose != 0,
            verbose=verbose,
            epochs=epochs,
            steps=steps,
            model=model,
        )
    model.stop_training = False
    optimizer = model.optimizer
    callbacks.on_train_begin()
    logs: dict[str, float] = {}
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()
        callbacks.on_epoch_begin(epoch)
        pending = []
        for _ in range(int(steps)):
            pending.append(coordinator.schedule(train_step, args=(model, iterator, torch_optimizer_config(optimizer))))
            optimizer.iterations.assign_add(1)  # the chief counts the steps (learning-rate schedules read it)
        totals: dict[str, float] = {}
        seen = 0
        for step, remote in enumerate(pending):
            callbacks.on_train_batch_begin(step)
            batch_logs, size = remote.fetch()
            seen += size
            for k, v in batch_logs.items():
                totals[k] = totals.get(k, 0.0) + v * size
            logs = {k: v / seen for k, v in totals.items()}
            callbacks.on_train_batch_end(step, logs)
        coordinator.join()  # every step applied; the chief's copy holds the servers' values
        if arguments.get("validation_data") is not None and _due(epoch, arguments.get("validation_freq", 1)):
            logs.update(
                {
                    f"val_{k}": v
                    for k, v in _evaluate(
                        model,
                        arguments["validation_data"],
                        arguments.get("validation_batch_size") or arguments.get("batch_size"),
                    ).items()
                }
            )
        callbacks.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    callbacks.on_train_end(logs)
    return model.history


def _due(epoch: int, freq: Any) -> bool:
    return (epoch + 1) in freq if isinstance(freq, (list, tuple, set)) else (epoch + 1) % int(freq) == 0


def _evaluate(model: Any, data: Any, batch_size: Any) -> dict[str, float]:
    if isinstance(data, tuple) and len(data) in (2, 3):
        args: dict[str, Any] = {"x": data[0], "y": data[1], "sample_weight": data[2] if len(data) == 3 else None}
    else:
        args = {"x": data}
    return type(model).evaluate(model, **args, batch_size=batch_size, verbose=0, return_dict=True)


# A Keras model built in scope travels to the workers as a reference: each worker rebuilds it once
# from its config and binds its variables to the servers', instead of unpickling a copy with its
# weights every step.
pickling.register_reference(_KIND, keras.Model, reference, resolve)
# A Keras optimizer used in a scheduled function (a custom loop's apply_gradients) becomes, on the
# worker, one that sends its gradients to the servers.
pickling.register_reference(_OPTIMIZER_KIND, keras.optimizers.Optimizer, optimizer_reference, resolve_optimizer)
